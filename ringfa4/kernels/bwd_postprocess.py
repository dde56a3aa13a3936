"""Backward postprocess: dQ out of the backward kernel's fragment-order fp32 accumulator
(dq_layout.py) into (b, s, h, d), written in the output's dtype or added into what it holds.

In that layout the four threads c = 0..3 of one (warp, r) stored, side by side, 64 bytes that hold
accumulator rows r and r + 8 over columns 8 j .. 8 j + 7 of their part. A thread here reads such a
64-byte run. Parts held as dQ: it writes its two 8-column row pieces, and eight threads with
consecutive j write one 64-column row of a part, whole 128-byte lines. Parts held as dQ^T: the
run holds 8 query rows x 2 columns, and the 32 lanes of a warp take the 32 (warp, r) runs of one
j, so that each store of the warp writes 32 columns of one query row inside one 128-byte line.
Rows past the sequence (the last tile's padding) are dropped.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ringfa4.kernels.dq_layout import (NUM_MMA_WG, PART, QUERY_TILES, REGS_PER_STORE, WG_THREADS,
                                       parts_split_rows, parts_transposed)

_COLS = 8  # accumulator columns of one register group j
_RUN = 4 * REGS_PER_STORE  # the 4 threads of a (warp, r), one j: 2 rows x 8 columns
_RUNS_PER_THREAD = 2


class DqPostprocess:
    def __init__(self, dtype, head_dim: int, tile_m: int, add: bool):
        if tile_m not in QUERY_TILES[head_dim]:
            raise ValueError(f"tile_m must be one of {QUERY_TILES[head_dim]} at head_dim {head_dim}, got {tile_m}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.add = add
        self.split_rows = parts_split_rows(tile_m)
        self.transposed = parts_transposed(tile_m)
        # Register groups j of a part: its accumulator's columns / 8.
        self.groups = (tile_m if self.transposed else PART) // _COLS
        self.threads = NUM_MMA_WG * 32 * self.groups // _RUNS_PER_THREAD

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, stream):
        """acc (b, h, tiles * tile_m * head_dim) fp32; dq (b, s, h, head_dim)."""
        grid = (cute.ceil_div(mdQ.shape[1], self.tile_m), mdQ.shape[2], mdQ.shape[0])
        self.kernel(mAcc, mdQ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        acc = mAcc[batch, head, None]
        seqlen = mdQ.shape[1]
        part_size = self.tile_m * self.head_dim // NUM_MMA_WG
        for k in cutlass.range_constexpr(_RUNS_PER_THREAD):
            run = tidx + k * self.threads
            if const_expr(self.transposed):
                r, warp = run % 8, run // 8 % 4
                j, wg = run // 32 % self.groups, run // (32 * self.groups)
            else:
                j, r = run % self.groups, run // self.groups % 8
                warp, wg = run // (self.groups * 8) % 4, run // (self.groups * 8 * 4)
            first = ((m_block * NUM_MMA_WG + wg) * part_size
                     + (j * WG_THREADS + 32 * warp + 4 * r) * REGS_PER_STORE)
            regs = cute.make_rmem_tensor((_RUN,), Float32)
            cute.autovec_copy(cute.local_tile(acc, (_RUN,), (first // _RUN,)), regs)
            if const_expr(self.transposed):
                self._store_columns(regs, mdQ, batch, head, seqlen, m_block * self.tile_m + _COLS * j,
                                    PART * wg + 16 * warp + r)
            else:
                row = m_block * self.tile_m + 16 * warp + r
                col = _COLS * j
                if const_expr(self.split_rows):
                    row = row + PART * wg
                else:
                    col = col + PART * wg
                self._store_rows(regs, mdQ, batch, head, seqlen, row, col)

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

    @cute.jit
    def _store_columns(self, regs, mdQ, batch, head, seqlen, row, col):
        """A dQ^T run: query rows row .. row + 7, columns col and col + 8."""
        for c in cutlass.range_constexpr(4):
            for e in cutlass.range_constexpr(2):
                if row + 2 * c + e < seqlen:
                    dst = mdQ[batch, row + 2 * c + e, head, None]
                    for hh in cutlass.range_constexpr(2):
                        val = regs[4 * c + 2 * hh + e]
                        if const_expr(self.add):
                            val = val + dst[col + 8 * hh].to(Float32)
                        dst[col + 8 * hh] = val.to(self.dtype)
