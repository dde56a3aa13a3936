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
import cutlass.cute as cute
from cutlass import Float32

VEC = 8  # elements per thread: 16-byte accesses of bf16/fp16, two of fp32
_MAX_THREADS = 128


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
