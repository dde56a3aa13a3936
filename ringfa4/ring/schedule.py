"""Which queries attend to which keys at each ring step.

At step i rank r holds the KV block of rank (r - i) mod W. A step is the local query rows and the
held key rows it computes, and whether that part is causal (diagonal) or full.
"""
import math
from dataclasses import dataclass

from ringfa4 import documents

# With documents a step's query rows start on a multiple of this (ringfa4.ring.documents narrows
# them): a multiple of every backend's dQ tile (cute: 64 or 128 rows).
ROW_ALIGN = 128


@dataclass(frozen=True)
class Step:
    q: slice
    kv: slice
    causal: bool


def plan(rank, source, layout, causal, local_len):
    """The work of ``rank`` on the KV block of ``source``; None when no query sees any of its keys."""
    everything = slice(0, local_len)
    if not causal:
        return Step(everything, everything, False)
    if source == rank:
        return Step(everything, everything, True)
    if layout in documents.LAYOUTS:  # documents' ids say what each row sees (ringfa4.ring.documents)
        return Step(everything, everything, False)
    if layout == "contiguous":
        return Step(everything, everything, False) if source < rank else None
    # zigzag: rank r holds chunks (r, 2W-1-r). An earlier source's first chunk precedes both local
    # chunks and its second follows them; a later source's two chunks both precede our second chunk only.
    half = local_len // 2
    if source < rank:
        return Step(everything, slice(0, half), False)
    return Step(slice(half, local_len), everything, False)


def row_chunk(layout, causal, local_len, narrowed=False):
    """Every step's query rows start on a multiple of this and end on one or at local_len;
    ``narrowed``: steps cut to their documents' rows (which cannot cut a block of ROW_ALIGN rows or fewer)."""
    chunk = local_len // 2 if causal and layout == "zigzag" else local_len
    return math.gcd(chunk, ROW_ALIGN) if narrowed and local_len > ROW_ALIGN else chunk
