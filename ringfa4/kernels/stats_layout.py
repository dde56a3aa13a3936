"""Where the backward preprocess leaves lse2 and delta for the backward kernel: the contract between
bwd_preprocess.py (which writes them) and bwd_sm90.py (which reads them once per query tile).

An MMA thread of the backward holds S^T and dP^T, whose columns are query rows: in each group of
16 rows, rows 2 c + e and 8 + 2 c + e (e = 0, 1; c = lane % 4; PTX ISA, wgmma D fragment). Stored
in row order those four are two 8-byte loads apart; stored with row 8 h + 2 c + e of a group at
4 c + 2 h + e they are one 16-byte load, which halves the shared-memory loads of a step's
statistics (16 fewer instructions per step at tile_m 128). The permutation stays within a group,
so within a query tile: slices of whole tiles (query_rows.QueryState.rows) keep it.
"""
import cutlass
import cutlass.cute as cute

ROW_GROUP = 16  # rows the permutation moves within
THREAD_ROWS = 4  # rows of a group one thread holds, side by side after the permutation


def stats_position(row):
    """Where query row ``row`` (of a padded row of the statistics) is stored: Int32 or int."""
    return (row & ~(ROW_GROUP - 1)) | ((row & 6) << 1) | ((row >> 2) & 2) | (row & 1)


@cute.jit
def thread_stats(sStat: cute.Tensor, first_row, rows: cutlass.Constexpr) -> cute.Tensor:
    """The ``rows`` statistics (of a tile in shared memory, 1-D) of a thread whose first query row
    is ``first_row`` (2 c), in the thread's accumulator row order, loaded 16 bytes at a time."""
    offset = cute.assume(stats_position(first_row), divby=THREAD_ROWS)
    src = cute.make_tensor(sStat.iterator + offset,
                           cute.make_layout((THREAD_ROWS, rows // THREAD_ROWS), stride=(1, ROW_GROUP)))
    vals = cute.make_rmem_tensor((THREAD_ROWS, rows // THREAD_ROWS), cutlass.Float32)
    cute.autovec_copy(src, vals)
    return vals
