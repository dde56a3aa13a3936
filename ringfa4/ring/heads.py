"""Heads x ring (2-D) context parallelism: an all-to-all over a head group trades sequence for heads.

Rank (u, r), u its rank in the head group (size U) and r in the ring group (size R), holds piece u
of ring shard r: the sequence is cut for a ring over R ranks (``layout``), and each ring shard
into U contiguous pieces (``layout.shard`` with a head group). Before the ring, an all-to-all over
the head group gives member u query heads [u*h/U, (u+1)*h/U) of its whole ring shard (the U
pieces in member order), so a plain ring over R runs on h/U heads; after it, the reverse
all-to-all gives each member its own rows of every head back. In the backward the two swap.

GQA. When U divides the kv heads hk, member u gets kv heads [u*hk/U, (u+1)*hk/U), exactly those
its query heads read. When U exceeds hk (U must then be a multiple of hk), member u reads the one
kv head u // (U/hk): each kv head is sent to the U/hk members whose query heads read it (each
needs all of its rows, so nothing travels twice to one rank). Their dK/dV come back through the
reverse all-to-all, one copy per member, and the rank that owns the rows sums the U/hk copies of
each kv head in fp32 (fp64 for fp64), rounding once to the input dtype.
"""
import functools

import torch
import torch.distributed as dist


def splits(heads, kv_heads, head_world):
    """Whether ``head_world`` ranks can split these heads: the query heads over the group, and the kv
    heads split over it or each replicated to head_world / kv_heads members."""
    return heads % head_world == 0 and (kv_heads % head_world == 0 or head_world % kv_heads == 0)


def check_split(heads, kv_heads, head_world):
    """Raise ValueError unless ``head_world`` ranks can split these heads (``splits``), naming the
    condition that fails."""
    if splits(heads, kv_heads, head_world):
        return
    if heads % head_world:
        raise ValueError(f"q heads ({heads}) must be a multiple of the head_group size ({head_world})")
    raise ValueError(f"k/v heads ({kv_heads}) and the head_group size ({head_world}) must divide one "
                     f"another: the kv heads are split over the group, or each replicated to "
                     f"head_group size / kv heads members")


def replicas(kv_heads, head_world):
    """How many members of the head group read each kv head."""
    return max(1, head_world // kv_heads)


def exchange_over(group):
    """The all-to-all over ``group`` that ``to_heads`` and ``to_seq`` run: exchange(recv, send)."""
    return functools.partial(dist.all_to_all_single, group=group)


def to_heads(x, world, copies, exchange):
    """(b, s, h, d) on each of U = ``world`` members -> (b, U*s, h*copies/U, d): this member's heads,
    every member's rows. ``exchange(recv, send)`` is the all-to-all of (U, ...) buffers."""
    b, s, h, d = x.shape
    groups = world // copies  # head groups of n heads; members g*copies ... g*copies + copies-1 get group g
    n = h // groups
    send = x.new_empty(world, b, s, n, d)
    heads = x.reshape(b, s, groups, n, d).permute(2, 0, 1, 3, 4).unsqueeze(1)
    send.view(groups, copies, b, s, n, d).copy_(heads.expand(groups, copies, b, s, n, d))
    recv = torch.empty_like(send)
    exchange(recv, send)
    return recv.transpose(0, 1).reshape(b, world * s, n, d)


def to_seq(y, world, copies, exchange):
    """The inverse of ``to_heads``: (b, U*s, n, d) -> (b, s, n*U/copies, d), summing the copies of a head."""
    b, total, n, d = y.shape
    s = total // world
    send = y.reshape(b, world, s, n, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    exchange(recv, send)
    if copies > 1:
        acc = torch.promote_types(y.dtype, torch.float32)
        recv = recv.view(world // copies, copies, b, s, n, d).sum(1, dtype=acc).to(y.dtype)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, -1, d)


class SeqToHeads(torch.autograd.Function):
    """``to_heads`` forward, ``to_seq`` (summing replicated heads' gradients) backward."""

    @staticmethod
    def forward(ctx, x, group, copies):
        ctx.args = (dist.get_world_size(group), copies, exchange_over(group))
        return to_heads(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return to_seq(grad, *ctx.args), None, None


class HeadsToSeq(torch.autograd.Function):
    """``to_seq`` forward, ``to_heads`` backward."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.args = (dist.get_world_size(group), 1, exchange_over(group))
        return to_seq(y, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return to_heads(grad, *ctx.args), None


def qkv_to_heads(q, k, v, group):
    """Every member's rows of this member's query heads, and of the kv heads they read."""
    copies = replicas(k.shape[2], dist.get_world_size(group))
    return SeqToHeads.apply(q, group, 1), SeqToHeads.apply(k, group, copies), SeqToHeads.apply(v, group, copies)


def out_to_seq(out, lse, group):
    """This member's rows of every head of out (differentiable) and lse (b, h, s; not differentiable)."""
    with torch.no_grad():
        lse = to_seq(lse.transpose(1, 2).unsqueeze(-1), dist.get_world_size(group), 1, exchange_over(group))
        lse = lse.squeeze(-1).transpose(1, 2)
    return HeadsToSeq.apply(out, group), lse
