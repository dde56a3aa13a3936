"""The LM head and its cross-entropy in token chunks: the full logits never exist.

At long context the logits (tokens x vocab, in fp32 for the softmax) outweigh every other
activation: 64k tokens x 128k vocab is 34 GB, and autograd would keep them and make their
gradient as large again. Here each chunk's logits live only inside the forward, which also turns
them into the chunk's gradients at once: the loss is a sum of per-token losses and the last
thing the step computes, so its incoming gradient is one scalar, and d(loss)/d(hidden) and
d(loss)/d(weight) can be formed while the chunk's softmax is at hand and scaled by that scalar in
backward. No logit is recomputed, and backward holds only the hidden-sized gradient and the
weight-sized one (fp32).
"""
import functools

import torch
import torch.nn.functional as F


def _softmax_loss(logits, target, acc, grads):
    """One chunk's sum of -log softmax(logits)[target] in the loss dtype ``acc`` and, with
    ``grads``, its gradient softmax - one_hot(target) in the logits' dtype."""
    # log_softmax in the loss dtype, as cross_entropy computes it: the chunk's one vocabulary-wide
    # buffer, which the gradient then overwrites in place.
    logp = torch.log_softmax(logits, dim=-1, dtype=acc)
    loss = -logp.gather(-1, target).sum()
    if not grads:
        return loss, None
    probs = logp.exp_()
    probs.scatter_add_(-1, target, probs.new_full(target.shape, -1.0))
    return loss, probs.to(logits.dtype)


@functools.cache
def _compiled_softmax_loss():
    """_softmax_loss compiled, so that the chunk's softmax, gather and gradient fuse into two passes
    over its logits; made on first use, as importing dynamo takes seconds."""
    return torch.compile(_softmax_loss, fullgraph=True, dynamic=False)


def _chunk_losses(x, weight, labels, chunk, grads, compiled):
    """Sum over the rows of x (n, dim) of -log softmax(x weight^T)[label], in fp32 (fp64 for fp64),
    with (d/dx, d/dweight) of that sum when ``grads``, d/dweight summed in the loss dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    softmax_loss = _compiled_softmax_loss() if compiled else _softmax_loss
    total = x.new_zeros((), dtype=acc)
    dx = torch.empty_like(x) if grads else None
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads else None
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        loss, dlogits = softmax_loss(F.linear(x[rows], weight), labels[rows].unsqueeze(-1), acc, grads)
        total += loss
        if grads:
            torch.mm(dlogits, weight, out=dx[rows])
            dw.add_(dlogits.t() @ x[rows])
    return total, dx, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk, compiled):
        total, dx, dw = _chunk_losses(x, weight, labels, chunk, True, compiled)
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, dtotal):
        dx, dw = ctx.saved_tensors
        return dx * dtotal.to(dx.dtype), (dw * dtotal).to(ctx.weight_dtype), None, None, None


def linear_cross_entropy(h, weight, labels, chunk, compiled=False):
    """Sum over tokens of the next-token loss of logits ``h @ weight.T``, computed ``chunk`` tokens at a time.

    h (..., dim); weight (vocab, dim); labels (...) integer token ids in [0, vocab). Returns a
    scalar in fp32 (fp64 for fp64 h), differentiable in h and weight, equal to
    ``F.cross_entropy(F.linear(h, weight).float(), labels, reduction="sum")``. The result must be
    the start of backward or be scaled into it (it is by the trainer's 1 / global token count):
    its gradients are formed in forward, so no second backward through it is possible.
    ``compiled``: each chunk's softmax and gradient go through torch.compile.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"loss chunk must be a positive integer number of tokens, got {chunk!r}")
    if labels.shape != h.shape[:-1]:
        raise ValueError(f"labels must have the shape of h without its last dim, {tuple(h.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    x, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, y, chunk, compiled)
    return _chunk_losses(x, weight, y, chunk, False, compiled)[0]
