"""Upstream FlashAttention-4 (flash-attn-4, module flash_attn.cute): the anchor we measure against
and a fallback. Its private entry points are the ones that take and return lse; they are not a
stable API, so the tested version is pinned and the signatures are checked on first use.

Packed documents run through upstream's varlen path: every document that both the query rows
and the key rows hold becomes one varlen sequence (its query rows against its key rows, which
the ids keep contiguous), packed with cu_seqlens_q/k. Query rows of no shared document get
lse = -inf and out = 0 without a launch. Building the pieces reads the ids on the host (one
device sync per call)."""
import contextlib
import functools
import math
import importlib.metadata
import inspect
import warnings

import torch

from ringfa4.backends import DqBuffer

TESTED_VERSION = "4.0.0b36"
_FWD_PARAMS = {"softmax_scale", "causal", "return_lse"}
_BWD_PARAMS = {"softmax_scale", "causal", "deterministic", "dq", "dk", "dv"}
_VARLEN_PARAMS = {"cu_seqlens_q", "cu_seqlens_k"}


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


def unsupported_reason(q, k, v, causal, grad, doc_ids=None):
    if q.device.type != "cuda":
        return f"fa4 runs on CUDA tensors only, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fa4 takes float16/bfloat16, got {q.dtype}"
    if causal and q.shape[1] != k.shape[1]:
        return "fa4 causal needs equal query and key lengths here"
    interface = _interface()
    if isinstance(interface, str):
        return interface
    if doc_ids is not None:
        for fn in (interface._flash_attn_fwd, interface._flash_attn_bwd):
            missing = _VARLEN_PARAMS - set(inspect.signature(fn).parameters)
            if missing:
                return f"flash_attn.cute.interface.{fn.__name__} lacks the varlen parameters {sorted(missing)}"
    return None


@contextlib.contextmanager
def _quiet_compile():
    """Upstream's every kernel compile warns that its AuxData "cannot be converted to a JitArgument";
    harmless on Hopper, and a user of our fa4 backend cannot act on it. Only that warning is hidden,
    only around our calls into upstream."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*cannot be converted to a JitArgument", category=UserWarning)
        yield


def forward(q, k, v, causal, softmax_scale, doc_ids=None):
    if doc_ids is not None:
        return _varlen_forward(q, k, v, causal, softmax_scale, _Pieces(doc_ids))
    with _quiet_compile():
        out, lse, *_ = _interface()._flash_attn_fwd(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True
        )
    return out, lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False, doc_ids=None):
    # Upstream overwrites the buffers it is given; our contract adds into them.
    if doc_ids is not None:
        grads = _varlen_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, _Pieces(doc_ids))
    else:
        with _quiet_compile():
            grads = _interface()._flash_attn_bwd(
                q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                deterministic=deterministic,
            )[:3]
    return tuple(
        g if buf is None else buf.add_(g) for g, buf in zip(grads, (dq, dk, dv))
    )


class _Pieces:
    """The varlen packing of a call with documents: flat row indices (into the (b*s) rows) of the
    query and key rows of every shared document, and their cu_seqlens (int32, on q's device)."""

    def __init__(self, doc_ids):
        q_ids, k_ids = doc_ids
        (b, sq), sk = q_ids.shape, k_ids.shape[1]
        q_runs, k_runs = _runs(q_ids.cpu()), _runs(k_ids.cpu())
        q_rows, k_rows, q_lens, k_lens = [], [], [0], [0]
        for row in range(b):
            for doc, (qa, qb) in q_runs[row].items():
                if doc in k_runs[row]:
                    ka, kb = k_runs[row][doc]
                    q_rows.append(torch.arange(row * sq + qa, row * sq + qb))
                    k_rows.append(torch.arange(row * sk + ka, row * sk + kb))
                    q_lens.append(qb - qa)
                    k_lens.append(kb - ka)
        device = q_ids.device
        self.shape = (b, sq, sk)
        self.q_rows = torch.cat(q_rows).to(device) if q_rows else None
        self.k_rows = torch.cat(k_rows).to(device) if k_rows else None
        self.cu_q = torch.tensor(q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        self.cu_k = torch.tensor(k_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        self.max_q, self.max_k = max(q_lens), max(k_lens)

    def pack(self, x, rows):
        """(b, s, ...) -> (len(rows), ...): the rows of the shared documents, in order."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, rows)


def _runs(ids):
    """Per batch row, {document: (first row, end row)} of a nondecreasing (b, s) id tensor."""
    out = []
    for row in ids:
        docs, counts = torch.unique_consecutive(row, return_counts=True)
        ends = counts.cumsum(0).tolist()
        out.append({d: (e - c, e) for d, c, e in zip(docs.tolist(), counts.tolist(), ends)})
    return out


def _varlen_kwargs(fn, pieces):
    kwargs = {"cu_seqlens_q": pieces.cu_q, "cu_seqlens_k": pieces.cu_k}
    params = inspect.signature(fn).parameters
    if "max_seqlen_q" in params:
        kwargs.update(max_seqlen_q=pieces.max_q, max_seqlen_k=pieces.max_k)
    return kwargs


def _varlen_forward(q, k, v, causal, softmax_scale, pieces):
    b, sq, h, d = q.shape
    out = q.new_zeros(b * sq, h, v.shape[-1])
    lse = torch.full((h, b * sq), -math.inf, dtype=torch.float32, device=q.device)
    if pieces.q_rows is not None:
        fwd = _interface()._flash_attn_fwd
        with _quiet_compile():
            o, l, *_ = fwd(pieces.pack(q, pieces.q_rows), pieces.pack(k, pieces.k_rows),
                           pieces.pack(v, pieces.k_rows), softmax_scale=softmax_scale, causal=causal,
                           return_lse=True, **_varlen_kwargs(fwd, pieces))
        out.index_copy_(0, pieces.q_rows, o)
        lse.index_copy_(1, pieces.q_rows, l)
    return out.view(b, sq, h, -1), lse.view(h, b, sq).transpose(0, 1)


def _varlen_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, pieces):
    b, sq, sk = pieces.shape
    grads = [q.new_zeros(b * sq, *q.shape[2:]), k.new_zeros(b * sk, *k.shape[2:]), v.new_zeros(b * sk, *v.shape[2:])]
    if pieces.q_rows is not None:
        bwd = _interface()._flash_attn_bwd
        qr, kr = pieces.q_rows, pieces.k_rows
        lse_p = lse.transpose(0, 1).reshape(lse.shape[1], -1).index_select(1, qr).contiguous()
        with _quiet_compile():
            packed = bwd(pieces.pack(q, qr), pieces.pack(k, kr), pieces.pack(v, kr), pieces.pack(out, qr),
                         pieces.pack(dout, qr), lse_p, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, **_varlen_kwargs(bwd, pieces))[:3]
        for g, rows, p in zip(grads, (qr, kr, kr), packed):
            g.index_copy_(0, rows, p)
    return tuple(g.view(b, -1, *g.shape[1:]) for g in grads)


def query_state(dout, q, out, lse, softmax_scale, chunk, deterministic):
    return DqBuffer(q, lse)
