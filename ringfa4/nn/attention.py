"""Attention over a context-parallel group, as a module a model can hold."""
import torch.distributed as dist
from torch import nn

from ringfa4.api import _check_flag
from ringfa4.nn import ops


class ContextParallelAttention(nn.Module):
    """softmax(q k^T) v for local sequence shards q (b, s, h, d), k, v (b, s, hk, d).

    With ``group`` set (``parallelize`` does it) the keys and values of the whole sequence are
    reached through ``ringfa4.ring_attention`` over that group, so every rank must hold its shard
    in ``layout`` order. With a ``head_group`` of more than one rank as well, an all-to-all over it
    trades sequence for heads around that ring (2-D context parallelism, ringfa4.ring.heads; the
    ring group may then have one rank). Without a group, or with a one-rank group, it is plain single-device
    attention: unlike the public API, None here never means the default process group, because
    under data parallelism that group holds different samples, not parts of one sequence.

    ``cu_seqlens`` (forward): packed documents of the full sequences, as ringfa4.ring_attention
    takes them (ringfa4.documents), the same on every rank of the group.

    ``deterministic``: the backward gives bit-identical gradients run to run, as
    ringfa4.ring_attention's flag does (the kernels order their dQ sums; the ring adds dK/dV in a
    fixed order anyway), for reproducible training at some cost in backward speed.
    """

    def __init__(self, causal=True, group=None, layout="zigzag", backend="auto", head_group=None,
                 deterministic=False):
        super().__init__()
        _check_flag(deterministic, "deterministic")
        self.causal = causal
        self.group = group
        self.head_group = head_group
        self.layout = layout
        self.backend = backend
        self.deterministic = deterministic

    def forward(self, q, k, v, cu_seqlens=None):
        # Through the custom operators (ringfa4.nn.ops): one opaque call for torch.compile and for
        # selective activation checkpointing, which keeps its outputs.
        scale = q.shape[-1] ** -0.5
        if self.head_group is not None and dist.get_world_size(self.head_group) > 1:
            return ops.heads_ring_attention(q, k, v, self.causal, scale, self.group.group_name,
                                            self.head_group.group_name, self.layout, self.backend,
                                            self.deterministic, cu_seqlens)[0]
        if self.group is None or dist.get_world_size(self.group) == 1:
            return ops.attention(q, k, v, self.causal, scale, self.backend, self.deterministic, cu_seqlens)[0]
        return ops.ring_attention(q, k, v, self.causal, scale, self.group.group_name, self.layout, self.backend,
                                  self.deterministic, cu_seqlens)[0]

    def extra_repr(self):
        cp = 1 if self.group is None else dist.get_world_size(self.group)
        heads = 1 if self.head_group is None else dist.get_world_size(self.head_group)
        return (f"causal={self.causal}, cp={cp}, cp_heads={heads}, layout={self.layout}, backend={self.backend}, "
                f"deterministic={self.deterministic}")
