"""Upstream FlashAttention-4 (flash-attn-4, module flash_attn.cute): the anchor we measure against
and a fallback. Its private entry points are the ones that take and return lse; they are not a
stable API, so the tested version is pinned and the signatures are checked on first use."""
import contextlib
import functools
import importlib.metadata
import inspect
import warnings

import torch

from ringfa4.backends import DqBuffer

TESTED_VERSION = "4.0.0b36"
_FWD_PARAMS = {"softmax_scale", "causal", "return_lse"}
_BWD_PARAMS = {"softmax_scale", "causal", "deterministic", "dq", "dk", "dv"}


@functools.cache
def _interface():
    """flash_attn.cute.interface, or a string saying why it cannot be used."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return "flash-attn-4 is not installed (pip install 'ringfa4[fa4]')"
    if version != TESTED_VERSION:
        return f"flash-attn-4 {version} is installed, ringfa4 is tested with {TESTED_VERSION} only"
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        return f"flash_attn.cute does not import: {e}"
    for fn, params in ((interface._flash_attn_fwd, _FWD_PARAMS), (interface._flash_attn_bwd, _BWD_PARAMS)):
        missing = params - set(inspect.signature(fn).parameters)
        if missing:
            return f"flash_attn.cute.interface.{fn.__name__} lacks parameters {sorted(missing)}"
    return interface


def unsupported_reason(q, k, v, causal, grad):
    if q.device.type != "cuda":
        return f"fa4 runs on CUDA tensors only, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fa4 takes float16/bfloat16, got {q.dtype}"
    if causal and q.shape[1] != k.shape[1]:
        return "fa4 causal needs equal query and key lengths here"
    interface = _interface()
    return interface if isinstance(interface, str) else None


@contextlib.contextmanager
def _quiet_compile():
    """Upstream's every kernel compile warns that its AuxData "cannot be converted to a JitArgument";
    harmless on Hopper, and a user of our fa4 backend cannot act on it. Only that warning is hidden,
    only around our calls into upstream."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*cannot be converted to a JitArgument", category=UserWarning)
        yield


def forward(q, k, v, causal, softmax_scale):
    with _quiet_compile():
        out, lse, *_ = _interface()._flash_attn_fwd(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True
        )
    return out, lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False):
    # Upstream overwrites the buffers it is given; our contract adds into them.
    with _quiet_compile():
        grads = _interface()._flash_attn_bwd(
            q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
            deterministic=deterministic,
        )[:3]
    return tuple(
        g if buf is None else buf.add_(g) for g, buf in zip(grads, (dq, dk, dv))
    )


def query_state(dout, q, out, lse, softmax_scale, chunk):
    return DqBuffer(q, lse)
