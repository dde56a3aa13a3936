"""Forward and backward rings, and the autograd.Function that joins them.

Buffers: the caller's k, v are sent at step 0 and never written; two more KV buffers, allocated once
per call, alternate as receive targets (step i receives into the one that step i-1 computed on). Every transfer is posted before the step's compute and
waited for (by the compute stream, not the host) after it, so it runs behind that compute.
"""
import torch

from ringfa4.ring import timeline
from ringfa4.ring.comm import Ring
from ringfa4.ring.merge import merge_
from ringfa4.ring.schedule import plan


def _source(rank, step, world):
    return (rank - step) % world


def _empty_like(tensors, dtype=None):
    return [torch.empty_like(t, dtype=dtype) for t in tensors]


def _sum_dtype(x, lse, world):
    """Where partial sums of the output and of dK/dV live between ring steps.

    With two ranks every row gets exactly one later term, so the sum is taken once, in fp32 inside
    the add or merge, and rounded once: keeping it in the input dtype gives the same bits as an fp32
    buffer cast at the end, without the casts. More ranks sum several terms: fp32 (fp64 for fp64).
    """
    return x.dtype if world == 2 else lse.dtype


def ring_forward(backend, q, k, v, causal, softmax_scale, group, rank, world, layout):
    ring = Ring(group, q.device)
    kv = [k.contiguous(), v.contiguous()]
    targets = (_empty_like(kv), _empty_like(kv))
    out = lse = None
    for i in range(world):
        works = ring.start(kv, targets[i % 2], span=("fwd", i, "kv")) if i + 1 < world else []
        step = plan(rank, _source(rank, i, world), layout, causal, q.shape[1])
        started = timeline.begin(q.device)
        if step is not None:
            o, l = backend.forward(q[:, step.q], kv[0][:, step.kv], kv[1][:, step.kv], step.causal, softmax_scale)
            if out is None:  # step 0, the local block, always covers every query row
                out, lse = o.to(_sum_dtype(q, l, world)), l
            else:
                merging = timeline.begin(q.device)
                merge_(out[:, step.q], lse[:, :, step.q], o, l)
                timeline.end(merging, "fwd", i, "merge")
        timeline.end(started, "fwd", i, "compute")
        ring.wait(works)
        kv = targets[i % 2]
    return out.to(q.dtype), lse


def ring_backward(backend, dout, q, k, v, out, lse, causal, softmax_scale, group, rank, world, layout,
                  deterministic):
    """dq stays home in fp32 (the backend adds each step into it; own kernels do so in place); each
    KV block travels with its dK/dV sums, which arrive home after W steps.

    A step asks the backend for fresh dK/dV of its block (no buffer to zero) while the block's
    sums are still in flight from the previous rank, and adds them once they have arrived. The last
    hop carries the finished sums already in the input dtype: home adds nothing more to them, so the
    rounding is the same and the one transfer nothing hides is as small as the KV block.
    """
    ring = Ring(group, q.device)
    kv = [k.contiguous(), v.contiguous()]
    targets = (_empty_like(kv), _empty_like(kv))
    dq = torch.zeros_like(q, dtype=lse.dtype)  # fp32, or fp64 for fp64 inputs
    dkv = inbox = None
    dkv_works = []
    for i in range(world):
        last = i + 1 == world
        kv_works = ring.start(kv, targets[i % 2], span=("bwd", i, "kv")) if not last else []
        step = plan(rank, _source(rank, i, world), layout, causal, q.shape[1])
        started = timeline.begin(q.device)
        grads = None
        if step is not None:
            rows = step.q
            _, *grads = backend.backward(
                dout[:, rows], q[:, rows], kv[0][:, step.kv], kv[1][:, step.kv], out[:, rows],
                lse[:, :, rows], step.causal, softmax_scale, dq=dq[:, rows], deterministic=deterministic,
            )
        if i == 0:  # the local block covers every key row: its dK/dV start the sums
            dkv = [g.to(_sum_dtype(g, lse, world)) for g in grads]
            inbox = _empty_like(dkv)
        timeline.end(started, "bwd", i, "compute")
        if i > 0:
            ring.wait(dkv_works)
            dkv, inbox = inbox, dkv
            if grads is not None:
                for acc, g in zip(dkv, grads):
                    acc[:, step.kv].add_(g)
        if last:
            dkv, inbox = [t.to(k.dtype) for t in dkv], _empty_like(kv)
        dkv_works = ring.start(dkv, inbox, tag=1, span=("bwd", i, "dkv"))
        ring.wait(kv_works)
        kv = targets[i % 2]
    finished = timeline.begin(q.device)
    ring.wait(dkv_works)
    timeline.end(finished, "bwd", world, "wait_dkv")
    dk, dv = inbox
    return dq.to(q.dtype), dk, dv


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
