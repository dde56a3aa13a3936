"""Forward and backward rings, and the autograd.Function that joins them.

Forward: at step i rank r holds the KV block of rank r - i. The caller's k, v are sent at step 0
and never written; up to two more KV buffers, allocated once per call, alternate as receive targets
(step i receives into the one that step i-1 computed on). Every transfer is posted before the
step's compute and waited for (by the compute stream, not the host) after it, so it runs behind
that compute.

Backward: the ring turns around and visits the blocks in the opposite order, ending on the local
one: step j holds the block of rank r + 1 + j. Its first block is the one the forward ended with
(kept for it), its last is the rank's own, so for W ranks only W - 2 KV blocks travel. The dK/dV
sums of a block go round with it and reach home during the local step, whose compute hides that
last transfer as well: no transfer is left exposed.

With packed documents no rank may need blocks from farther than h hops (RingDocuments.steps):
the forward then takes steps 0..h, the backward h + 1 steps from the block of rank r - h, and
every block travels h hops instead of W - 1. Without documents the ring takes W steps. Of a block
(and of its dK/dV sums) the transfers carry only the rows other ranks read (RingDocuments.carried):
the documents that cross ranks, often a few thousand of a block's rows.
"""
import torch

from ringfa4.documents import call_kwargs
from ringfa4.ring import timeline
from ringfa4.ring.documents import count_saved
from ringfa4.ring.comm import Ring
from ringfa4.ring.merge import merge_
from ringfa4.ring.schedule import plan, row_chunk


def _empty_like(tensors, dtype=None):
    return [torch.empty_like(t, dtype=dtype) for t in tensors]


def _sum_dtype(x, lse, steps):
    """Where partial sums of the output and of dK/dV live between ring steps.

    With two steps every row gets exactly one later term, so the sum is taken once, in fp32 inside
    the add or merge, and rounded once: keeping it in the input dtype gives the same bits as an fp32
    buffer cast at the end, without the casts. More steps sum several terms: fp32 (fp64 for fp64).
    """
    return x.dtype if steps == 2 else lse.dtype


def _in_shares(kv, step, dtype, ids):
    """Whether a backward call's dK/dV are best summed in the ring's ``dtype``: a non-causal call
    with documents where the sums are wider than the inputs. Such calls give every query head a
    CTA (ringfa4.backends.cute.interface.head_splits), which sums dK/dV in fp32 anyway: added
    into fp32 buffers they reach the ring's sums without a bf16 copy made and widened again,
    and the call holds one buffer instead of two."""
    return dtype != kv[0].dtype and ids is not None and not step.causal


def _fresh_sums(kv, step, dtype, ids):
    """dK/dV buffers for one backward call to add its gradients into: zeros in the sums' dtype
    where _in_shares. Else none: the backend returns new ones (a dense or causal step stores them
    in the input dtype, half the memory)."""
    if not _in_shares(kv, step, dtype, ids):
        return {}
    return {name: torch.zeros(t[:, step.kv].shape, dtype=dtype, device=t.device) for name, t in zip(("dk", "dv"), kv)}


def _sums_at(dkv, step):
    """The block's sums at a call's key rows, for the backend to add its dK/dV into."""
    return {"dk": dkv[0][:, step.kv], "dv": dkv[1][:, step.kv]}


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _carried(docs, source, causal, length):
    """The rows of ``source``'s block that its transfers carry: all ``length`` without documents."""
    return slice(0, length) if docs is None else docs.carried(source, causal)


def _transfer(ring, phase, send, send_rows, recv, recv_rows, **kwargs):
    """ring.start for blocks of which only send_rows / recv_rows travel; counts what stays home."""
    row_bytes = _nbytes(send) // max(1, send[0].shape[1])
    sent = len(range(*send_rows.indices(send[0].shape[1])))
    count_saved(phase, 0 if sent else 1, (send[0].shape[1] - sent) * row_bytes)
    return ring.start(send, recv, send_rows, recv_rows, **kwargs)


def _calls(step, docs, source, causal, phase, kv, halved=False):
    """[(step, doc_ids)]: the backend calls of a ring step (ringfa4.ring.schedule.plan's ``step``,
    None: none), cut to the rows that share documents with ``docs`` (``halved``: see
    RingDocuments.calls)."""
    if docs is not None:
        return docs.calls(step, source, causal, phase, kv, halved)
    return [] if step is None else [(step, None)]


def _arrived(ring, works, dkv, inbox, device, j):
    """(sums, free buffer) once the block's sums have arrived in ``inbox`` and ``dkv`` is sent."""
    waiting = timeline.begin(device)
    ring.wait(works)
    timeline.end(waiting, "bwd", j, "wait_dkv")
    return inbox, dkv


def _add(dkv, grads):
    """Add each call's dK/dV into the block's sums, at its key rows."""
    for rows, g in grads:
        for acc, t in zip(dkv, g):
            acc[:, rows].add_(t)


def _whole(grads, length, dtype):
    """[dk, dv] of a step's calls in ``dtype`` when one call covers the block's ``length`` rows,
    else None."""
    if len(grads) == 1 and grads[0][0] == slice(0, length):
        return [g.to(dtype) for g in grads[0][1]]
    return None


def _zeros_at(kv, dtype, rows):
    """Sums for a block, zero at ``rows``: the rows its transfers carry (no other row is sent,
    nor taken into the rank's own sums at the local step), or all of them."""
    sums = _empty_like(kv, dtype)
    for t in sums:
        t[:, rows].zero_()
    return sums


def _added_at(dkv, received, rows):
    """``dkv`` with ``received`` added at ``rows`` (the same bits as adding dkv into received,
    zero elsewhere: each row gets one add or none, and adds commute)."""
    for acc, t in zip(dkv, received):
        acc[:, rows].add_(t[:, rows])
    return dkv


def ring_forward(backend, q, k, v, causal, softmax_scale, ring, layout, docs=None):
    """(out, lse, the last KV block held), the block being what the backward starts with.

    ``ring``: a comm.Ring (or a stand-in with its rank, world, start and wait, ringfa4.ring.simulate).
    ``docs``: a ringfa4.ring.documents.RingDocuments of this call, or None (no documents)."""
    rank, world = ring.rank, ring.world
    steps = world if docs is None else docs.steps(causal)
    kv = [k.contiguous(), v.contiguous()]
    targets = [_empty_like(kv) for _ in range(min(2, steps - 1))]
    count_saved("fwd", world - steps, (world - steps) * _nbytes(kv))
    out = lse = None
    for i in range(steps):
        last = i + 1 == steps
        source = (rank - i) % world
        held, arriving = (_carried(docs, s % world, causal, k.shape[1]) for s in (source, source - 1))
        works = [] if last else _transfer(ring, "fwd", kv, held, targets[i % 2], arriving, span=("fwd", i, "kv"))
        started = timeline.begin(q.device)
        for step, ids in _calls(plan(rank, source, layout, causal, q.shape[1]), docs, source, causal, "fwd", kv):
            o, l = backend.forward(q[:, step.q], kv[0][:, step.kv], kv[1][:, step.kv], step.causal, softmax_scale,
                                   **call_kwargs(ids))
            if out is None:  # step 0, the local block, always one call over every query row
                out, lse = o.to(_sum_dtype(q, l, steps)), l
            else:
                merging = timeline.begin(q.device)
                merge_(out[:, step.q], lse[:, :, step.q], o, l)
                timeline.end(merging, "fwd", i, "merge")
            del o, l  # merged: held on, the call's partial would stay alive through the next call
        timeline.end(started, "fwd", i, "compute")
        if not last:
            ring.wait(works)
            kv = targets[i % 2]
    return out.to(q.dtype), lse, kv


def ring_backward(backend, dout, q, k, v, out, lse, kv_first, causal, softmax_scale, ring, layout, deterministic,
                  docs=None):
    """dq stays home in the backend's query state, which every step adds into.

    ``ring`` turns the other way (sends to the previous rank). A step has the backend put dK/dV
    of its block in fresh buffers (_fresh_sums) while the sums of that block are still in flight
    from the next rank, and adds them once they have arrived (with documents, a remote step's
    calls after its first add straight into the arrived sums). The local step ends the sums of
    the rank's own block: they are the result.
    """
    rank, world = ring.rank, ring.world
    steps = world if docs is None else docs.steps(causal)
    kv = kv_first
    targets = [_empty_like(kv) for _ in range(min(2, steps - 2))]
    kv_saved = max(0, world - 2) - max(0, steps - 2)
    count_saved("bwd", kv_saved + world - steps, (kv_saved + world - steps) * _nbytes(kv))
    chunk = row_chunk(layout, causal, q.shape[1], narrowed=docs is not None)
    queries = backend.query_state(dout, q, out, lse, softmax_scale, chunk, deterministic)
    sum_dtype = _sum_dtype(k, lse, steps)
    dkv = inbox = None
    dkv_works = []
    for j in range(steps):
        local = j + 1 == steps
        source = (rank - steps + 1 + j) % world
        held, arriving = (_carried(docs, s % world, causal, k.shape[1]) for s in (source, source + 1))
        # The block of step j + 1 travels during step j; the local one is already here.
        kv_works = (_transfer(ring, "bwd", kv, held, targets[j % 2], arriving, span=("bwd", j, "kv"))
                    if j + 2 < steps else [])
        started = timeline.begin(q.device)
        # A remote step's calls whose dK/dV _in_shares would hold a third fp32 block beside the
        # sums being sent and those arriving (the dense ring holds bf16 there: the long-document
        # ring peaked 7% over it at W = 4). So its first call (or the first half of its one call,
        # halved) adds into fresh sums, and the others straight into the sums once they arrived.
        early = j > 0 and not local and docs is not None and sum_dtype != k.dtype
        arrived = False
        grads = []  # (key rows, (dk, dv)) of each call not added into the sums
        for n, (step, ids) in enumerate(_calls(plan(rank, source, layout, causal, q.shape[1]), docs, source, causal,
                                               "bwd", kv, halved=early)):
            direct = early and n > 0 and _in_shares(kv, step, sum_dtype, ids)
            if direct and not arrived:
                dkv, inbox = _arrived(ring, dkv_works, dkv, inbox, q.device, j)
                arrived = True
            rows = step.q
            # (dk, dv) go straight into a list, the sums given inline: a name left holding either
            # would keep the last call's alive through the next step's call (the long-document
            # ring's peak, 3% over dense). A direct call's are views of the sums: nothing to add.
            ([] if direct else grads).append((step.kv, backend.backward(
                dout[:, rows], q[:, rows], kv[0][:, step.kv], kv[1][:, step.kv], out[:, rows],
                lse[:, :, rows], step.causal, softmax_scale, dq=queries.rows(rows), deterministic=deterministic,
                **(_sums_at(dkv, step) if direct else _fresh_sums(kv, step, sum_dtype, ids)), **call_kwargs(ids),
            )[1:]))
        if j == 0:  # this block's sums start here
            dkv = _whole(grads, k.shape[1], sum_dtype)
            if dkv is None:
                dkv = _zeros_at(kv, sum_dtype, slice(0, k.shape[1]) if local else held)
                _add(dkv, grads)
            grads = []  # in the sums now: not held while the inbox is made
            inbox = _empty_like(dkv)
        timeline.end(started, "bwd", j, "compute")
        if j > 0:
            if not arrived:
                dkv, inbox = _arrived(ring, dkv_works, dkv, inbox, q.device, j)
            if local and held != slice(0, k.shape[1]):
                # The rows no transfer carried hold another block's sums; the rank's dK, dV has none there.
                own = _whole(grads, k.shape[1], sum_dtype)
                if own is not None:  # its own gradients, and what came home added at the carried rows
                    dkv, grads = _added_at(own, dkv, held), []
                else:
                    for t in dkv:
                        t[:, :held.start].zero_()
                        t[:, held.stop:].zero_()
            _add(dkv, grads)
        if not local:
            dkv_works = _transfer(ring, "bwd", dkv, held, inbox, arriving, tag=1, span=("bwd", j, "dkv"))
            ring.wait(kv_works)
            if j + 2 < steps:
                kv = targets[j % 2]
            else:  # the local block is next: the receive buffers have served
                kv, targets = [k, v], []
    # Dropped before dQ's buffer is made, the ring's peak of memory at W >= 3: the other sums
    # buffer and the local call's dK/dV, then the sums once cast (own may hold them too).
    inbox = grads = None
    dk, dv = (t.to(k.dtype) for t in dkv)
    dkv = own = None
    return queries.dq(), dk, dv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, softmax_scale, group, layout, deterministic, docs=None):
        ring = Ring(group, q.device)
        out, lse, (k_last, v_last) = ring_forward(backend, q, k, v, causal, softmax_scale, ring, layout, docs)
        ctx.save_for_backward(q, k, v, out, lse, k_last, v_last)
        ctx.args = (causal, softmax_scale, ring.turned(), layout, deterministic, docs)
        ctx.backend = backend
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # as ringfa4.api._Attention: dout is never None
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, k_last, v_last = ctx.saved_tensors
        grads = ring_backward(ctx.backend, dout, q, k, v, out, lse, [k_last, v_last], *ctx.args)
        return grads + (None,) * 7
