"""Backward allocates nothing for the attention's outputs that have no gradient.

lse, the ring's last KV block and the heads ring's saved tensors are outputs autograd would
otherwise hand to backward as zero tensors of their full size, filled on every step. Around
backward a dispatch mode records every tensor created zero-filled or through an aten op outside
ringfa4's own backward operators (whose insides it does not see).
"""
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ringfa4
from ringfa4.nn import ContextParallelAttention
from ringfa4.train import launch

aten = torch.ops.aten
ZERO_FILLS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.full.default,
              aten.full_like.default, aten.fill_.Scalar, aten.zero_.default)


class ZeroFills(TorchDispatchMode):
    """Shapes of the tensors zero-filled while on."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in ZERO_FILLS:
            self.shapes.append(tuple(result.shape))
        return result


def qkv(seq=64, heads=4, kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, seq, kv_heads, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def fills_in_backward(out):
    with ZeroFills() as fills:
        out.pow(2).sum().backward()
    return fills.shapes


def test_public_attention_backward_fills_nothing_for_lse():
    q, k, v = qkv()
    out, lse = ringfa4.attention(q, k, v, causal=True, backend="torch")
    # The torch reference's own accumulators are zero-filled; lse's gradient is not.
    assert tuple(lse.shape) not in fills_in_backward(out)
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_attention_operator_backward_fills_nothing():
    q, k, v = qkv()
    assert fills_in_backward(ContextParallelAttention(backend="torch")(q, k, v)) == []


def _ring_fills(cp_heads, rank, world, local_rank):
    with launch.process_group("cpu", rank, world, local_rank):
        q, k, v = qkv(seq=32, seed=rank)
        group = dist.group.WORLD
        module = (ContextParallelAttention(backend="torch", group=group) if cp_heads == 1 else
                  ContextParallelAttention(backend="torch", group=dist.new_group([rank]), head_group=group))
        operator = fills_in_backward(module(q, k, v))
        out, lse = ringfa4.ring_attention(*qkv(seq=32, seed=rank), causal=True, group=group, backend="torch",
                                          return_lse=True)
        return operator, tuple(lse.shape) in fills_in_backward(out)


def test_ring_and_heads_ring_backward_fill_nothing_for_outputs_without_gradient():
    assert launch.spawn(_ring_fills, 2, 1) == ([], False)  # the ring over both ranks
    assert launch.spawn(_ring_fills, 2, 2) == ([], False)  # heads x ring: the heads over both, rings of one
