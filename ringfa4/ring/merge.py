"""Fold partial attention results together through their log-sum-exp, in fp32 (fp64 for fp64 inputs)."""
import math

import torch


def merge_(out, lse, out_part, lse_part):
    """out, lse <- the attention over the union of the keys behind (out, lse) and (out_part, lse_part).

    out (b, s, h, d) and lse (b, h, s), both in lse's dtype, updated in place (they may be views);
    out_part (any float dtype) and lse_part are a partial result over other keys for the same queries.
    A side with lse = -inf (no visible key) gets weight 0; both -inf keeps -inf and out unchanged, never NaN.
    """
    new = torch.logaddexp(lse, lse_part)
    shift = new.masked_fill(new == -math.inf, 0.0)
    w_old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    w_part = torch.exp(lse_part - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(out_part.to(out.dtype) * w_part)
    lse.copy_(new)
