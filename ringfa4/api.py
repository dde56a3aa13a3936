"""The public functions: argument checking, backend choice and autograd wiring.

Everything is checked before any kernel runs or any byte moves between ranks.
"""
import logging

import torch

from ringfa4 import backends
from ringfa4.ring import agree, heads
from ringfa4.ring import layout as ring_layout
from ringfa4.ring.attention import RingAttention

log = logging.getLogger("ringfa4")
_logged_choices = set()


def _check_qkv(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must have a floating dtype, got {q.dtype}")
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
    if hk == 0 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({hk})")
    if causal and sq != sk:
        raise ValueError(f"causal attention needs equal q and k/v sequence lengths, got {sq} and {sk}")


def _softmax_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return head_dim ** -0.5
    if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0 or softmax_scale == float("inf"):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _choose_backend(name, q, k, v, causal):
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if name != "auto":
        module = backends.get(name)
        reason = module.unsupported_reason(q, k, v, causal, grad)
        if reason is not None:
            raise ValueError(f"backend {name!r} cannot run these inputs: {reason}")
        return module
    reasons = []
    for candidate in backends.AUTO_ORDER:
        module = backends.get(candidate)
        reason = module.unsupported_reason(q, k, v, causal, grad)
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
    def forward(ctx, q, k, v, backend, causal, softmax_scale):
        out, lse = backend.forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.causal, ctx.softmax_scale = backend, causal, softmax_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.backend.backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale)
        return grads + (None,) * 3


def attention(q, k, v, causal=False, softmax_scale=None, backend="auto"):
    """Attention on one device: returns (out, lse).

    q (b, sq, h, d); k, v (b, sk, hk, d) with h % hk == 0; out like q; lse (b, h, sq), natural log,
    float32 (float64 for float64 inputs). Differentiable in q, k, v (lse is returned for merging and is not differentiable).
    """
    _check_qkv(q, k, v, causal)
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    return _Attention.apply(q, k, v, _choose_backend(backend, q, k, v, causal), causal, scale)


def ring_attention(q, k, v, causal=False, softmax_scale=None, group=None, head_group=None, layout="zigzag",
                   backend="auto", deterministic=False, return_lse=False):
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
    """
    _check_qkv(q, k, v, causal)
    ring_layout.check_layout(layout)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention needs q and k/v of the same local length, got {q.shape[1]} and {k.shape[1]}")
    world = ring_layout.group_rank_world(group)[1]
    head_world = 1 if head_group is None else ring_layout.group_rank_world(head_group)[1]
    heads.check_split(q.shape[2], k.shape[2], head_world)
    ring_layout.check_divisible(
        q.shape[1] * head_world * world, world, layout, head_world=head_world,
        name=f"global sequence length (q.shape[1] = {q.shape[1]} x {head_world * world} ranks)",
    )
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    module = _choose_backend(backend, q, k, v, causal)
    if world * head_world > 1:
        agree.check(q, k, causal, layout, scale, deterministic, group, head_group)
    if head_world > 1:
        q, k, v = heads.qkv_to_heads(q, k, v, head_group)
    if world == 1:
        out, lse = _Attention.apply(q, k, v, module, causal, scale)
    else:
        out, lse = RingAttention.apply(q, k, v, module, causal, scale, group, layout, bool(deterministic))
    if head_world > 1:
        out, lse = heads.out_to_seq(out, lse, head_group)
    return (out, lse) if return_lse else out
