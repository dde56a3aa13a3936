"""The public functions: argument checking, backend choice and autograd wiring.

Everything is checked before any kernel runs or any byte moves between ranks.
"""
import logging

import torch

from ringfa4 import backends, documents
from ringfa4.ring import agree, heads
from ringfa4.ring import layout as ring_layout
from ringfa4.ring.attention import RingAttention
from ringfa4.ring.documents import ring_documents

log = logging.getLogger("ringfa4")
_logged_choices = set()


# Attention's floating dtypes: float8 has no exp/softmax path here and would overflow in the
# reference's casts, so it is refused by name rather than by an arithmetic error.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_flag(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_qkv(q, k, v, causal):
    _check_flag(causal, "causal")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q.dtype must be one of {', '.join(map(str, DTYPES))}, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}; ringfa4 never casts")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (b, sq, h, d), (bk, sk, hk, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"k/v batch must equal q batch {b}, got {bk}")
    if dk != d:
        raise ValueError(f"k/v head_dim must equal q head_dim {d}, got {dk}")
    if d == 0:
        raise ValueError(f"head_dim (q.shape[3]) must be positive, got shape {tuple(q.shape)}")
    if hk == 0 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({hk})")
    if causal and sq != sk:
        raise ValueError(f"causal attention needs equal q and k/v sequence lengths, got {sq} and {sk}")


def _check_ring(q, k, layout, world, head_world):
    """A ring's local inputs: a known layout, q and k/v of one local length, heads the head group
    can split and a global length the layout can cut over ``head_world`` x ``world`` ranks."""
    ring_layout.check_layout(layout)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention needs q and k/v of the same local length, got {q.shape[1]} and {k.shape[1]}")
    heads.check_split(q.shape[2], k.shape[2], head_world)
    ring_layout.check_divisible(
        q.shape[1] * head_world * world, world, layout, head_world=head_world,
        name=f"global sequence length (q.shape[1] = {q.shape[1]} x {head_world * world} ranks)",
    )


def _softmax_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return head_dim ** -0.5
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not softmax_scale > 0 or softmax_scale == float("inf")):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _choose_backend(name, q, k, v, causal, doc_ids=None):
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if name != "auto":
        module = backends.get(name)
        reason = module.unsupported_reason(q, k, v, causal, grad, doc_ids)
        if reason is not None:
            raise ValueError(f"backend {name!r} cannot run these inputs: {reason}")
        return module
    reasons = []
    for candidate in backends.AUTO_ORDER:
        module = backends.get(candidate)
        reason = module.unsupported_reason(q, k, v, causal, grad, doc_ids)
        if reason is None:
            key = (candidate, q.device.type, q.dtype, grad)
            if key not in _logged_choices:
                _logged_choices.add(key)
                skipped = "; ".join(reasons) or "first choice"
                log.info("ringfa4 backend 'auto' -> %r for %s %s (%s)", candidate, q.device.type, q.dtype, skipped)
            return module
        reasons.append(f"{candidate}: {reason}")
    raise ValueError("no backend can run these inputs: " + "; ".join(reasons))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, softmax_scale, deterministic, doc_ids=None):
        out, lse = backend.forward(q, k, v, causal, softmax_scale, **documents.call_kwargs(doc_ids))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.causal, ctx.softmax_scale, ctx.doc_ids = backend, causal, softmax_scale, doc_ids
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        # No zeros for lse's gradient, never read; out, the one differentiable output, is what
        # brings this node into a backward, so dout is never None.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.backend.backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                     deterministic=ctx.deterministic, **documents.call_kwargs(ctx.doc_ids))
        return grads + (None,) * 5


def _doc_rows(cu_seqlens, q, seq_len):
    """Per-row document boundaries of ``cu_seqlens`` over a sequence of ``seq_len``, or None for
    no documents or one per row (plain attention, bit for bit)."""
    if cu_seqlens is None:
        return None
    rows = documents.row_boundaries(cu_seqlens, q.shape[0], seq_len, q.device)
    return None if documents.is_dense(rows) else rows


def _ring_documents(cu_seqlens, q, layout, group, seq_len):
    """(layout, per-row boundaries or None, RingDocuments or None) of a ring call: one document
    per row is the plain ring, and a document layout then is zigzag (its pieces are zigzag's chunks)."""
    if layout in documents.LAYOUTS and cu_seqlens is None:
        raise ValueError(f"layout {layout!r} follows the documents: it needs cu_seqlens")
    rows = _doc_rows(cu_seqlens, q, seq_len)
    if rows is None:
        return ("zigzag" if layout in documents.LAYOUTS else layout), None, None
    rank, world = ring_layout.group_rank_world(group)
    return layout, rows, ring_documents(rows, rank, world, layout, seq_len, q.device)


def attention(q, k, v, causal=False, softmax_scale=None, backend="auto", cu_seqlens=None, deterministic=False):
    """Attention on one device: returns (out, lse).

    q (b, sq, h, d); k, v (b, sk, hk, d) with h % hk == 0; out like q; lse (b, h, sq), natural log,
    float32 (float64 for float64 inputs). Differentiable in q, k, v (lse is returned for merging and is not differentiable).
    ``cu_seqlens``: packed documents, FlashAttention's 1-D int32 varlen boundaries (ringfa4.documents);
    a query sees the keys of its own document only. Needs sq == sk.
    ``deterministic``: the backward orders its dQ sums, so gradients are bit-identical run to run.
    """
    _check_qkv(q, k, v, causal)
    _check_flag(deterministic, "deterministic")
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    if cu_seqlens is not None and q.shape[1] != k.shape[1]:
        raise ValueError(f"cu_seqlens describes one packed sequence: q and k/v need the same length, "
                         f"got {q.shape[1]} and {k.shape[1]}")
    rows = _doc_rows(cu_seqlens, q, q.shape[1])
    doc_ids = None if rows is None else documents.local_ids(rows, q.shape[1], q.device)
    return _Attention.apply(q, k, v, _choose_backend(backend, q, k, v, causal, doc_ids), causal, scale,
                            deterministic, doc_ids)


def ring_attention(q, k, v, causal=False, softmax_scale=None, group=None, head_group=None, layout="zigzag",
                   backend="auto", deterministic=False, return_lse=False, cu_seqlens=None):
    """Attention over a sequence split across the ranks of ``group`` (this rank holds q, k, v of its part).

    Local tensors are laid out as ``shard`` gives them for ``layout`` (and ``head_group``); the result
    is this rank's rows of the attention over the full sequence. Returns out, or (out, lse) with return_lse.
    ``head_group`` (U ranks, each in a different ring group of the same size): 2-D context
    parallelism, an all-to-all over it trades sequence for heads around the ring over ``group``
    (ringfa4.ring.heads); U must divide the query heads, and divide or be a multiple of the kv heads.
    Before the first transfer the ranks check that they agree on every argument the ring depends on
    (ringfa4.ring.agree): if not, every rank raises the same ValueError.
    Over NCCL, give the group high-priority streams (``ringfa4.nccl_options()``): at normal
    priority transfers can wait for whole kernels (a warning says so once per group).
    ``cu_seqlens``: packed documents in global positions of the full sequence, the same on every
    rank (ringfa4.documents; its checksum is part of the agreement). A ring step whose rows share
    no document launches nothing (ringfa4.ring.documents counts them), and the ring stops after
    the farthest hop any rank needs. The document layouts need cu_seqlens, in shard and unshard
    too: "document_zigzag" cuts every document into 2W pieces (rank r holds pieces r and 2W-1-r
    of each), which balances causal work over documents of any lengths; "document_balanced"
    keeps documents whole where it can, balancing work over the ranks, so that most steps see
    nothing and the ring stops early (ringfa4.documents).
    """
    _check_qkv(q, k, v, causal)
    _check_flag(deterministic, "deterministic")
    _check_flag(return_lse, "return_lse")
    world = ring_layout.group_rank_world(group)[1]
    head_world = 1 if head_group is None else ring_layout.group_rank_world(head_group)[1]
    _check_ring(q, k, layout, world, head_world)
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    layout, rows, docs = _ring_documents(cu_seqlens, q, layout, group, q.shape[1] * head_world * world)
    doc_ids = None if docs is None else docs.local
    module = _choose_backend(backend, q, k, v, causal, doc_ids)
    if world * head_world > 1:
        agree.check(q, k, causal, layout, scale, deterministic, group, head_group,
                    documents=None if rows is None else documents.checksum(rows, layout, world))
    if head_world > 1:
        q, k, v = heads.qkv_to_heads(q, k, v, head_group)
    if world == 1:
        out, lse = _Attention.apply(q, k, v, module, causal, scale, deterministic, doc_ids)
    else:
        out, lse = RingAttention.apply(q, k, v, module, causal, scale, group, layout, bool(deterministic), docs)
    if head_world > 1:
        out, lse = heads.out_to_seq(out, lse, head_group)
    return (out, lse) if return_lse else out
