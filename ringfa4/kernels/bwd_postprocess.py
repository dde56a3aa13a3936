"""Backward postprocess: dQ out of the backward kernel's fragment-order fp32 accumulator into
(b, s, h, d), written in the output's dtype or added into what it holds.

Per (batch, head, query tile) the accumulator holds each MMA warp group's 64 x 64 part of the
tile as [register group j][thread t][4 registers] (bwd_sm90.py), where register 4 j + 2 hh + e of
thread 32 warp + 4 r + c holds row 16 warp + 8 hh + r and column 8 j + 2 c + e of the part (PTX
ISA, wgmma D fragment). So the four threads c = 0..3 of one (warp, r) wrote, side by side, 64
bytes that hold rows r and r + 8 over columns 8 j .. 8 j + 7. A thread here reads such a 64-byte
run and writes its two 8-column row pieces; eight threads with consecutive j write one 64-column
row of a part, whole 128-byte lines. Rows past the sequence (the last tile's padding) are dropped.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

_NUM_MMA_WG = 2
_WG_THREADS = 128
_THREADS = _NUM_MMA_WG * _WG_THREADS
_PART = 64  # each warp group's part of a dQ tile is 64 x 64
_COLS = 8  # columns of one register group j
_RUN = 16  # floats the four threads of a (warp, r) stored side by side for one j: 2 rows x 8 columns
_RUNS = _NUM_MMA_WG * 4 * 8 * (_PART // _COLS)  # (warp group, warp, r, j) per tile


def query_tile(head_dim: int) -> int:
    """Rows of a dQ tile in the backward kernel: 128 at head_dim 64 (the warp groups split the
    rows), 64 at 128 (they split the columns)."""
    return 128 if head_dim == 64 else 64


class DqPostprocess:
    def __init__(self, dtype, head_dim: int, add: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.add = add
        self.tile_m = query_tile(head_dim)
        self.split_rows = self.tile_m == _PART * _NUM_MMA_WG

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, stream):
        """acc (b, h, tiles * tile_m * head_dim) fp32; dq (b, s, h, head_dim)."""
        grid = (cute.ceil_div(mdQ.shape[1], self.tile_m), mdQ.shape[2], mdQ.shape[0])
        self.kernel(mAcc, mdQ).launch(grid=grid, block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        acc = mAcc[batch, head, None]
        seqlen = mdQ.shape[1]
        part_size = self.tile_m * self.head_dim // _NUM_MMA_WG
        for k in cutlass.range_constexpr(_RUNS // _THREADS):
            run = tidx + k * _THREADS
            j = run % (_PART // _COLS)
            r = run // (_PART // _COLS) % 8
            warp = run // (_PART // _COLS * 8) % 4
            wg = run // (_PART // _COLS * 8 * 4)
            first = ((m_block * _NUM_MMA_WG + wg) * part_size
                     + (j * _WG_THREADS + 32 * warp + 4 * r) * 4)
            regs = cute.make_rmem_tensor((_RUN,), Float32)
            cute.autovec_copy(cute.local_tile(acc, (_RUN,), (first // _RUN,)), regs)
            row = m_block * self.tile_m + 16 * warp + r
            col = _COLS * j
            if const_expr(self.split_rows):
                row = row + _PART * wg
            else:
                col = col + _PART * wg
            for hh in cutlass.range_constexpr(2):
                if row + 8 * hh < seqlen:
                    dst = cute.local_tile(mdQ[batch, row + 8 * hh, head, None], (_COLS,),
                                          (col // _COLS,))
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


@dataclass(frozen=True)
class DqPostprocessConfig:
    """Compile-time values of the postprocess (compile cache key)."""

    dtype: str  # of dq: "bf16" | "fp16" | "fp32"
    head_dim: int
    add: bool  # add into dq (else overwrite it)

    @property
    def name(self) -> str:
        return f"bwd_dq_postprocess_{self.dtype}_d{self.head_dim}_{'add' if self.add else 'store'}"

    def compile_args(self):
        dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}[self.dtype]
        b, s, h, length = (cute.sym_int() for _ in range(4))
        per_16_bytes = 128 // dt.width
        dq_stride = tuple(cute.sym_int64(divisibility=per_16_bytes) for _ in range(3)) + (1,)
        return DqPostprocess(dt, self.head_dim, self.add), (
            cute.runtime.make_fake_tensor(
                Float32, (b, h, length),
                stride=(cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1),
                assumed_align=16),
            cute.runtime.make_fake_tensor(dt, (b, s, h, self.head_dim), stride=dq_stride,
                                          assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
