"""Online softmax for the Hopper forward kernel: row statistics kept in registers,
conditional O rescaling, and exp2 partly emulated on the FMA pipe.

Scores live in the wgmma accumulator layout. Each thread holds a few rows, each row spread
over the 4 threads of a quad, so row reductions are a local loop plus two butterfly shuffles.
Everything runs in the log2 domain: exp(s * scale) == exp2(s * scale * log2(e)).
"""
import math
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from ringfa4.kernels.layout import acc_rows_view
from ringfa4.kernels.ptx import inline_asm

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# 2**f on [0, 1) ~ 1 + f*(C1 + f*(C2 + f*C3)): degree-3 fit minimising the maximum *relative*
# error with p(0) = 1 held exact (Lawson-weighted least squares on 20k points, done offline).
# Its error bound is 8.6e-5, below the 1e-4 the kernel promises and far below bf16/fp16
# rounding of P (3.9e-3 / 4.9e-4); tests/test_softmax_exp2.py re-measures it in fp32.
EX2_POLY = (0.6951168179512024, 0.22764484584331512, 0.07706718146800995)


def _f32_hex(x: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


@dsl_user_op
def ex2_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x on the special-function unit (MUFU.EX2)."""
    return Float32(inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
                              "ex2.approx.ftz.f32 $0, $1;", "=f,f"))


_EX2_FMA_ASM = (
    "{\n\t"
    ".reg .f32 xc, r, rb, fr, p;\n\t"
    ".reg .b32 ri, pi, e;\n\t"
    # Inputs below 2**-127 are clamped: the result then underflows to ~6e-39, which is 0 for P.
    "max.ftz.f32 xc, $1, 0fC2FE0000;\n\t"
    # Cody-Waite split x = j + f: adding 1.5*2**23 rounding toward -inf leaves floor(x) in the
    # low mantissa bits of r; subtracting it back (exact) gives j as a float, f = x - j in [0,1).
    "add.rm.ftz.f32 r, xc, 0f4B400000;\n\t"
    "sub.rn.ftz.f32 rb, r, 0f4B400000;\n\t"
    "sub.rn.ftz.f32 fr, xc, rb;\n\t"
    f"fma.rn.ftz.f32 p, fr, {_f32_hex(EX2_POLY[2])}, {_f32_hex(EX2_POLY[1])};\n\t"
    f"fma.rn.ftz.f32 p, p, fr, {_f32_hex(EX2_POLY[0])};\n\t"
    "fma.rn.ftz.f32 p, p, fr, 0f3F800000;\n\t"
    # 2**j * p: shift j (two's complement in r's low bits) into the exponent field and add.
    "mov.b32 ri, r;\n\t"
    "mov.b32 pi, p;\n\t"
    "shl.b32 e, ri, 23;\n\t"
    "add.s32 pi, pi, e;\n\t"
    "mov.b32 $0, pi;\n\t"
    "}"
)


@dsl_user_op
def ex2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x on the FMA/ALU pipes: Cody-Waite range split plus a degree-3 polynomial."""
    return Float32(inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _EX2_FMA_ASM, "=f,f"))


@cute.jit
def row_max_of(row: cute.Tensor) -> Float32:
    # Four independent chains keep the FMNMX latency off the critical path.
    acc = [row[0], row[1], row[2], row[3]]
    for i in cutlass.range_constexpr(4, cute.size(row), 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = cute.arch.fmax(acc[j], row[i + j])
    return cute.arch.fmax(cute.arch.fmax(acc[0], acc[1]), cute.arch.fmax(acc[2], acc[3]))


@cute.jit
def row_sum_of(row: cute.Tensor) -> Float32:
    acc = [row[0], row[1], row[2], row[3]]
    for i in cutlass.range_constexpr(4, cute.size(row), 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = acc[j] + row[i + j]
    return (acc[0] + acc[1]) + (acc[2] + acc[3])


class OnlineSoftmax:
    """Running row max / row sum of one thread's rows.

    scale_log2: softmax_scale * log2(e), a runtime value.
    rescale_threshold: None rescales O whenever the max grows; a float keeps the old max (and
        skips the O rescale) until the new max exceeds it by more than that many log2 units.
        Exact either way: the sum and O share the reference max that was actually applied.
    ex2_fma_per16: how many of every 16 exponentials of a row run on the FMA pipe (0..16).
    """

    def __init__(self, scale_log2, num_rows: int, rescale_threshold, ex2_fma_per16: int):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.ex2_fma_per16 = ex2_fma_per16
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def exp2_row(self, row: cute.Tensor, offset: Float32):
        """row[i] = 2**(row[i] * scale_log2 - offset), a chosen share of them on the FMA pipe."""
        for i in cutlass.range_constexpr(cute.size(row)):
            x = row[i] * self.scale_log2 - offset
            if const_expr(i % 16 < self.ex2_fma_per16):
                row[i] = ex2_fma(x)
            else:
                row[i] = ex2_mufu(x)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return the per-row factor
        that the running O must be multiplied by (all ones when nothing needs rescaling)."""
        s = acc_rows_view(acc_S)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = s[r, None]
            m_blk = row_max_of(row)
            m_blk = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)
            if const_expr(is_first):
                m_new = m_blk
            else:
                m_prev = self.row_max[r]
                m_new = cute.arch.fmax(m_prev, m_blk)
                if const_expr(self.rescale_threshold is not None):
                    if (m_new - m_prev) * self.scale_log2 <= self.rescale_threshold:
                        m_new = m_prev
            self.row_max[r] = m_new
            # A row with nothing visible yet keeps max -inf; use 0 so exp2 gives 0, not NaN.
            m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
            offset = m_safe * self.scale_log2
            self.exp2_row(row, offset)
            blk_sum = row_sum_of(row)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = blk_sum
            else:
                # exp2(0) = 1 exactly when the max is kept; exp2(-inf) = 0 covers a previous
                # max of -inf (nothing accumulated yet).
                row_scale[r] = ex2_mufu((m_prev - m_safe) * self.scale_log2)
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + blk_sum
        return row_scale

    @cute.jit
    def needs_rescale(self, row_scale: cute.Tensor) -> cutlass.Boolean:
        """Whether any row of this warp has a factor != 1 (warp-uniform, so no divergence)."""
        mine = row_scale[0] != Float32(1.0)
        for r in cutlass.range_constexpr(1, self.num_rows):
            mine = mine | (row_scale[r] != Float32(1.0))
        return cute.arch.vote_any_sync(mine)

    @cute.jit
    def finalize(self) -> cute.Tensor:
        """Reduce row sums across the quad; return 1/sum per row and leave lse (natural log)
        in row_sum. Rows with no visible key get factor 0 and lse -inf."""
        inv = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = self.row_sum[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            m = self.row_max[r]
            # Checking the max too: emulated exp2 of -inf is ~6e-39, not 0.
            empty = (total == Float32(0.0)) | (m == -Float32.inf)
            inv[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            lse = (m * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            self.row_sum[r] = -Float32.inf if empty else lse
        return inv


@cute.jit
def scale_rows(acc: cute.Tensor, factor: cute.Tensor):
    """Multiply each of this thread's accumulator rows by its factor."""
    rows = acc_rows_view(acc)
    for r in cutlass.range_constexpr(cute.size(factor)):
        rows[r, None].store(rows[r, None].load() * factor[r])
