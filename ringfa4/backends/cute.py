"""Our own CuTe DSL kernels (ringfa4.kernels) on Hopper (sm_90). cutlass is imported only when a
kernel is compiled, so CPU-only users never need nvidia-cutlass-dsl."""
import functools
import importlib.util
import math

import torch

from ringfa4.backends import DqBuffer

HEAD_DIMS = (64, 128)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # the kernels' input dtypes


def tma_compatible(t):
    """TMA (the kernels' loads and stores) needs a contiguous last dim and a 16-byte aligned
    base and strides."""
    align = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s % align == 0 for s in t.stride()[:-1]))


def tma_ready(t):
    """t detached, copied to a contiguous tensor only when TMA cannot address it (autograd may
    hand over any layout of dout, a broadcast one for loss = out.sum())."""
    t = t.detach()
    return t if tma_compatible(t) else t.contiguous()


def _layout_reason(name, t):
    if t.stride(-1) != 1:
        return f"{name} must have a contiguous head dimension (stride 1), got strides {t.stride()}"
    if not tma_compatible(t):
        return (f"{name} needs a 16-byte aligned start and strides that are multiples of "
                f"{16 // t.element_size()} elements (TMA), got strides {t.stride()}")
    return None


def unsupported_reason(q, k, v, causal, grad):
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"cute kernels run on CUDA tensors only, got devices {q.device}, {k.device}, {v.device}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"cute kernels are built for Hopper (sm_90), this GPU is sm_{major}{minor}"
    if q.dtype not in DTYPE_NAMES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"cute kernels take bfloat16 or float16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (batch, seq, heads, head_dim)"
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"cute kernels support head_dim in {HEAD_DIMS} (same for q, k, v), got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
    if causal and q.shape[1] != k.shape[1]:
        return f"cute causal attention needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _layout_reason(name, t)
        if reason:
            return reason
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed"
    return None


def _check_out(name, t, shape, dtype, device):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


@functools.cache
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward(q, k, v, causal, softmax_scale, out=None, lse=None, config=None):
    """(out, lse). ``out`` (like q) and ``lse`` (float32, (b, h, sq), contiguous last dim) may be
    given preallocated; they are then written and returned. ``config`` (a
    ringfa4.kernels.fwd_sm90.FwdSm90Config for these dtype/head_dim/causal) replaces the
    default kernel configuration, for benchmarks and tests of the technique switches."""
    reason = unsupported_reason(q, k, v, causal, grad=False)
    if reason is not None:
        raise ValueError(f"backend 'cute' cannot run these inputs: {reason}")
    b, sq, h, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or h % k.shape[2]:
        raise ValueError(
            f"k and v must be (batch={b}, seq_k, kv_heads, {d}) with heads={h} a multiple of "
            f"kv_heads, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_out("out", out, q.shape, q.dtype, q.device)
        reason = _layout_reason("out", out)
        if reason:
            raise ValueError(reason)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    else:
        _check_out("lse", lse, (b, h, sq), torch.float32, q.device)
        if lse.stride(-1) != 1:
            raise ValueError(f"lse must have a contiguous last dimension, got strides {lse.stride()}")
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys at all: every row is fully masked
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse

    from ringfa4.kernels.compile import compile_variant, fwd_defaults

    if config is None:
        config = fwd_defaults(DTYPE_NAMES[q.dtype], d, causal)
    elif (config.dtype, config.head_dim, config.causal) != (DTYPE_NAMES[q.dtype], d, causal):
        raise ValueError(f"config {config.name} does not match dtype={q.dtype}, head_dim={d}, causal={causal}")
    kernel = compile_variant(config)
    kernel(q.detach(), k.detach(), v.detach(), out.detach(), lse, scale, _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    return out, lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False):
    reason = unsupported_reason(q, k, v, causal, grad=True)
    if reason is not None:
        raise ValueError(f"backend 'cute' cannot run these inputs: {reason}")
    from ringfa4.kernels import bwd_sm90

    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return bwd_sm90.backward(dout, q, k, v, out, lse, causal, scale, dq, dk, dv,
                             deterministic=deterministic)


def query_state(dout, q, out, lse, softmax_scale, chunk):
    """The backward kernel's QueryState when the steps' rows start on its query tiles (chunks of
    whole tiles, or every step over all rows) and the inputs are the kernels'; DqBuffer otherwise."""
    from ringfa4.kernels.dq_layout import query_tile

    d = q.shape[-1]
    if (unsupported_reason(q, q, q, False, grad=True) is not None or lse.dtype != torch.float32
            or (chunk < q.shape[1] and chunk % query_tile(d))):
        return DqBuffer(q, lse)
    from ringfa4.kernels import bwd_sm90

    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    return bwd_sm90.QueryState(dout, q, out, lse, scale)
