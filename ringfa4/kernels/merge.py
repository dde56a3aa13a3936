"""The ring's merge: fold a step's partial (out, lse) into the running pair, in place, in fp32.

    m = max(lse, lse_part);  e, e_part = exp(lse - m), exp(lse_part - m)
    lse <- m + log(e + e_part);  out <- (out * e + out_part * e_part) / (e + e_part)

A side with lse = -inf gets weight 0; both -inf leave lse -inf and out 0 (never NaN). One pass:
each element of out and out_part is read once and out written once (the eager formula is a dozen
full-size passes; ring-flash-attention #60 measured them as a real share of a step).

Rows are (seq, head) pairs, head fastest, so the threads of a block walk contiguous memory of a
(b, s, h, d) tensor; head_dim / 8 threads share a row, 8 elements (16 bytes of bf16) each. lse is
read by every thread of its row and rewritten by one, after a block barrier: a block holds whole
rows, so no thread can read a row's lse after it was replaced. Compiled once per (dtypes,
head_dim); batch, sequence, heads and strides are symbolic, so views and new lengths reuse it.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

VEC = 8  # elements per thread: 16-byte accesses of bf16/fp16, two of fp32
_MAX_THREADS = 128

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}


class Merge:
    def __init__(self, out_dtype, part_dtype, head_dim: int):
        self.out_dtype = out_dtype
        self.part_dtype = part_dtype
        self.threads_per_row = head_dim // VEC
        self.rows_per_block = max(1, _MAX_THREADS // self.threads_per_row)

    @cute.jit
    def __call__(self, mOut: cute.Tensor, mLSE: cute.Tensor, mPart: cute.Tensor, mLSEPart: cute.Tensor,
                 stream):
        """out, out_part (b, s, h, d); lse, lse_part (b, h, s) fp32."""
        rows = mOut.shape[1] * mOut.shape[2]
        grid = (cute.ceil_div(rows, self.rows_per_block), mOut.shape[0], 1)
        self.kernel(mOut, mLSE, mPart, mLSEPart).launch(
            grid=grid, block=[self.rows_per_block * self.threads_per_row, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mLSE: cute.Tensor, mPart: cute.Tensor, mLSEPart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, batch, _ = cute.arch.block_idx()
        row = row_block * self.rows_per_block + tidx // self.threads_per_row
        piece = tidx % self.threads_per_row
        heads = mOut.shape[2]
        pos = row // heads
        head = row - pos * heads
        inside = pos < mOut.shape[1]

        new_lse = -Float32.inf
        if inside:
            lse = mLSE[batch, head, pos]
            lse_part = mLSEPart[batch, head, pos]
            top = cute.arch.fmax(lse, lse_part)
            w = Float32(0.0)
            w_part = Float32(0.0)
            if top != -Float32.inf:
                e = cute.math.exp(lse - top)
                e_part = cute.math.exp(lse_part - top)
                total = e + e_part
                new_lse = top + cute.math.log(total)
                w = e / total
                w_part = e_part / total
            r_out = cute.make_rmem_tensor((VEC,), self.out_dtype)
            r_part = cute.make_rmem_tensor((VEC,), self.part_dtype)
            g_out = cute.local_tile(mOut[batch, pos, head, None], (VEC,), (piece,))
            cute.autovec_copy(g_out, r_out)
            cute.autovec_copy(cute.local_tile(mPart[batch, pos, head, None], (VEC,), (piece,)), r_part)
            merged = r_out.load().to(Float32) * w + r_part.load().to(Float32) * w_part
            r_out.store(merged.to(self.out_dtype))
            cute.autovec_copy(r_out, g_out)
        cute.arch.barrier()
        if inside and piece == 0:
            mLSE[batch, head, pos] = new_lse


@dataclass(frozen=True)
class MergeConfig:
    """Compile-time values of the merge (compile cache key)."""

    out_dtype: str  # "bf16" | "fp16" | "fp32": the running sum's dtype
    part_dtype: str  # the step's partial output's dtype
    head_dim: int

    @property
    def name(self) -> str:
        return f"merge_{self.out_dtype}_{self.part_dtype}_d{self.head_dim}"

    def compile_args(self):
        b, s, h = (cute.sym_int() for _ in range(3))

        def rows(dtype):
            align = 16 // (dtype.width // 8)
            stride = tuple(cute.sym_int64(divisibility=align) for _ in range(3)) + (1,)
            return cute.runtime.make_fake_tensor(dtype, (b, s, h, self.head_dim), stride=stride,
                                                 assumed_align=16)

        lse = [cute.runtime.make_fake_tensor(Float32, (b, h, s), stride=(cute.sym_int64(), cute.sym_int64(), 1),
                                             assumed_align=4) for _ in range(2)]
        out_dtype, part_dtype = DTYPES[self.out_dtype], DTYPES[self.part_dtype]
        return Merge(out_dtype, part_dtype, self.head_dim), (
            rows(out_dtype), lse[0], rows(part_dtype), lse[1],
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )


# Shipped merge variants: what a ring over the cute backend merges (two ranks sum in the input
# dtype, more in fp32; see ringfa4.ring.attention._sum_dtype).
VARIANTS = [MergeConfig(out, part, d) for part in ("bf16", "fp16") for out in (part, "fp32") for d in (64, 128)]
