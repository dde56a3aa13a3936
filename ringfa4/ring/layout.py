"""How a sequence is cut over the ranks of a context-parallel group.

zigzag: 2*W equal chunks, rank r holds chunks r and 2W-1-r, so every rank has the same amount of
causal work. contiguous: W equal chunks, rank r holds chunk r.
"""
import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from ringfa4 import documents

# The document layouts (ringfa4.documents) follow the documents and need cu_seqlens.
LAYOUTS = ("zigzag", "contiguous") + documents.LAYOUTS


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(world, layout):
    """How many equal chunks the full sequence is cut into."""
    check_layout(layout)
    return world if layout == "contiguous" else 2 * world


def chunk_ids(rank, world, layout):
    """The chunks rank holds, in the order they sit in its local sequence."""
    check_layout(layout)
    if layout in documents.LAYOUTS:
        raise ValueError(f"layout {layout!r} follows the documents: pass cu_seqlens (ringfa4.documents)")
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def required_multiple(world, layout, head_world=1):
    """What a full sequence length must be a multiple of: every ring shard cut into head_world pieces."""
    per_rank = num_chunks(world, layout) // world
    return world * math.lcm(per_rank, head_world)


def nearest_length(seq_len, world, layout, head_world=1, align=1):
    """The multiple of required_multiple * align nearest to seq_len (at least one): a length that
    splits, for a length that does not (``align``: rows every chunk should be a multiple of)."""
    step = required_multiple(world, layout, head_world) * align
    return max(step, round(seq_len / step) * step)


def check_divisible(seq_len, world, layout, name="sequence length", head_world=1):
    multiple = required_multiple(world, layout, head_world)
    if seq_len % multiple:
        over = f"{world} ranks" if head_world == 1 else f"{head_world} x {world} (head_group x ring group) ranks"
        raise ValueError(
            f"{name} = {seq_len} must be a multiple of {multiple} for layout {layout!r} over {over}; "
            f"ringfa4 never pads or drops tokens"
        )


def group_rank_world(group):
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _head_rank_world(head_group):
    if head_group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("head_group was given but torch.distributed is not initialized")
    return dist.get_rank(head_group), dist.get_world_size(head_group)


def part(x, rank, world, layout, dim=1, head_rank=0, head_world=1, rows=None):
    """The part of the full sequence ``x`` (along ``dim``) that ring rank ``rank`` of ``world`` holds,
    or with a head group of ``head_world`` its member ``head_rank``: piece head_rank of the ring
    shard cut into head_world contiguous pieces (see ringfa4.ring.heads). ``rows``: per batch row
    the document boundaries (ringfa4.documents.row_boundaries), which the document layouts follow."""
    check_divisible(x.shape[dim], world, layout, name=f"x.shape[{dim}]", head_world=head_world)
    if layout in documents.LAYOUTS:
        if rows is None:
            raise ValueError(f"layout {layout!r} follows the documents: it needs their boundaries")
        return documents.part(x, rows, rank, world, layout, dim, head_rank, head_world)
    chunks = x.chunk(num_chunks(world, layout), dim=dim)
    local = torch.cat([chunks[i] for i in chunk_ids(rank, world, layout)], dim=dim)
    return local.chunk(head_world, dim=dim)[head_rank] if head_world > 1 else local


def _document_rows(x, dim, cu_seqlens, layout):
    if cu_seqlens is None:
        raise ValueError(f"layout {layout!r} follows the documents: it needs cu_seqlens")
    return documents.row_boundaries(cu_seqlens, x.shape[0], x.shape[dim], x.device)


def shard(x, dim=1, group=None, layout="zigzag", head_group=None, cu_seqlens=None):
    """This rank's part of ``x``, a tensor holding the full sequence along ``dim`` (same on every rank).

    With a ``head_group`` of U ranks, each ring shard is cut into U contiguous pieces and member u
    of the head group holds piece u (see ringfa4.ring.heads). ``cu_seqlens`` (packed documents of
    the batch rows, dim 0) is needed by the document layouts only.
    """
    rank, world = group_rank_world(group)
    head_rank, head_world = _head_rank_world(head_group)
    rows = _document_rows(x, dim, cu_seqlens, layout) if layout in documents.LAYOUTS else None
    return part(x, rank, world, layout, dim, head_rank, head_world, rows)


def unshard(x_local, dim=1, group=None, layout="zigzag", head_group=None, cu_seqlens=None):
    """The full sequence from every rank's part (all-gathers; differentiable). ``cu_seqlens``:
    as for shard (the document layouts only)."""
    rank, world = group_rank_world(group)
    check_layout(layout)
    if head_group is not None and dist.get_world_size(head_group) > 1:
        x_local = torch.cat(dist_fn.all_gather(x_local.contiguous(), group=head_group), dim=dim)
    if world == 1:
        return x_local
    parts = dist_fn.all_gather(x_local.contiguous(), group=group or dist.group.WORLD)
    if layout in documents.LAYOUTS:
        seq_len = x_local.shape[dim] * world
        rows = _document_rows(x_local.new_empty(x_local.shape[0], seq_len), 1, cu_seqlens, layout)
        return documents.assemble(parts, rows, world, layout, dim)
    per_rank = len(chunk_ids(0, world, layout))
    if x_local.shape[dim] % per_rank:
        raise ValueError(
            f"x_local.shape[{dim}] = {x_local.shape[dim]} must be a multiple of {per_rank} for layout {layout!r}"
        )
    chunks = [None] * num_chunks(world, layout)
    for r, part in enumerate(parts):
        for i, piece in zip(chunk_ids(r, world, layout), part.chunk(per_rank, dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)
