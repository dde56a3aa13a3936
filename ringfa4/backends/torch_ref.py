"""Blockwise attention in plain PyTorch: any device, fp16/bf16/fp32/fp64.

The reference every other backend is tested against, and CI's backend. KV is processed in blocks
with an online softmax, so memory grows with seq * BLOCK, never seq^2. Low-precision inputs are
computed in fp32; fp32 and fp64 inputs keep their precision (tests use fp64 as ground truth).
With doc_ids, a score whose query and key ids differ is masked like a causal one: exact for any ids.
"""
import math

import torch

from ringfa4.backends import DqBuffer

BLOCK = 512


def unsupported_reason(q, k, v, causal, grad, doc_ids=None):
    return None


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def lse_dtype(dtype):
    """float32, except float64 for float64 inputs so that fp64 references stay exact."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q, kv_heads):
    """(b, s, h, d) -> (b, kv_heads, group, s, d) in the accumulation dtype, queries of one kv head together."""
    b, s, h, d = q.shape
    return q.to(_acc_dtype(q.dtype)).view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x):
    """(b, kv_heads, group, s, d) -> (b, s, heads, d)."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _kv_block(x, start, stop, dtype):
    """(b, sk, hk, d) block -> (b, hk, 1, blk, d), broadcast over the query heads of each kv head."""
    return x[:, start:stop].to(dtype).permute(0, 2, 1, 3).unsqueeze(2)


def _scores(qg, kb, start, causal, softmax_scale, doc_ids):
    stop = start + kb.shape[-2]
    s = torch.matmul(qg, kb.transpose(-1, -2)) * softmax_scale
    if causal:
        q_pos = torch.arange(qg.shape[-2], device=qg.device)[:, None]
        k_pos = torch.arange(start, stop, device=qg.device)[None, :]
        s = s.masked_fill(k_pos > q_pos, -math.inf)
    if doc_ids is not None:
        q_ids, k_ids = doc_ids
        other = q_ids[:, :, None] != k_ids[:, None, start:stop]  # (b, sq, blk), broadcast over heads
        s = s.masked_fill(other[:, None, None], -math.inf)
    return s


def forward(q, k, v, causal, softmax_scale, doc_ids=None):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qg = _grouped(q, hk)
    acc = qg.dtype
    row_max = torch.full(qg.shape[:-1], -math.inf, dtype=acc, device=q.device)
    row_sum = torch.zeros_like(row_max)
    o = torch.zeros(qg.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    for start in range(0, sk, BLOCK):
        stop = min(start + BLOCK, sk)
        s = _scores(qg, _kv_block(k, start, stop, acc), start, causal, softmax_scale, doc_ids)
        new_max = torch.maximum(row_max, s.amax(-1))
        # A row that has seen no key yet keeps max -inf; shift it by 0 so exp() gives 0, not NaN.
        shift = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(s - shift[..., None])
        alpha = torch.exp(row_max - shift)
        row_sum = row_sum * alpha + p.sum(-1)
        o = o * alpha[..., None] + torch.matmul(p, _kv_block(v, start, stop, acc))
        row_max = new_max
    empty = row_sum == 0
    lse = torch.where(empty, -math.inf, row_max + torch.log(torch.where(empty, 1.0, row_sum)))
    o = o / torch.where(empty, 1.0, row_sum)[..., None]
    return _ungrouped(o).to(q.dtype), lse.reshape(b, h, sq).to(lse_dtype(q.dtype))


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False, doc_ids=None):
    # Every operation here is deterministic on CPU and CUDA: `deterministic` needs no extra care.
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qg, dog = _grouped(q, hk), _grouped(dout, hk)
    acc = qg.dtype
    lse_g = lse.view(b, hk, h // hk, sq).to(acc)
    # Rows with no visible key (lse = -inf) have P = 0: shift them by +inf so exp() gives 0.
    lse_g = torch.where(lse_g == -math.inf, math.inf, lse_g)
    delta = (dog * _grouped(out, hk)).sum(-1)
    dq_g = torch.zeros_like(qg)
    dk_all = torch.zeros((b, sk, hk, d), dtype=acc, device=q.device)
    dv_all = torch.zeros((b, sk, hk, v.shape[-1]), dtype=acc, device=q.device)
    for start in range(0, sk, BLOCK):
        stop = min(start + BLOCK, sk)
        kb, vb = _kv_block(k, start, stop, acc), _kv_block(v, start, stop, acc)
        p = torch.exp(_scores(qg, kb, start, causal, softmax_scale, doc_ids) - lse_g[..., None])
        dp = torch.matmul(dog, vb.transpose(-1, -2))
        ds = p * (dp - delta[..., None]) * softmax_scale
        dq_g += torch.matmul(ds, kb)
        # Sum over the query heads of each kv head (dim 2), back to (b, blk, hk, d).
        dk_all[:, start:stop] = torch.matmul(ds.transpose(-1, -2), qg).sum(2).transpose(1, 2)
        dv_all[:, start:stop] = torch.matmul(p.transpose(-1, -2), dog).sum(2).transpose(1, 2)
    grads = (_ungrouped(dq_g), dk_all, dv_all)
    given = (dq, dk, dv)
    return tuple(
        g.to(x.dtype) if buf is None else buf.add_(g.to(buf.dtype))
        for g, buf, x in zip(grads, given, (q, k, v))
    )


def query_state(dout, q, out, lse, softmax_scale, chunk, deterministic):
    return DqBuffer(q, lse)
