"""The backward's per-query work, done once per set of queries: the preprocess (lse in log2
units, delta = scale * rowsum(dO * O)), the fragment-order dQ accumulator the backward kernel
adds into (ringfa4.kernels.dq_layout) and the postprocess that puts dQ back in (b, s, h, d)
(and, where split shares summed dK/dV in fp32, casts the sums).

Named query_rows, not query_state: the package exports the backend contract's query_state()."""
import math
from dataclasses import dataclass

import torch

from ringfa4.backends.cute.configs import BwdPreprocessConfig, DqPostprocessConfig, query_tile
from ringfa4.backends.cute.launch import compiled
from ringfa4.backends.cute.tensors import DTYPE_NAMES, rows_ready, tma_ready


@dataclass(frozen=True)
class QueryRows:
    """Whole query tiles of a QueryState, as views at their first tile: what a backward call
    over those rows reads (lse2, delta) and adds its dQ into, with tiles of tile_m rows."""

    tile_m: int  # the backward's query tile, which sets dq_acc's layout
    dq_acc: torch.Tensor  # (b, h, tiles * tile_m * head_dim) fp32, fragment order
    lse2: torch.Tensor  # (b, h, tiles * tile_m) fp32, lse in log2 units
    delta: torch.Tensor  # (b, h, tiles * tile_m) fp32, softmax_scale * rowsum(dO * O)
    softmax_scale: float  # the one folded into delta


# The most fp32 elements the preprocess zeroes and the postprocess casts as one flat buffer (their
# 32-bit indices, with room for a slice's overshoot); larger ones (4 GiB and more) are zeroed by a
# memset and cast by torch.
FLAT_MAX = 1 << 30


def padded_rows(s, tile_m):
    """s query rows rounded up to whole query tiles."""
    return (s + tile_m - 1) // tile_m * tile_m


def query_rows(dout, out, lse, softmax_scale, zeroed=True, sums_shape=None, counters=0):
    """(QueryRows, sums, counters): preprocessed rows of (dout, out, lse) with a dQ accumulator
    for the backward's query tiles (configs.query_tile); where ``sums_shape`` is given, fp32 sums
    of that shape (the split shares' dK and dV), else None; where ``counters`` is nonzero, that
    many int32 zeros (deterministic mode's turn counters), else None. One allocation holds them
    all, zeroed by the preprocess (no memset launch of their own; up to FLAT_MAX elements); the
    accumulator and the sums are left uninitialised with ``zeroed=False``, for a call whose first
    reduction into each stores (the deterministic kernel's dq_fresh and dkv_fresh)."""
    b, s, h, d = out.shape
    tile_m = query_tile(d)
    padded = padded_rows(s, tile_m)
    stats, acc = b * h * padded, b * h * padded * d
    sums = math.prod(sums_shape) if sums_shape is not None else 0
    acc_at = 2 * stats + counters + -counters % 4  # 16-byte aligned, as TMA and the zeroing need
    flat = torch.empty(acc_at + acc + sums, dtype=torch.float32, device=out.device)
    lse2, delta = flat[:2 * stats].view(2, b, h, padded)
    rows = QueryRows(tile_m, flat[acc_at:acc_at + acc].view(b, h, padded * d), lse2, delta,
                     float(softmax_scale))
    zero = flat[2 * stats:flat.numel() if zeroed else acc_at]  # the counters, and what is zeroed
    in_kernel = 0 < zero.numel() <= FLAT_MAX
    if zero.numel() > FLAT_MAX:
        zero.zero_()
    compiled(BwdPreprocessConfig(DTYPE_NAMES[out.dtype], d, zero=in_kernel))(
        tma_ready(out), tma_ready(dout), rows_ready(lse.detach()), rows.lse2, rows.delta,
        zero if in_kernel else None, rows.softmax_scale)
    return (rows, flat[acc_at + acc:].view(sums_shape) if sums else None,
            flat[2 * stats:2 * stats + counters].view(torch.int32) if counters else None)


def postprocess_dq(rows: QueryRows, dq, add, sums=None, dk=None, dv=None):
    """dq <- (add: +=) the accumulator of rows, in dq's dtype; dq must be TMA-addressable. With
    ``sums`` (flat fp32 dK/dV sums, dK's then dV's; dq stored, not added into) also dk, dv (flat,
    contiguous, dq's dtype) <- the sums, in the same launch."""
    config = DqPostprocessConfig(DTYPE_NAMES[dq.dtype], dq.shape[-1], rows.tile_m, add, cast_sums=sums is not None)
    compiled(config)(rows.dq_acc, dq, sums, dk, dv)


class QueryState:
    """What the backward calls over one set of queries share when they differ only in the keys
    (the steps of a ring): lse2 and delta from one preprocess pass, and one fragment-order dQ
    accumulator that every call adds into and `dq()` puts back in (b, s, h, d) once. Per call
    that saves a preprocess pass, zeroing an accumulator and a postprocess pass adding it into
    an fp32 dq; and the fp32 dq itself.

    ``rows(sl)`` is what a call over the query rows ``sl`` takes as its ``dq``: sl must start
    on a query tile (a multiple of tile_m, configs.query_tile) and end on one or at the end."""

    def __init__(self, dout, q, out, lse, softmax_scale):
        self.shape, self.dtype = q.shape, q.dtype
        self._all = query_rows(dout, out, lse, softmax_scale)[0]
        self.tile_m = self._all.tile_m

    def rows(self, sl: slice) -> QueryRows:
        s, d, tile_m = self.shape[1], self.shape[3], self.tile_m
        start, stop, step = sl.indices(s)
        if step != 1 or start % tile_m or (stop % tile_m and stop != s) or start >= stop:
            raise ValueError(f"rows must be a non-empty slice of step 1 from a multiple of {tile_m} "
                             f"to a multiple of {tile_m} or the end ({s}), got {sl}")
        first, end = start // tile_m, (stop + tile_m - 1) // tile_m
        stats = slice(first * tile_m, end * tile_m)
        acc = slice(first * tile_m * d, end * tile_m * d)
        return QueryRows(tile_m, self._all.dq_acc[:, :, acc], self._all.lse2[:, :, stats],
                         self._all.delta[:, :, stats], self._all.softmax_scale)

    def dq(self) -> torch.Tensor:
        """The summed dQ of every call so far, in the queries' dtype."""
        dq = torch.empty(self.shape, dtype=self.dtype, device=self._all.dq_acc.device)
        postprocess_dq(self._all, dq, add=False)
        return dq
