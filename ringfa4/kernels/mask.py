"""The attention mask of the forward and backward kernels: a score is kept when its key lies
before seqlen_k and, under causal, not after its query (sq == sk, positions aligned at 0).

Scores are masked in a thread's (rows, cols) view of a wgmma accumulator (layout.acc_rows_view):
rows are queries, columns keys. A thread's columns are thread 0's shifted by one offset, so each
column is tested as thread 0's compile-time key against a per-row limit computed at run time:
one integer compare per score, no per-score coordinate arithmetic.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr


class AttentionMask:
    """The mask of one kernel's (tile_m x tile_n) score tiles. ``key_first``: the kernel's
    coordinates are (key, query) pairs (a transposed product such as the backward's S^T), else
    (query, key)."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, key_first: bool):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal
        self.q_mode, self.k_mode = (1, 0) if key_first else (0, 1)

    @cute.jit
    def apply(self, s: cute.Tensor, coords: cute.Tensor, coords0: cute.Tensor, m_block, n_block,
              seqlen_k):
        """s[r, c] = -inf where the key is at or past seqlen_k or (causal) after the query, for
        query block m_block and key block n_block. coords / coords0: the tile coordinates of
        this thread's / thread 0's elements of s, in the same (rows, cols) view."""
        key0 = coords[0, 0][self.k_mode] + n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            limit = seqlen_k - key0
            if const_expr(self.causal):
                query = coords[r, 0][self.q_mode] + m_block * self.tile_m
                limit = cutlass.min(limit, query + 1 - key0)
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, c] = -Float32.inf if coords0[0, c][self.k_mode] >= limit else s[r, c]
