"""Fold partial attention results together through their log-sum-exp, in fp32 (fp64 for fp64 inputs).

On Hopper the merge is one CuTe DSL kernel (ringfa4.kernels.merge) that reads the running
(out, lse) and the partial once and writes the merged pair in place. It replaced a torch.compile'd
pass: Dynamo compiled one graph per batch, head count and view layout, so the two ranks of a
causal ring (one merging into half of its rows, the other into all) compiled different graphs at
different times, and with fullgraph=True the ninth one raised on a single rank and left the other
waiting in the ring. Elsewhere (CPU, CI, other GPUs, fp64) the same formula runs as eager ops.
"""
import functools
import importlib.util
import math

import torch

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
def _hopper_with_dsl(device_index):
    return (torch.cuda.get_device_capability(device_index) == (9, 0)
            and importlib.util.find_spec("cutlass") is not None)


def _kernel_runs(out, lse, out_part):
    from ringfa4.backends.cute import tma_compatible  # 16-byte aligned rows: the kernel's accesses

    return (out.is_cuda and _hopper_with_dsl(out.device.index)
            and out.dtype in _KERNEL_DTYPES and out_part.dtype in _KERNEL_DTYPES
            and lse.dtype == torch.float32 and out.shape[-1] % 8 == 0
            and tma_compatible(out) and lse.stride(-1) == 1)


def _merge_kernel(out, lse, out_part, lse_part):
    from ringfa4.backends.cute import tma_ready
    from ringfa4.kernels.compile import compile_variant
    from ringfa4.kernels.merge import MergeConfig

    out_part = tma_ready(out_part)
    if lse_part.stride(-1) != 1:
        lse_part = lse_part.contiguous()
    config = MergeConfig(_KERNEL_DTYPES[out.dtype], _KERNEL_DTYPES[out_part.dtype], out.shape[-1])
    compile_variant(config)(out, lse, out_part, lse_part)


def merge_(out, lse, out_part, lse_part):
    """out, lse <- the attention over the union of the keys behind (out, lse) and (out_part, lse_part).

    out (b, s, h, d, any float dtype) and lse (b, h, s) are updated in place (they may be views);
    out_part (any float dtype) and lse_part are a partial result over other keys for the same queries.
    The arithmetic is in lse's dtype; out is rounded to its own dtype once, on the store.
    A side with lse = -inf (no visible key) gets weight 0; both -inf keep lse -inf and set out to 0, never NaN.
    """
    if out.numel() and _kernel_runs(out, lse, out_part):
        _merge_kernel(out, lse, out_part, lse_part)
    else:
        _merge_into(out, lse, out_part, lse_part)
