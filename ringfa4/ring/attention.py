"""Forward and backward rings, and the autograd.Function that joins them."""
import torch

from ringfa4.ring.comm import Ring
from ringfa4.ring.merge import merge_
from ringfa4.ring.schedule import plan


def _source(rank, step, world):
    return (rank - step) % world


def _empty_like(tensors):
    return [torch.empty_like(t) for t in tensors]


def _rotate(kv, kv_next, step):
    """The buffers of the next step: (the block just received, a free buffer for the one after).

    The caller's k, v are sent at step 0 but never received into; a third buffer replaces them.
    """
    return kv_next, (kv if step > 0 else _empty_like(kv))


def ring_forward(backend, q, k, v, causal, softmax_scale, group, rank, world, layout):
    ring = Ring(group, q.device)
    kv = [k.contiguous(), v.contiguous()]
    kv_next = _empty_like(kv)
    out = lse = None
    for i in range(world):
        works = ring.start(kv, kv_next) if i + 1 < world else []
        step = plan(rank, _source(rank, i, world), layout, causal, q.shape[1])
        if step is not None:
            o, l = backend.forward(q[:, step.q], kv[0][:, step.kv], kv[1][:, step.kv], step.causal, softmax_scale)
            if out is None:  # step 0, the local block, always covers every query row
                out, lse = o.to(l.dtype), l
            else:
                merge_(out[:, step.q], lse[:, :, step.q], o, l)
        ring.wait(works)
        kv, kv_next = _rotate(kv, kv_next, i)
    return out.to(q.dtype), lse


def ring_backward(backend, dout, q, k, v, out, lse, causal, softmax_scale, group, rank, world, layout,
                  deterministic):
    """dq stays home; each KV block travels with fp32 (fp64 for fp64 inputs) dK/dV accumulators and they arrive home after W steps.

    A step's dK/dV goes into a scratch buffer while the accumulator it belongs to is still in
    flight from the previous rank; it is added once that arrives, so transfers hide behind compute.
    """
    ring = Ring(group, q.device)
    kv = [k.contiguous(), v.contiguous()]
    kv_next = _empty_like(kv)
    acc_dtype = lse.dtype  # fp32, or fp64 for fp64 inputs
    dq = torch.zeros_like(q, dtype=acc_dtype)
    acc = [torch.zeros_like(k, dtype=acc_dtype), torch.zeros_like(v, dtype=acc_dtype)]
    inbox, part = _empty_like(acc), _empty_like(acc)
    dkv_works = []
    for i in range(world):
        kv_works = ring.start(kv, kv_next) if i + 1 < world else []
        step = plan(rank, _source(rank, i, world), layout, causal, q.shape[1])
        target = acc if i == 0 else part
        if step is not None:
            if i > 0:
                for t in part:
                    t.zero_()
            rows = step.q
            backend.backward(
                dout[:, rows], q[:, rows], kv[0][:, step.kv], kv[1][:, step.kv], out[:, rows],
                lse[:, :, rows], step.causal, softmax_scale, dq=dq[:, rows],
                dk=target[0][:, step.kv], dv=target[1][:, step.kv], deterministic=deterministic,
            )
        if i > 0:
            ring.wait(dkv_works)
            acc, inbox = inbox, acc
            if step is not None:
                for a, p in zip(acc, part):
                    a.add_(p)
        dkv_works = ring.start(acc, inbox, tag=1)
        ring.wait(kv_works)
        kv, kv_next = _rotate(kv, kv_next, i)
    ring.wait(dkv_works)
    dk, dv = inbox
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, softmax_scale, group, rank, world, layout, deterministic):
        out, lse = ring_forward(backend, q, k, v, causal, softmax_scale, group, rank, world, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, softmax_scale, group, rank, world, layout, deterministic)
        ctx.backend = backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(ctx.backend, dout, q, k, v, out, lse, *ctx.args)
        return grads + (None,) * 8
