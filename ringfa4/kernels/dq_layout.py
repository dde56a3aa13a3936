"""Where the backward kernel leaves dQ for its postprocess: the contract between bwd_sm90.py
(which writes it) and bwd_postprocess.py (which reads it).

Two MMA warp groups of 128 threads each compute a 64 x 64 part of every dQ tile (the parts split
the tile's rows at head_dim 64, its columns at 128). A part is stored as [register group j]
[thread t][REGS_PER_STORE registers], the wgmma accumulator of a thread in register order, so that
register 4 j + 2 hh + e of thread 32 warp + 4 r + c holds row 16 warp + 8 hh + r and column
8 j + 2 c + e of the part (PTX ISA, wgmma m64nNk16 D fragment). Per (batch, head) the parts
follow each other by query tile, then warp group.
"""
NUM_MMA_WG = 2
WG_THREADS = 128
PART = 64  # a warp group's part of a dQ tile is PART x PART
REGS_PER_STORE = 4  # registers a thread stores side by side (16 bytes)


def query_tile(head_dim: int) -> int:
    """Rows of a dQ tile: 128 at head_dim 64 (the parts split the rows), 64 at 128 (they split
    the columns)."""
    return 128 if head_dim == 64 else 64


def parts_split_rows(head_dim: int) -> bool:
    """Whether the warp groups' parts split a dQ tile's rows (else its columns)."""
    return query_tile(head_dim) == PART * NUM_MMA_WG
