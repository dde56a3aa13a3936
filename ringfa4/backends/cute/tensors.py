"""What our kernels need of the torch tensors they are handed: dtypes they take, and the
addressing TMA and 16-byte vector accesses require."""
import torch

# The kernels' element types by torch dtype: q, k, v, out and dout are bf16 or fp16; dq, dk, dv
# and the ring's running output may also be fp32 buffers.
INPUT_DTYPES = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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


def rows_ready(t):
    """A (b, h, s) row statistic (lse) with a contiguous last dim, copied only when it has none."""
    return t if t.stride(-1) == 1 else t.contiguous()


def layout_reason(name, t):
    """None when TMA can address t, else a sentence naming ``name`` and what it needs."""
    if t.stride(-1) != 1:
        return f"{name} must have a contiguous head dimension (stride 1), got strides {t.stride()}"
    if not tma_compatible(t):
        return (f"{name} needs a 16-byte aligned start and strides that are multiples of "
                f"{16 // t.element_size()} elements (TMA), got strides {t.stride()}")
    return None
