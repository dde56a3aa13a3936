"""Backward postprocess: dQ out of the backward kernel's fragment-order fp32 accumulator
(dq_layout.py) into (b, s, h, d), written in the output's dtype or added into what it holds.

In that layout the four threads c = 0..3 of one (warp, r) stored, side by side, 64 bytes that hold
accumulator rows r and r + 8 over columns 8 j .. 8 j + 7 of their part. A thread here reads such a
64-byte run and writes its two 8-column row pieces; eight threads with consecutive j write one
64-column row of a part, whole 128-byte lines. Rows past the sequence (the last tile's padding)
are dropped.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ringfa4.kernels.dq_layout import NUM_MMA_WG, PART, QUERY_TILE, REGS_PER_STORE, WG_THREADS, parts_split_rows

_COLS = 8  # accumulator columns of one register group j
_RUN = 4 * REGS_PER_STORE  # the 4 threads of a (warp, r), one j: 2 rows x 8 columns
_RUNS_PER_THREAD = 2


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
