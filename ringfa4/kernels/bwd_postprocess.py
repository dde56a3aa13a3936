"""Backward postprocess: dQ out of the backward kernel's fragment-order fp32 accumulator
(dq_layout.py) into (b, s, h, d), written in the output's dtype or added into what it holds.

In that layout the four threads c = 0..3 of one (warp, r) stored, side by side, 64 bytes that hold
accumulator rows r and r + 8 over columns 8 j .. 8 j + 7 of their part. A thread here reads such a
64-byte run and writes its two 8-column row pieces; eight threads with consecutive j write one
64-column row of a part, whole 128-byte lines. Rows past the sequence (the last tile's padding)
are dropped.

With ``cast_sums`` it also writes the split shares' fp32 dK/dV sums (one flat buffer, dK's then
dV's) in dk's and dv's dtype, each CTA a contiguous slice with 16-byte loads: the two casts the
host would launch after it, in this launch.
"""
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ringfa4.kernels.dq_layout import NUM_MMA_WG, PART, QUERY_TILE, REGS_PER_STORE, WG_THREADS, parts_split_rows
from ringfa4.kernels.tile_scheduler import flat_share

_COLS = 8  # accumulator columns of one register group j
_RUN = 4 * REGS_PER_STORE  # the 4 threads of a (warp, r), one j: 2 rows x 8 columns
_RUNS_PER_THREAD = 2
_VEC = 4  # fp32 sums per 16-byte load


class DqPostprocess:
    def __init__(self, dtype, head_dim: int, tile_m: int, add: bool):
        if head_dim not in QUERY_TILE or tile_m != QUERY_TILE[head_dim]:
            raise ValueError(f"tile_m must be the backward's query tile at head_dim {head_dim} "
                             f"(dq_layout.QUERY_TILE: {QUERY_TILE}), got {tile_m}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.add = add
        self.split_rows = parts_split_rows(tile_m)
        # Register groups j of a part: its accumulator's columns / 8.
        self.groups = PART // _COLS
        self.threads = NUM_MMA_WG * 32 * self.groups // _RUNS_PER_THREAD

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mSums: Optional[cute.Tensor],
                 mdK: Optional[cute.Tensor], mdV: Optional[cute.Tensor], stream):
        """acc (b, h, tiles * tile_m * head_dim) fp32; dq (b, s, h, head_dim). sums: None, or
        the flat fp32 dK/dV sums (2 n of them, at most query_rows.FLAT_MAX: 32-bit indices; n a
        multiple of 4; 16-byte aligned) to write into dk, dv (flat, n each, of dq's dtype)."""
        grid = (cute.ceil_div(mdQ.shape[1], self.tile_m), mdQ.shape[2], mdQ.shape[0])
        self.kernel(mAcc, mdQ, mSums, mdK, mdV).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mSums: Optional[cute.Tensor],
               mdK: Optional[cute.Tensor], mdV: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(mSums is not None):
            self._cast_share(mSums, mdK, mdV, tidx)
        acc = mAcc[batch, head, None]
        seqlen = mdQ.shape[1]
        part_size = self.tile_m * self.head_dim // NUM_MMA_WG
        for k in cutlass.range_constexpr(_RUNS_PER_THREAD):
            run = tidx + k * self.threads
            j, r = run % self.groups, run // self.groups % 8
            warp, wg = run // (self.groups * 8) % 4, run // (self.groups * 8 * 4)
            first = ((m_block * NUM_MMA_WG + wg) * part_size
                     + (j * WG_THREADS + 32 * warp + 4 * r) * REGS_PER_STORE)
            regs = cute.make_rmem_tensor((_RUN,), Float32)
            cute.autovec_copy(cute.local_tile(acc, (_RUN,), (first // _RUN,)), regs)
            row = m_block * self.tile_m + 16 * warp + r
            col = _COLS * j
            if const_expr(self.split_rows):
                row = row + PART * wg
            else:
                col = col + PART * wg
            self._store_rows(regs, mdQ, batch, head, seqlen, row, col)

    @cute.jit
    def _cast_share(self, mSums: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, tidx):
        """This CTA's share of the sums (tile_scheduler.flat_share) written in dk's dtype, into dk
        for the first n elements, dv for the rest."""
        n = mdK.shape[0]
        first, count = flat_share(2 * n, _VEC)
        for i in cutlass.range(tidx * _VEC, count, self.threads * _VEC):
            at = first + i
            if at < 2 * n:
                vals = cute.make_rmem_tensor((_VEC,), Float32)
                cute.autovec_copy(cute.local_tile(mSums, (_VEC,), (at // _VEC,)), vals)
                out = cute.make_rmem_tensor((_VEC,), self.dtype)
                out.store(vals.load().to(self.dtype))
                if at < n:
                    cute.autovec_copy(out, cute.local_tile(mdK, (_VEC,), (at // _VEC,)))
                else:
                    cute.autovec_copy(out, cute.local_tile(mdV, (_VEC,), ((at - n) // _VEC,)))

    @cute.jit
    def _store_rows(self, regs, mdQ, batch, head, seqlen, row, col):
        """A dQ run: rows row and row + 8, columns col .. col + 7."""
        for hh in cutlass.range_constexpr(2):
            if row + 8 * hh < seqlen:
                dst = cute.local_tile(mdQ[batch, row + 8 * hh, head, None], (_COLS,), (col // _COLS,))
                vals = cute.make_rmem_tensor((_COLS,), Float32)
                for c in cutlass.range_constexpr(4):
                    for e in cutlass.range_constexpr(2):
                        vals[2 * c + e] = regs[4 * c + 2 * hh + e]
                if const_expr(self.add):
                    held = cute.make_rmem_tensor((_COLS,), self.dtype)
                    cute.autovec_copy(dst, held)
                    vals.store(vals.load() + held.load().to(Float32))
                out = cute.make_rmem_tensor((_COLS,), self.dtype)
                out.store(vals.load().to(self.dtype))
                cute.autovec_copy(out, dst)
