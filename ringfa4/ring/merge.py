"""Fold partial attention results together through their log-sum-exp, in fp32 (fp64 for fp64 inputs).

On CUDA the merge is one torch.compile'd (Inductor/Triton) pass that reads the running (out, lse)
and the partial and writes the merged result in place: the same formula as a dozen eager ops, but
each full-size tensor is read once and written once (eager merges are a measurable cost in rings:
ring-flash-attention #60). Elsewhere (CPU, CI) it runs eagerly: compiling there is slow and gains
nothing for the tests.
"""
import functools
import math

import torch


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


@functools.cache
def _fused():
    return torch.compile(_merge_into, fullgraph=True)


def _seq_dynamic(out, lse, out_part, lse_part):
    """One compiled kernel per (batch, heads, head_dim) serves every sequence length and view (the
    ring merges whole local blocks and halves of them). Only the sequence dimension is symbolic, so
    heads and head_dim are compile-time constants in the kernel's index arithmetic: with every size
    symbolic (dynamic=True) the in-ring merge ran 2.1-2.4x slower on 2 x H200 (bench/RESULTS.md)."""
    for t, dim in ((out, 1), (lse, 2), (out_part, 1), (lse_part, 2)):
        torch._dynamo.maybe_mark_dynamic(t, dim)


def merge_(out, lse, out_part, lse_part):
    """out, lse <- the attention over the union of the keys behind (out, lse) and (out_part, lse_part).

    out (b, s, h, d, any float dtype) and lse (b, h, s) are updated in place (they may be views);
    out_part (any float dtype) and lse_part are a partial result over other keys for the same queries.
    The arithmetic is in lse's dtype; out is rounded to its own dtype once, on the store.
    A side with lse = -inf (no visible key) gets weight 0; both -inf keeps -inf and out unchanged, never NaN.
    """
    if out.is_cuda:
        _seq_dynamic(out, lse, out_part, lse_part)
        _fused()(out, lse, out_part, lse_part)
    else:
        _merge_into(out, lse, out_part, lse_part)
