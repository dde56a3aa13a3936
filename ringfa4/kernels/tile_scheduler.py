"""Which work a CTA does next.

The forward's work tiles are (query block, head, batch); a CTA takes tile blockIdx.x, then
(persistent) every grid-size-th one, in the raster order (query blocks fastest), LPT's, or one
the host gives (ringfa4.backends.cute.interface.tile_order). With LPT ("longest processing time
first", for causal), heads are taken in groups whose K and V fit in L2 together, and within a
group the query blocks run last-first: the longest causal tiles start first and the short ones
fill the tail.

The backward's CTA owns one KV block and walks (query head of its kv head's group, query block)
pairs, query blocks fastest; a rotated walk starts each head at a query block of its own.

Elementwise passes over a flat buffer (the backward's pre- and postprocess) share it among the
CTAs of their grid in contiguous runs (flat_share).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# Bytes of L2 the LPT order plans to keep K/V of a head group in (H100/H200 have 50/60 MB).
L2_BUDGET = 32 * 1024 * 1024


class FwdTileScheduler:
    """tile_m: query rows per tile. kv_row_bytes: bytes of one key's K and V rows."""

    def __init__(self, tile_m: int, kv_row_bytes: int, lpt: bool):
        self.tile_m = tile_m
        self.kv_row_bytes = kv_row_bytes
        self.lpt = lpt

    @cute.jit
    def coords(self, tile: Int32, seqlen_q: Int32, seqlen_k: Int32, heads: Int32, batch: Int32, order=None):
        """(m_block, head, batch) of work tile ``tile``; ``order`` (the host's, int32 per tile):
        the raster id of the tile to run ``tile``-th."""
        num_m = (seqlen_q + self.tile_m - 1) // self.tile_m
        num_bh = heads * batch
        m_block = Int32(0)
        bh = Int32(0)
        if const_expr(order is not None):
            raster = order[tile]
            m_block = raster % num_m
            bh = raster // num_m
        elif const_expr(self.lpt):
            kv_bytes = seqlen_k * self.kv_row_bytes
            group = cutlass.max(Int32(1), cutlass.min(num_bh, Int32(L2_BUDGET) // cutlass.max(kv_bytes, Int32(1))))
            g = tile // (group * num_m)
            first = g * group
            in_group = cutlass.min(group, num_bh - first)
            r = tile - first * num_m
            m_block = num_m - 1 - r // in_group
            bh = first + r % in_group
        else:
            m_block = tile % num_m
            bh = tile // num_m
        return m_block, bh % heads, bh // heads


@dataclass(frozen=True)
class BwdStepScheduler:
    """Steps of a backward CTA: the query heads sharing the CTA's kv head, from first_head, one
    after the other, each walking its run of steps_per_head query blocks from m_block_min,
    starting at the rotation-th and wrapping around. A walk carries its place (head, position in
    the run) from step to step: computing it from the step number took an integer division per
    step, on the MMA warps' path. Frozen: the DSL then reads it inside run-time loops instead of
    carrying it as loop state."""

    first_head: Int32
    m_block_min: Int32
    steps_per_head: Int32
    rotation: Int32

    def start(self):
        """The place of the first step."""
        return Int32(0), self.rotation

    @cute.jit
    def advance(self, head, pos):
        """The place after (head, pos): the run's next query block, wrapping around; back at the
        run's first, the next head."""
        pos = pos + 1
        if pos == self.steps_per_head:
            pos = Int32(0)
        if pos == self.rotation:
            head = head + 1
        return head, pos

    def coords(self, head, pos):
        """(query head, m_block) of place (head, pos)."""
        return self.first_head + head, self.m_block_min + pos


@cute.jit
def flat_share(length, vec: cutlass.Constexpr):
    """(first, count): the elements of a flat buffer of ``length`` this CTA takes, one contiguous
    run of whole ``vec``-element vectors per CTA, in block order (x fastest). Runs past the end
    are the caller's to skip: each vector at first + i (i < count) exists where it is < length."""
    blocks, heads, batches = cute.arch.grid_dim()
    x, y, z = cute.arch.block_idx()
    count = cute.ceil_div(length, blocks * heads * batches * vec) * vec
    return ((z * heads + y) * blocks + x) * count, count
