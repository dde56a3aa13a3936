"""The attention mask of the forward and backward kernels: a score is kept when its key lies
before seqlen_k, under causal not after its query (sq == sk, positions aligned at 0), and with
packed documents inside its query's document.

Scores are masked in a thread's (rows, cols) view of a wgmma accumulator (layout.acc_rows_view):
rows are queries, columns keys. A thread's columns are thread 0's shifted by one offset, so each
column is tested as thread 0's compile-time key against per-row limits computed at run time:
one or two integer compares per score, no per-score coordinate arithmetic.

A tile of packed GQA rows (the forward's pack-GQA) holds ``rows_per_query`` rows per query
position, the query heads of one kv head: a row's position is its index // rows_per_query.

Documents come as each query's visible keys, [key_lo[q], key_hi[q]): with document ids
nondecreasing along both sequences, the keys of one document are contiguous, so the id test
q_ids[q] == k_ids[k] is the range test key_lo[q] <= k < key_hi[q] (an empty range when the
document has no key here). A transposed product holds few keys per thread and many queries
(the backward's S^T: 2 keys, tile_m / 4 queries), so there the test is from the other side,
query_lo[k] <= q < query_hi[k], with ranges read once per CTA instead of once per query at
every masked step (apply_key_ranges).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr


class AttentionMask:
    """The mask of one kernel's (tile_m x tile_n) score tiles. ``key_first``: the kernel's
    coordinates are (key, query) pairs (a transposed product such as the backward's S^T), else
    (query, key). ``has_docs``: apply takes each query's visible key range. ``rows_per_query``:
    tile rows per query position (pack-GQA)."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, key_first: bool,
                 has_docs: bool = False, rows_per_query: int = 1):
        self.tile_m = tile_m
        self.rows_per_query = rows_per_query
        self.tile_n = tile_n
        self.causal = causal
        self.has_docs = has_docs
        self.q_mode, self.k_mode = (1, 0) if key_first else (0, 1)

    @cute.jit
    def apply(self, s: cute.Tensor, coords: cute.Tensor, coords0: cute.Tensor, m_block, n_block,
              seqlen_k, key_lo=None, key_hi=None):
        """s[r, c] = -inf where the key is at or past seqlen_k, (causal) after the query or
        (has_docs) outside [key_lo[query], key_hi[query]), for query block m_block and key block
        n_block. coords / coords0: the tile coordinates of this thread's / thread 0's elements
        of s, in the same (rows, cols) view. key_lo / key_hi: one batch row's (seqlen_q,) keys."""
        key0 = coords[0, 0][self.k_mode] + n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            limit = seqlen_k - key0
            if const_expr(self.causal or self.has_docs):
                query = coords[r, 0][self.q_mode] + m_block * self.tile_m
                if const_expr(self.rows_per_query > 1):
                    query = query // self.rows_per_query
            if const_expr(self.causal):
                limit = cutlass.min(limit, query + 1 - key0)
            if const_expr(self.has_docs):
                # Rows past seqlen_q (a ragged last block) are never stored: read a valid row.
                row = cutlass.min(query, key_lo.shape[0] - 1)
                limit = cutlass.min(limit, key_hi[row] - key0)
                low = key_lo[row] - key0
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    key = coords0[0, c][self.k_mode]
                    s[r, c] = -Float32.inf if (key >= limit) | (key < low) else s[r, c]
            else:
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, c] = -Float32.inf if coords0[0, c][self.k_mode] >= limit else s[r, c]

    @cute.jit
    def apply_key_ranges(self, s: cute.Tensor, coords: cute.Tensor, coords0: cute.Tensor, m_block,
                         query_lo: cute.Tensor, query_hi: cute.Tensor):
        """s[r, c] = -inf where the query is outside [query_lo[c], query_hi[c]) (key_first):
        query_lo / query_hi hold, per key column of this thread, the queries that key is visible
        to, with causality and keys at or past seqlen_k (an empty range) folded in by the
        caller. Two compile-time compares per score against per-column limits."""
        # This thread's queries are thread 0's shifted by one offset: compare those.
        base = coords[0, 0][self.q_mode] - coords0[0, 0][self.q_mode] + m_block * self.tile_m
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            low, limit = query_lo[c] - base, query_hi[c] - base
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                query = coords0[r, 0][self.q_mode]
                s[r, c] = -Float32.inf if (query < low) | (query >= limit) else s[r, c]
