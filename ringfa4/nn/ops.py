"""Attention as torch.library custom operators, for the model's attention cores.

An operator is opaque to torch.compile (it neither traces into the ring's Python control flow
and collectives nor breaks the graph around it: the fake implementations give it shapes) and a
single dispatcher call to selective activation checkpointing, which can save its outputs and so
never run the ring twice. The process group travels by name, a string that compile can guard
on, and is looked up inside the operator.

Each operator's backward is another operator that takes what the forward saved: out and lse, and
for the ring the KV block the forward ended with, where the backward ring starts. A forward
operator takes ``deterministic`` only to hand it to its backward (ringfa4.ring_attention's flag:
bit-identical gradients run to run); the ring operators also make the ranks agree on it.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from ringfa4.api import _check_qkv, _check_ring, _choose_backend, _doc_rows, _ring_documents
from ringfa4.documents import call_kwargs, checksum, local_ids
from ringfa4.ring import agree, heads
from ringfa4.ring import layout as ring_layout
from ringfa4.ring.attention import ring_backward, ring_forward
from ringfa4.ring.comm import Ring


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _own(results, inputs):
    """An operator's results as its fake implementation gives them and the dispatcher requires:
    contiguous (compiled code relies on it), each in storage of its own, aliasing neither an input
    nor another result. A backend may return views (the torch one does), and a ring that stops
    after the local step (packed documents no other rank sees) ends with the KV block it started
    from: those are copied."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    owned = []
    for t in results:
        t = t.contiguous()
        if t.numel():
            if t.untyped_storage().data_ptr() in taken:
                t = t.clone()
            taken.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return tuple(owned)


def _backend_for(name, q, k, v, causal, doc_ids=None):
    _check_qkv(q, k, v, causal)
    return _choose_backend(name, q, k, v, causal, doc_ids)


def _local_documents(cu_seqlens, q):
    """doc_ids of a one-device call with packed documents ``cu_seqlens`` (None: none, or one per row)."""
    rows = _doc_rows(cu_seqlens, q, q.shape[1])
    return None if rows is None else local_ids(rows, q.shape[1], q.device)


@torch.library.custom_op("ringfa4::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
              backend: str, deterministic: bool, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention on one device; see ringfa4.attention."""
    doc_ids = _local_documents(cu_seqlens, q)
    module = _backend_for(backend, q, k, v, causal, doc_ids)
    return _own(module.forward(q, k, v, causal, softmax_scale, **call_kwargs(doc_ids)), (q, k, v))


@attention.register_fake
def _(q, k, v, causal, softmax_scale, backend, deterministic, cu_seqlens=None):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=_lse_dtype(q))


@torch.library.custom_op("ringfa4::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: float, backend: str, deterministic: bool,
                       cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    doc_ids = _local_documents(cu_seqlens, q)
    module = _backend_for(backend, q, k, v, causal, doc_ids)
    return _own(module.backward(dout.contiguous(), q, k, v, out, lse, causal, softmax_scale,
                                deterministic=deterministic, **call_kwargs(doc_ids)), (dout, q, k, v, out, lse))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, backend, deterministic, cu_seqlens=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, backend, deterministic, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (causal, softmax_scale, backend, deterministic, cu_seqlens)
    ctx.mark_non_differentiable(output[1])
    # No zeros for the gradients of the outputs that have none; out, the one differentiable
    # output, is what brings the operator into a backward, so dout is never None.
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, dout, _dlse):
    return attention_backward(dout, *ctx.saved_tensors, *ctx.args) + (None,) * 5


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


@torch.library.custom_op("ringfa4::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, group_name: str,
                   layout: str, backend: str, deterministic: bool,
                   cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, k_last, v_last) of ring attention over the process group ``group_name``; see
    ringfa4.ring_attention. k_last, v_last are the KV block the forward ended with."""
    group = _resolve_process_group(group_name)
    world = ring_layout.group_rank_world(group)[1]
    _check_ring(q, k, layout, world, 1)
    layout, rows, docs = _ring_documents(cu_seqlens, q, layout, group, q.shape[1] * world)
    module = _backend_for(backend, q, k, v, causal, None if docs is None else docs.local)
    agree.check(q, k, causal, layout, softmax_scale, deterministic, group, None,
                documents=None if rows is None else checksum(rows, layout, world))
    out, lse, kv_last = ring_forward(module, q, k, v, causal, softmax_scale, Ring(group, q.device), layout, docs)
    return _own((out, lse, *kv_last), (q, k, v))


@ring_attention.register_fake
def _(q, k, v, causal, softmax_scale, group_name, layout, backend, deterministic, cu_seqlens=None):
    b, s, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty((b, h, s), dtype=_lse_dtype(q)),
            torch.empty_like(k), torch.empty_like(v))


@torch.library.custom_op("ringfa4::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            k_last: Tensor, v_last: Tensor, causal: bool, softmax_scale: float, group_name: str,
                            layout: str, backend: str, deterministic: bool,
                            cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    group = _resolve_process_group(group_name)
    world = ring_layout.group_rank_world(group)[1]
    layout, _, docs = _ring_documents(cu_seqlens, q, layout, group, q.shape[1] * world)
    module = _backend_for(backend, q, k, v, causal, None if docs is None else docs.local)
    return _own(ring_backward(module, dout.contiguous(), q, k, v, out, lse, [k_last, v_last], causal,
                              softmax_scale, Ring(group, q.device, reverse=True), layout, deterministic, docs),
                (dout, q, k, v, out, lse, k_last, v_last))


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, k_last, v_last, causal, softmax_scale, group_name, layout, backend, deterministic,
      cu_seqlens=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, group_name, layout, backend, deterministic, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (causal, softmax_scale, group_name, layout, backend, deterministic, cu_seqlens)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # as _attention_setup: no zeros for lse and the last KV block


def _ring_grad(ctx, dout, _dlse, _dk_last, _dv_last):
    return ring_attention_backward(dout, *ctx.saved_tensors, *ctx.args) + (None,) * 7


ring_attention.register_autograd(_ring_grad, setup_context=_ring_setup)


@torch.library.custom_op("ringfa4::heads_ring_attention", mutates_args=())
def heads_ring_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, group_name: str,
                         head_group_name: str, layout: str, backend: str, deterministic: bool,
                         cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor, Tensor, Tensor]:
    """Heads x ring (ringfa4.ring.heads): all-to-all over ``head_group_name`` to this rank's heads,
    the ring over ``group_name`` (one call when it has one rank), all-to-all back. Returns out and
    what the backward needs, in the heads layout: q, k, v, out, lse, and the KV block the ring
    ended with (empty for a one-rank ring)."""
    group, head = _resolve_process_group(group_name), _resolve_process_group(head_group_name)
    world, head_world = ring_layout.group_rank_world(group)[1], ring_layout.group_rank_world(head)[1]
    _check_ring(q, k, layout, world, head_world)
    layout, rows, docs = _ring_documents(cu_seqlens, q, layout, group, q.shape[1] * head_world * world)
    doc_ids = None if docs is None else docs.local
    module = _backend_for(backend, q, k, v, causal, doc_ids)
    agree.check(q, k, causal, layout, softmax_scale, deterministic, group, head,
                documents=None if rows is None else checksum(rows, layout, world))
    exchange, copies = heads.exchange_over(head), heads.replicas(k.shape[2], head_world)
    qh = heads.to_heads(q, head_world, 1, exchange)
    kh, vh = (heads.to_heads(t, head_world, copies, exchange) for t in (k, v))
    if world == 1:
        (out_h, lse_h), kv_last = (module.forward(qh, kh, vh, causal, softmax_scale, **call_kwargs(doc_ids)),
                                   (kh.new_empty(0), kh.new_empty(0)))
    else:
        out_h, lse_h, kv_last = ring_forward(module, qh, kh, vh, causal, softmax_scale, Ring(group, q.device), layout,
                                             docs)
    return _own((heads.to_seq(out_h, head_world, 1, exchange), qh, kh, vh, out_h, lse_h, *kv_last), (q, k, v))


@heads_ring_attention.register_fake
def _(q, k, v, causal, softmax_scale, group_name, head_group_name, layout, backend, deterministic, cu_seqlens=None):
    world = ring_layout.group_rank_world(_resolve_process_group(group_name))[1]
    head_world = ring_layout.group_rank_world(_resolve_process_group(head_group_name))[1]
    b, s, h, d = q.shape
    qh = q.new_empty((b, s * head_world, h // head_world, d))
    kh = k.new_empty((b, s * head_world, max(1, k.shape[2] // head_world), d))
    last = (torch.empty_like(kh), torch.empty_like(kh)) if world > 1 else (k.new_empty(0), k.new_empty(0))
    return (torch.empty_like(q), qh, kh, torch.empty_like(kh), torch.empty_like(qh),
            q.new_empty((b, h // head_world, s * head_world), dtype=_lse_dtype(q)), *last)


@torch.library.custom_op("ringfa4::heads_ring_attention_backward", mutates_args=())
def heads_ring_attention_backward(dout: Tensor, qh: Tensor, kh: Tensor, vh: Tensor, out_h: Tensor, lse_h: Tensor,
                                  k_last: Tensor, v_last: Tensor, causal: bool, softmax_scale: float, group_name: str,
                                  head_group_name: str, layout: str, backend: str, deterministic: bool,
                                  kv_heads: int, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    group, head = _resolve_process_group(group_name), _resolve_process_group(head_group_name)
    world, head_world = ring_layout.group_rank_world(group)[1], ring_layout.group_rank_world(head)[1]
    layout, _, docs = _ring_documents(cu_seqlens, qh, layout, group, qh.shape[1] * world)
    doc_ids = None if docs is None else docs.local
    module = _backend_for(backend, qh, kh, vh, causal, doc_ids)
    exchange, copies = heads.exchange_over(head), heads.replicas(kv_heads, head_world)
    dout_h = heads.to_heads(dout.contiguous(), head_world, 1, exchange)
    if world == 1:
        grads = module.backward(dout_h, qh, kh, vh, out_h, lse_h, causal, softmax_scale, deterministic=deterministic,
                                **call_kwargs(doc_ids))
    else:
        grads = ring_backward(module, dout_h, qh, kh, vh, out_h, lse_h, [k_last, v_last], causal, softmax_scale,
                              Ring(group, qh.device, reverse=True), layout, deterministic, docs)
    dq, dk, dv = grads
    return _own((heads.to_seq(dq, head_world, 1, exchange), heads.to_seq(dk, head_world, copies, exchange),
                 heads.to_seq(dv, head_world, copies, exchange)), (dout, qh, kh, vh, out_h, lse_h, k_last, v_last))


@heads_ring_attention_backward.register_fake
def _(dout, qh, kh, vh, out_h, lse_h, k_last, v_last, causal, softmax_scale, group_name, head_group_name, layout,
      backend, deterministic, kv_heads, cu_seqlens=None):
    head_world = ring_layout.group_rank_world(_resolve_process_group(head_group_name))[1]
    b, total, _, d = kh.shape
    dk = kh.new_empty((b, total // head_world, kv_heads, d))
    return dout.new_empty(dout.shape), dk, torch.empty_like(dk)


def _heads_ring_setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, group_name, head_group_name, layout, backend, deterministic, cu_seqlens = inputs
    ctx.save_for_backward(*output[1:])
    ctx.args = (causal, softmax_scale, group_name, head_group_name, layout, backend, deterministic, k.shape[2],
                cu_seqlens)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # as _attention_setup: no zeros for the seven saved outputs


def _heads_ring_grad(ctx, dout, *_saved):
    return heads_ring_attention_backward(dout, *ctx.saved_tensors, *ctx.args) + (None,) * 8


heads_ring_attention.register_autograd(_heads_ring_grad, setup_context=_heads_ring_setup)

SAVED_BY_SELECTIVE_CHECKPOINTING = (torch.ops.ringfa4.attention.default, torch.ops.ringfa4.ring_attention.default,
                                    torch.ops.ringfa4.heads_ring_attention.default)
