"""The ring over gloo processes equals single-process fp64 attention on the full sequence."""
import itertools
import random

import pytest
import torch

import ringfa4
import ringfa4.backends.torch_ref as torch_ref
from distributed import run
from reference import attention_fp64

TOL = 1e-9
# (batch, heads, kv_heads, head_dim, softmax_scale, chunk): GQA ratios 1, 2, 4, MQA; odd head dims.
SHAPES = [
    (1, 4, 4, 64, None, 24),
    (2, 4, 2, 80, 0.3, 16),
    (1, 8, 2, 128, None, 8),
    (2, 6, 1, 24, 1.7, 12),
]


def _cases():
    return list(itertools.product(("zigzag", "contiguous"), (False, True), SHAPES))


def _check_cases(rank, world, seed):
    # Small KV blocks so that the blockwise reference runs several blocks per ring step.
    torch_ref.BLOCK = 16
    for layout, causal, (b, h, hk, d, scale, chunk) in _cases():
        case = f"W={world} layout={layout} causal={causal} b={b} h={h} hk={hk} d={d} scale={scale} seed={seed}"
        gen = torch.Generator().manual_seed(seed)
        seq = chunk * ringfa4.ring.layout.num_chunks(world, layout)
        q, k, v, dout = (
            torch.randn(b, seq, n, d, dtype=torch.float64, generator=gen) for n in (h, hk, hk, h)
        )
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = attention_fp64(*full, causal=causal, softmax_scale=scale)
        ref_grads = torch.autograd.grad(ref_out, full, dout)

        local = [ringfa4.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
        before = [t.detach().clone() for t in local]
        out, lse = ringfa4.ring_attention(
            *local, causal=causal, softmax_scale=scale, layout=layout, backend="torch", return_lse=True
        )
        grads = torch.autograd.grad(out, local, ringfa4.shard(dout, layout=layout))

        expected = {
            "out": ringfa4.shard(ref_out, layout=layout),
            "lse": ringfa4.shard(ref_lse, dim=2, layout=layout),
            **{f"d{n}": ringfa4.shard(g, layout=layout) for n, g in zip("qkv", ref_grads)},
        }
        for name, t, saved in zip("qkv", local, before):
            assert torch.equal(t, saved), f"rank {rank}: the ring wrote into its input {name} ({case})"
        got = {"out": out, "lse": lse, **{f"d{n}": g for n, g in zip("qkv", grads)}}
        for name, ref in expected.items():
            err = (got[name] - ref).abs().max().item()
            assert got[name].shape == ref.shape and err < TOL, f"rank {rank}: {name} error {err:.3g} ({case})"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_forward_and_backward_match_fp64_attention(world):
    run(_check_cases, world, random.randrange(2**31))


def _check_fp32_and_dtype(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 64, n, 32, generator=gen) for n in (4, 2, 2))
    ref, _ = attention_fp64(q, k, v, causal=True)
    local = [ringfa4.shard(t) for t in (q, k, v)]
    out = ringfa4.ring_attention(*local, causal=True, backend="torch")
    assert out.dtype == torch.float32
    err = (out.double() - ringfa4.shard(ref)).abs().max().item()
    assert err < 1e-5, f"rank {rank}: fp32 ring error {err:.3g}"


def test_ring_keeps_the_input_dtype_and_fp32_accuracy():
    run(_check_fp32_and_dtype, 2, random.randrange(2**31))


def _check_single_rank_group(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 10, 2, 16, dtype=torch.float64, generator=gen) for _ in range(3))
    solo = torch.distributed.new_group([rank])  # every rank must create every group
    for r in range(world):
        if r != rank:
            torch.distributed.new_group([r])
    out, lse = ringfa4.ring_attention(q, k, v, causal=True, group=solo, backend="torch", return_lse=True)
    ref_out, ref_lse = attention_fp64(q, k, v, causal=True)
    assert (out - ref_out).abs().max() < TOL and (lse - ref_lse).abs().max() < TOL


def test_single_rank_group_is_plain_attention():
    run(_check_single_rank_group, 2, random.randrange(2**31))


def _check_head_group_alone_keeps_deterministic(rank, world, seed):
    """U x 1 (no ring: one attention call per rank after the all-to-all) still hands deterministic
    to the backend's backward."""
    ring, head = grid_groups(rank, world, world, 1)
    seen, real = [], torch_ref.backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    torch_ref.backward = spy
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, 32, 4, 16, dtype=torch.float64, generator=gen) for _ in range(3)]
    local = [ringfa4.shard(t, group=ring, head_group=head).requires_grad_() for t in full]
    out = ringfa4.ring_attention(*local, causal=True, group=ring, head_group=head, backend="torch", deterministic=True)
    out.sum().backward()
    assert seen == [True]


def test_head_group_without_a_ring_keeps_deterministic():
    run(_check_head_group_alone_keeps_deterministic, 2, random.randrange(2**31))


def grid_groups(rank, world, head_world, ring_world):
    """(ring group, head group) of ``rank``, the world cut into blocks of U x R ranks that each form a
    grid: rank = block * U * R + r * U + u, so a head group is U consecutive ranks (the fastest
    domain). Every rank creates every group, in the same order."""
    size = head_world * ring_world
    ring = head = None
    for base in range(0, world, size):
        for members in ([base + r * head_world + u for r in range(ring_world)] for u in range(head_world)):
            g = torch.distributed.new_group(members)
            ring = g if rank in members else ring
        for members in ([base + r * head_world + u for u in range(head_world)] for r in range(ring_world)):
            g = torch.distributed.new_group(members)
            head = g if rank in members else head
    return ring, head


# (batch, heads, kv_heads, head_dim, softmax_scale, chunk) per head group size U: kv heads split
# over the group, and kv heads fewer than U (each replicated to U / kv_heads members).
SHAPES_2D = {
    1: [(1, 4, 2, 16, None, 4)],
    2: [(1, 4, 2, 16, None, 4), (2, 4, 1, 24, 0.7, 2)],
    4: [(1, 8, 8, 16, None, 2), (1, 4, 2, 16, 0.5, 2)],
}


def _check_2d(rank, world, splits, seed):
    """Every (U, R) of ``splits`` in turn, each on every block of U x R ranks at once."""
    torch_ref.BLOCK = 8
    for head_world, ring_world in splits:
        ring, head = grid_groups(rank, world, head_world, ring_world)
        for layout, causal, shape in itertools.product(("zigzag", "contiguous"), (False, True), SHAPES_2D[head_world]):
            _check_2d_case(rank, ring, head, layout, causal, shape, seed)


def _check_2d_case(rank, ring, head, layout, causal, shape, seed):
    b, h, hk, d, scale, chunk = shape
    head_world, ring_world = (torch.distributed.get_world_size(g) for g in (head, ring))
    case = f"U={head_world} R={ring_world} layout={layout} causal={causal} h={h} hk={hk} d={d} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    seq = chunk * ringfa4.ring.layout.required_multiple(ring_world, layout, head_world)
    q, k, v, dout = (torch.randn(b, seq, n, d, dtype=torch.float64, generator=gen) for n in (h, hk, hk, h))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_fp64(*full, causal=causal, softmax_scale=scale)
    ref_grads = torch.autograd.grad(ref_out, full, dout)

    def mine(t, dim=1):
        return ringfa4.shard(t, dim=dim, group=ring, layout=layout, head_group=head)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out, lse = ringfa4.ring_attention(*local, causal=causal, softmax_scale=scale, group=ring, head_group=head,
                                      layout=layout, backend="torch", return_lse=True)
    grads = torch.autograd.grad(out, local, mine(dout))
    got = {"out": out, "lse": lse, **{f"d{n}": g for n, g in zip("qkv", grads)}}
    expected = {"out": mine(ref_out), "lse": mine(ref_lse, dim=2),
                **{f"d{n}": mine(g) for n, g in zip("qkv", ref_grads)}}
    for name, ref in expected.items():
        err = (got[name] - ref).abs().max().item()
        assert got[name].shape == ref.shape and err < TOL, f"rank {rank}: {name} error {err:.3g} ({case})"
    full_out = ringfa4.unshard(out.detach(), group=ring, layout=layout, head_group=head)
    assert (full_out - ref_out).abs().max().item() < TOL, f"rank {rank}: unshard ({case})"


def test_heads_x_ring_matches_fp64_attention_1x2_2x1_2x2():
    run(_check_2d, 4, [(1, 2), (2, 1), (2, 2)], random.randrange(2**31))


@pytest.mark.slow
@pytest.mark.parametrize("world,split", [(6, (2, 3)), (8, (4, 2))])
def test_heads_x_ring_matches_fp64_attention_2x3_4x2(world, split):
    run(_check_2d, world, [split], random.randrange(2**31))
