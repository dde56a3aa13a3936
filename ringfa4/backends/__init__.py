"""Kernel providers behind one contract.

Every backend module defines:

    unsupported_reason(q, k, v, causal, grad, doc_ids=None) -> str | None
        None when the backend can run these inputs (forward, and backward too when ``grad``);
        otherwise one sentence saying why not, used in errors and by backend="auto".
    forward(q, k, v, causal, softmax_scale, doc_ids=None) -> (out, lse)
        q (b, sq, h, d); k, v (b, sk, hk, d) with h % hk == 0; out like q; lse (b, h, sq) natural
        log, float32 (float64 for float64 inputs); a row with no visible key has lse = -inf and out = 0.
    backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False, doc_ids=None) -> (dq, dk, dv)
        Gradients of sum(dout * out) with the softmax normalised by the given lse (the merged,
        global one inside a ring), so one ring step's result is exactly its share of the full
        gradient. Given dq/dk/dv buffers (any float dtype, fp32 in the ring) receive the gradients
        ADDED to what they hold and are returned; otherwise new tensors of the input dtype are.
    query_state(dout, q, out, lse, softmax_scale, chunk, deterministic) -> state with rows(sl)
        and dq()
        Where a ring keeps dQ over its backward steps, which differ only in the keys:
        ``state.rows(sl)`` is what a step over the query rows sl passes as ``dq`` (every sl starts
        on a multiple of ``chunk`` and ends on one or at the end; ``deterministic``: the mode of
        every step), ``state.dq()`` the sum in q's dtype. A backend may also keep there what depends on the queries alone; DqBuffer, which
        keeps just dQ, serves backends with nothing better.

Arguments arrive checked: ringfa4.api validates them once per call (types, shapes, dtypes,
devices, heads, softmax_scale) and asks the chosen backend's unsupported_reason once; forward,
backward and query_state trust them, since a ring calls them once per step.
Inputs may be views that are non-contiguous in the sequence dimension (a ring step slices
one chunk of the local sequence); the head dimension is always contiguous.
Causal attention requires sq == sk (the ring never asks for anything else).

Packed documents (ringfa4.documents). ``doc_ids`` is None (every query may see every key, today's
path, unchanged) or a pair (q_ids, k_ids) of int32 tensors of shape (b, sq) and (b, sk) on q's
device: the document index of every query and key row, NONDECREASING along the sequence (a ring
step's rows are increasing global positions, so documents come in order). Query i sees key j iff
q_ids[i] == k_ids[j] (and j <= i when causal; causal calls have q and k over the same rows).
Rows that see nothing (non-causal ring steps, rectangular calls) give lse = -inf and out = 0, and
no gradient. The api and the ring derive the ids from ``cu_seqlens`` and the layout; ids of a
step may be renumbered (ringfa4.ring.documents) but always keep the order. They pass a
ringfa4.documents.DocIds, whose ``longest`` (the most query rows of one document, known on the
host) a backend may read to choose kernels; any (q_ids, k_ids) pair is valid input.
"""
import importlib

import torch

NAMES = ("torch", "cute", "fa4")
AUTO_ORDER = ("cute", "fa4", "torch")


def get(name):
    """The backend module called ``name``."""
    if name not in NAMES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    return importlib.import_module(f"ringfa4.backends.{'torch_ref' if name == 'torch' else name}")


class DqBuffer:
    """A query_state that sums dQ in a (b, s, h, d) tensor of the lse's dtype (fp32, fp64 for
    fp64 inputs); a step's dq is a row slice of it."""

    def __init__(self, q, lse):
        self._sum = torch.zeros_like(q, dtype=lse.dtype)
        self._dtype = q.dtype

    def rows(self, sl):
        return self._sum[:, sl]

    def dq(self):
        return self._sum.to(self._dtype)
