"""Backward preprocess: delta = softmax_scale * rowsum(dO * O) in fp32 and the lse in log2 units,
written as (b, h, s_pad) fp32 rows padded to whole query tiles of the backward kernel (which loads
them by TMA), each tile's rows in the order of stats_layout.py. delta carries the softmax scale so
that the kernel's dS = P * (dP * scale - delta) is already scaled: dQ and dK then need no multiply
of their own. Rows that see no key (lse = -inf) and pad rows get lse +inf, so that
P = exp2(S - lse) is exactly 0 there instead of NaN.

Eight threads share one row (head_dim / 8 contiguous elements each, 16-byte loads) and add
their partial sums with butterfly shuffles.

With ``zero``, it also zeroes a flat fp32 buffer the backward kernel then adds into (the dQ
accumulator, and split shares' dK/dV sums): a memset launch less per backward call, each CTA
clearing one contiguous slice with 16-byte stores.
"""
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ringfa4.kernels.softmax import LOG2_E
from ringfa4.kernels.stats_layout import stats_position
from ringfa4.kernels.tile_scheduler import flat_share

_THREADS = 128
_THREADS_PER_ROW = 8
_ROWS = _THREADS // _THREADS_PER_ROW
_VEC = 4  # fp32 zeros per 16-byte store


class BwdPreprocess:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mDelta: cute.Tensor, mZero: Optional[cute.Tensor], softmax_scale: Float32, stream):
        """o, dout (b, s, h, d); lse (b, h, s) fp32; lse2, delta (b, h, s_pad) fp32 outputs;
        zero: None or a flat fp32 buffer of a multiple of 4 elements, 16-byte aligned, to zero."""
        grid = (cute.ceil_div(mDelta.shape[2], _ROWS), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mZero, Float32(softmax_scale)).launch(
            grid=grid, block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mDelta: cute.Tensor, mZero: Optional[cute.Tensor], softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, batch = cute.arch.block_idx()
        if const_expr(mZero is not None):
            self._zero_share(mZero, tidx)
        row = row_block * _ROWS + tidx // _THREADS_PER_ROW
        part = tidx % _THREADS_PER_ROW
        seqlen = mO.shape[1]
        chunk = self.head_dim // _THREADS_PER_ROW

        delta = Float32(0.0)
        if row < seqlen:
            ro = cute.make_rmem_tensor((chunk,), self.dtype)
            rdo = cute.make_rmem_tensor((chunk,), self.dtype)
            cute.autovec_copy(cute.local_tile(mO[batch, row, head, None], (chunk,), (part,)), ro)
            cute.autovec_copy(cute.local_tile(mdO[batch, row, head, None], (chunk,), (part,)), rdo)
            prod = ro.load().to(Float32) * rdo.load().to(Float32)
            delta = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for offset in cutlass.range_constexpr(int(math.log2(_THREADS_PER_ROW)) - 1, -1, -1):
            delta = delta + cute.arch.shuffle_sync_bfly(delta, offset=1 << offset)
        if part == 0 and row < mDelta.shape[2]:
            lse2 = Float32.inf
            if row < seqlen:
                lse = mLSE[batch, head, row]
                lse2 = Float32.inf if lse == -Float32.inf else lse * LOG2_E
            at = stats_position(row)
            mLSE2[batch, head, at] = lse2
            mDelta[batch, head, at] = delta * softmax_scale

    @cute.jit
    def _zero_share(self, mZero: cute.Tensor, tidx):
        """This CTA's share of mZero (tile_scheduler.flat_share) set to zero."""
        length = mZero.shape[0]
        first, count = flat_share(length, _VEC)
        zeros = cute.make_rmem_tensor((_VEC,), Float32)
        zeros.fill(0.0)
        for i in cutlass.range(tidx * _VEC, count, _THREADS * _VEC):
            at = first + i
            if at < length:
                cute.autovec_copy(zeros, cute.local_tile(mZero, (_VEC,), (at // _VEC,)))
