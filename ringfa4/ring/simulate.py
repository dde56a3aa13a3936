"""One rank of a ring on one device: the rank's exact sequence of ring steps (ring_forward and
ring_backward, the same code that runs over NCCL) with every transfer replaced by a device copy
on a side stream, for any W = U x R (python -m ringfa4.ring.simulate --help).

The rank holds its own queries and sees every KV block it would receive (the simulator keeps the
KV of all R ring shards on the device and copies the one the previous rank would send), so its
out, lse and dq are exact; a received dK/dV sum is a copy of the rank's own outgoing sum (what
the other ranks add to it is not simulated), so dk and dv are not. With a head group (U > 1) the
rank's ring runs on its h/U heads over its ring shard, and the all-to-alls before and after it
run their packing and unpacking with the exchange itself a copy on the side stream that the
compute stream waits for (an all-to-all is not hidden behind compute).

On CPU the copies are plain copies: an exact test of any rank of any W without processes.
On a GPU bench/simulate.py times the rank: per-step compute spans (ringfa4.ring.timeline) and the
whole call, and (--overhead) the call captured once in a CUDA graph and replayed, which shows
what the ring's per-step host work (launches, Python) costs: the difference between the two.
"""
import torch

from ringfa4.ring import heads, timeline
from ringfa4.ring.attention import ring_backward, ring_forward
from ringfa4.ring.layout import part


class SimulatedRing:
    """Stand-in for comm.Ring: rank ``rank`` of ``world``, receiving copies of ``blocks[source]``
    ([k, v] of every ring rank) in the order the real ring would deliver them to a call of
    ``steps`` steps (default W; fewer with documents: RingDocuments.steps)."""

    def __init__(self, rank, world, blocks, device, reverse=False, stream=None, steps=None):
        self.rank, self.world, self.blocks, self.device, self.reverse = rank, world, blocks, device, reverse
        self.steps = world if steps is None else steps
        if stream is None and device.type == "cuda":
            stream = torch.cuda.Stream(device=device)
        self.stream = stream
        self._kv_received = 0

    def turned(self):
        return SimulatedRing(self.rank, self.world, self.blocks, self.device, not self.reverse, self.stream,
                             self.steps)

    def _source(self):
        """The ring rank whose KV block the next receive carries: forward step i receives the block
        of rank r - 1 - i; backward step j (which starts on the block of r - steps + 1) that of
        r - steps + 2 + j."""
        n = self._kv_received
        self._kv_received += 1
        return (self.rank - self.steps + 2 + n if self.reverse else self.rank - 1 - n) % self.world

    def start(self, send, recv, send_rows=slice(None), recv_rows=slice(None), tag=0, span=None):
        sources = self.blocks[self._source()] if tag == 0 else send
        pairs = [(t[:, recv_rows], s[:, recv_rows]) for t, s in zip(recv, sources)]
        if self.stream is None:
            for t, s in pairs:
                t.copy_(s)
            return []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            started = timeline.begin(self.device) if span else None
            for t, s in pairs:
                t.copy_(s, non_blocking=True)
            if started is not None:
                timeline.end(started, *span)
            done = torch.cuda.Event()
            done.record()
        return [done]

    def wait(self, works):
        for event in works:
            torch.cuda.current_stream(self.device).wait_event(event)


def side_exchange(stream):
    """An all-to-all stand-in: recv <- send on ``stream`` (None: in place), the caller's stream waiting for it."""
    def exchange(recv, send):
        if stream is None:
            recv.copy_(send)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            recv.copy_(send, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)
    return exchange


class Rank:
    """One simulated rank: ring rank ``rank`` of ``ring_world``, member of a head group of ``head_world``.

    q, dout: (b, U*L, h/U, d) and kv: [k, v] (b, S, hk', d), the full sequence of the rank's heads
    (hk' = max(hk/U, 1)); ``seq_heads`` = (h, hk) before the all-to-all (U > 1 only).
    """

    def __init__(self, backend, q, k, v, dout, causal, softmax_scale, rank, ring_world, layout,
                 head_world=1, seq_heads=None, deterministic=False):
        self.backend, self.causal, self.scale, self.layout = backend, causal, softmax_scale, layout
        self.deterministic = deterministic
        self.rank, self.world, self.head_world = rank, ring_world, head_world
        self.blocks = [[part(t, r, ring_world, layout) for t in (k, v)] for r in range(ring_world)]
        self.q = part(q, rank, ring_world, layout)
        self.dout = part(dout, rank, ring_world, layout)
        self.stream = torch.cuda.Stream(device=q.device) if q.is_cuda else None
        self.seq_side = None
        if head_world > 1:  # the rank's tensors before the all-to-all, for its passes (content unused)
            b, total, _, d = self.q.shape
            h, hk = seq_heads
            local = total // head_world
            self.seq_side = [torch.randn(b, local, n, d, dtype=q.dtype, device=q.device) for n in (h, hk, hk, h)]

    def _a2a(self, x, to_heads, copies=1):
        exchange = side_exchange(self.stream)
        if to_heads:
            return heads.to_heads(x, self.head_world, copies, exchange)
        return heads.to_seq(x, self.head_world, copies, exchange)

    def __call__(self):
        """One forward and backward of this rank: (out, lse, dq, dk, dv) in the ring's head layout."""
        q, (k, v) = self.q, self.blocks[self.rank]
        copies = 1
        if self.seq_side is not None:  # before the ring: q, k, v to heads (results replaced by the rank's own)
            sq, sk, sv, _ = self.seq_side
            copies = heads.replicas(sk.shape[2], self.head_world)
            self._a2a(sq, True), self._a2a(sk, True, copies), self._a2a(sv, True, copies)
        ring = SimulatedRing(self.rank, self.world, self.blocks, q.device, stream=self.stream)
        out, lse, kv_last = ring_forward(self.backend, q, k, v, self.causal, self.scale, ring, self.layout)
        if self.seq_side is not None:  # out and lse back to the sequence; then dout to heads
            self._a2a(out, False), self._a2a(lse.transpose(1, 2).unsqueeze(-1).contiguous(), False)
            self._a2a(self.seq_side[3], True)
        dq, dk, dv = ring_backward(self.backend, self.dout, q, k, v, out, lse, kv_last, self.causal, self.scale,
                                   ring.turned(), self.layout, self.deterministic)
        if self.seq_side is not None:  # gradients back to the sequence
            self._a2a(dq, False), self._a2a(dk, False, copies), self._a2a(dv, False, copies)
        return out, lse, dq, dk, dv
