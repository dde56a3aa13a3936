"""Fold partial attention results together through their log-sum-exp, in fp32 (fp64 for fp64 inputs).

On Hopper the merge is one CuTe DSL kernel (ringfa4.kernels.merge) that reads the running
(out, lse) and the partial once and writes the merged pair in place; it compiles one variant per
dtype pair and head dim, never per shape or view, so every rank of a ring runs the same code
whatever rows it merges into. Elsewhere (CPU, CI, other GPUs, fp64) the same formula runs as eager ops.
"""
import math

import torch

from ringfa4.backends.cute import merge as cute_merge


def _merged(out, lse, out_part, lse_part):
    """(out, lse) of the union; weights exp(lse_x - lse_new) <= 1, so nothing overflows."""
    new = torch.logaddexp(lse, lse_part)
    # Both sides empty: new = -inf; shift by 0 so both weights are exp(-inf) = 0, not NaN.
    shift = torch.where(new == -math.inf, 0.0, new)
    w_old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    w_part = torch.exp(lse_part - shift).transpose(1, 2).unsqueeze(-1)
    return out.to(lse.dtype) * w_old + out_part.to(lse.dtype) * w_part, new


def _merge_into(out, lse, out_part, lse_part):
    new_out, new_lse = _merged(out, lse, out_part, lse_part)
    out.copy_(new_out)
    lse.copy_(new_lse)


def merge_(out, lse, out_part, lse_part):
    """out, lse <- the attention over the union of the keys behind (out, lse) and (out_part, lse_part).

    out (b, s, h, d, any float dtype) and lse (b, h, s) are updated in place (they may be views);
    out_part (any float dtype) and lse_part are a partial result over other keys for the same queries.
    The arithmetic is in lse's dtype; out is rounded to its own dtype once, on the store.
    A side with lse = -inf (no visible key) gets weight 0; both -inf keep lse -inf and set out to 0, never NaN.
    """
    if out.numel() and out.is_cuda and cute_merge.merge_runs(out, lse, out_part):
        cute_merge.merge_(out, lse, out_part, lse_part)
    else:
        _merge_into(out, lse, out_part, lse_part)
