"""Attention FLOPs: the one count that the benchmarks' TFLOP/s and the planner's kernel times use.

Forward: q k^T and p v are two matrix products of 2 * seq_q * seq_k * head_dim FLOPs per head,
4 * b * sq * sk * h * d in all; a causal mask skips half of the (square) score matrix. The
backward recomputes p and forms dv, dp, dq and dk: five products against the forward's two, so
2.5x forward, and a training step's forward + backward is 3.5x. A ring step is the same count
over the step's own block (its query rows x its key rows, causal only on the diagonal block).
With packed documents only the (query, key) pairs inside a document count: ``causal_pairs``.

Model FLOPs for MFU (6 per matmul parameter per token, attention with backward 2x forward, the
usual convention) live with the model: ringfa4.nn.ModelArgs.flops_per_token.
"""

# FLOPs of each pass relative to the forward.
PASSES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention(batch, seq_q, seq_k, heads, head_dim, causal, direction="fwd"):
    """FLOPs of one attention call over (batch, seq_q, heads, head_dim) queries and seq_k keys.

    ``heads`` counts query heads (grouped-query attention does the same work per query head);
    ``direction`` is "fwd", "bwd" or "fwd+bwd".
    """
    if direction not in PASSES:
        raise ValueError(f"direction must be one of {sorted(PASSES)}, got {direction!r}")
    for name, n in (("batch", batch), ("seq_q", seq_q), ("seq_k", seq_k), ("heads", heads), ("head_dim", head_dim)):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    forward = 4 * batch * seq_q * seq_k * heads * head_dim / (2 if causal else 1)
    return forward * PASSES[direction]


def causal_pairs(cu_seqlens):
    """(query, key) pairs a causal mask leaves visible in packed documents: n (n + 1) / 2 for a
    document of n tokens. ``cu_seqlens``: the documents' boundaries as host ints (FlashAttention's
    varlen format, ascending from 0)."""
    return sum((end - start) * (end - start + 1) // 2 for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))


def hidden_pairs(cu_seqlens, seq_len):
    """Causal pairs packed documents hide in rows of ``seq_len`` tokens, each row starting a
    document: model FLOPs count a row as one causal sequence, so a step's count drops by these.
    ``cu_seqlens``: host ints over the rows laid end to end."""
    return cu_seqlens[-1] // seq_len * causal_pairs([0, seq_len]) - causal_pairs(cu_seqlens)


def tflops(flops, ms):
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if not ms > 0:
        raise ValueError(f"ms must be positive, got {ms!r}")
    return flops / (ms * 1e-3) / 1e12
