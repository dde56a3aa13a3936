"""Where the backward kernel leaves dQ for its postprocess: the contract between bwd_sm90.py
(which writes it) and bwd_postprocess.py (which reads it).

Two MMA warp groups of 128 threads each compute one part of every dQ tile: 64 rows at head_dim
64 (128-row tiles), 64 columns at 128. A part is the accumulator of a wgmma m64nNk16, stored as
[register group j][thread t][REGS_PER_STORE registers], a thread's registers in order, so that
register 4 j + 2 hh + e of thread 32 warp + 4 r + c holds accumulator row 16 warp + 8 hh + r and
column 8 j + 2 c + e (PTX ISA, wgmma D fragment). Per (batch, head) the parts follow each
other by query tile, then warp group.
"""
NUM_MMA_WG = 2
WG_THREADS = 128
PART = 64  # a warp group's part spans PART rows (head_dim 64) or PART columns (128) of a tile
REGS_PER_STORE = 4  # registers a thread stores side by side (16 bytes)


QUERY_TILE = {64: 128, 128: 64}  # the backward's query tile (rows) at each head_dim


def parts_split_rows(tile_m: int) -> bool:
    """Whether the warp groups' parts split a dQ tile's rows (else its columns)."""
    return tile_m == PART * NUM_MMA_WG


def turn_counters(dq_warp_per_part: bool) -> int:
    """Deterministic mode's turn counters per dQ tile (bwd_sm90.py orders the tile's reductions
    with them): one per part where each part has a dQ warp of its own, else one for the tile."""
    return NUM_MMA_WG if dq_warp_per_part else 1
