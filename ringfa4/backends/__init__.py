"""Kernel providers behind one contract.

Every backend module defines:

    unsupported_reason(q, k, v, causal, grad) -> str | None
        None when the backend can run these inputs (forward, and backward too when ``grad``);
        otherwise one sentence saying why not, used in errors and by backend="auto".
    forward(q, k, v, causal, softmax_scale) -> (out, lse)
        q (b, sq, h, d); k, v (b, sk, hk, d) with h % hk == 0; out like q; lse (b, h, sq) natural
        log, float32 (float64 for float64 inputs); a row with no visible key has lse = -inf and out = 0.
    backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False) -> (dq, dk, dv)
        Gradients of sum(dout * out) with the softmax normalised by the given lse (the merged,
        global one inside a ring), so one ring step's result is exactly its share of the full
        gradient. Given dq/dk/dv buffers (any float dtype, fp32 in the ring) receive the gradients
        ADDED to what they hold and are returned; otherwise new tensors of the input dtype are.

Inputs may be views that are non-contiguous in the sequence dimension (a ring step slices
one chunk of the local sequence); the head dimension is always contiguous.
Causal attention requires sq == sk (the ring never asks for anything else).
"""
import importlib

NAMES = ("torch", "cute", "fa4")
AUTO_ORDER = ("cute", "fa4", "torch")


def get(name):
    """The backend module called ``name``."""
    if name not in NAMES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    return importlib.import_module(f"ringfa4.backends.{'torch_ref' if name == 'torch' else name}")
