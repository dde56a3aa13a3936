"""One rank's ring on one device (ringfa4.ring.simulate): any rank of any W, transfers as copies,
gives that rank's exact out, lse and dq: the ring's own step code checked at W no process group
on two CPU cores could run."""
import itertools
import random
import weakref

import torch

import ringfa4.backends.torch_ref as torch_ref
from reference import attention_fp64
from ringfa4.ring.layout import part, required_multiple
from ringfa4.ring.simulate import Rank

TOL = 1e-9


def _full(seq, h, hk, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, n, d, dtype=torch.float64, generator=gen) for n in (h, hk, hk, h)]


def _reference(q, k, v, dout, causal):
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_fp64(*full, causal=causal)
    dq, = torch.autograd.grad(out, full[0], dout)
    return out, lse, dq


def _assert_rank_exact(got, expected, case):
    for name, g, e in zip(("out", "lse", "dq"), got, expected):
        err = (g - e).abs().max().item()
        assert g.shape == e.shape and err < TOL, f"{name} error {err:.3g} ({case})"


def test_any_rank_of_a_ring_of_any_size_gets_exact_out_lse_and_dq():
    torch_ref.BLOCK = 8
    seed = random.randrange(2**31)
    for world, layout, causal in itertools.product((5, 8, 72), ("zigzag", "contiguous"), (False, True)):
        chunk = 2 if world == 72 else 4
        q, k, v, dout = _full(chunk * required_multiple(world, layout), 4, 2, 16, seed)
        out, lse, dq = _reference(q, k, v, dout, causal)
        for rank in sorted({0, world // 2, world - 1}):
            got = Rank(torch_ref, q, k, v, dout, causal, 16 ** -0.5, rank, world, layout)()[:3]
            expected = [part(t, rank, world, layout, dim=2 if t is lse else 1) for t in (out, lse, dq)]
            _assert_rank_exact(got, expected, f"W={world} rank={rank} {layout} causal={causal} seed={seed}")


def test_a_member_of_a_head_group_runs_the_ring_of_its_heads_exactly():
    torch_ref.BLOCK = 8
    seed = random.randrange(2**31)
    head_world, ring_world, h, hk = 4, 3, 8, 2
    for layout, causal in itertools.product(("zigzag", "contiguous"), (False, True)):
        q, k, v, dout = _full(2 * required_multiple(ring_world, layout, head_world), h, hk, 16, seed)
        out, lse, dq = _reference(q, k, v, dout, causal)
        for member in (0, head_world - 1):
            qh = slice(member * h // head_world, (member + 1) * h // head_world)
            kvh = slice(member * hk // head_world, member * hk // head_world + 1)  # U > hk: one kv head each
            for rank in (0, ring_world - 1):
                sim = Rank(torch_ref, q[:, :, qh], k[:, :, kvh], v[:, :, kvh], dout[:, :, qh], causal, 16 ** -0.5,
                           rank, ring_world, layout, head_world=head_world, seq_heads=(h, hk))
                expected = [part(out[:, :, qh], rank, ring_world, layout), part(lse[:, qh], rank, ring_world, layout, 2),
                            part(dq[:, :, qh], rank, ring_world, layout)]
                _assert_rank_exact(sim()[:3], expected, f"member {member} ring rank {rank} {layout} causal={causal}")


class _Watching:
    """torch_ref whose backward first checks that no earlier call's dK/dV is still alive."""

    def __init__(self):
        self.alive, self.calls = [], 0

    def __getattr__(self, name):
        return getattr(torch_ref, name)

    def backward(self, *args, **kwargs):
        held = sum(ref() is not None for ref in self.alive)
        assert held == 0, f"{held} dK/dV of an earlier step alive at backward call {self.calls}"
        dq, dk, dv = torch_ref.backward(*args, **kwargs)
        self.alive += [weakref.ref(dk), weakref.ref(dv)]
        self.calls += 1
        return dq, dk, dv


def test_a_steps_dk_dv_are_freed_before_the_next_steps_call():
    # Rank 1 of a causal zigzag ring of 2: its first backward step covers half of the block, so
    # that step's dK/dV are added into the block's sums and the local step's call (the ring's
    # peak of memory) must not find them held.
    torch_ref.BLOCK = 8
    q, k, v, dout = _full(32, 4, 2, 16, 0)
    backend = _Watching()
    Rank(backend, q, k, v, dout, True, 16 ** -0.5, 1, 2, "zigzag")()
    assert backend.calls == 2
