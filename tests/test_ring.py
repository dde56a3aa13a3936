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
