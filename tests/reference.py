"""Ground truth for the tests: attention written the obvious way, full score matrix, float64."""
import math

import torch


def attention_fp64(q, k, v, causal=False, softmax_scale=None):
    """(out, lse) of plain softmax attention in float64; differentiable. GQA by repeating kv heads."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    return out, lse
