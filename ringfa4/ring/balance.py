"""Load balance of packed documents over a ring, from the boundaries alone (CPU, no tensors of
activations): per rank, the attention FLOPs of the (query, key) pairs it computes that the
document mask leaves visible. A ring step costs its slowest rank, so the worst rank over the
mean is the ring's loss to imbalance.

Document mixes follow issue 14: lengths drawn with a fixed seed from a log-normal with median
4096 tokens (sigma MIX_SIGMA), clipped to [16, total] and packed until the sequence is full (the
last one cut to fit); the "long" mix first places a few documents of 64k tokens or more.
"""
import math

import numpy as np

from ringfa4 import documents, flops
from ringfa4.ring.documents import RingDocuments, positions
from ringfa4.ring.layout import LAYOUTS

MIX_MEDIAN, MIX_SIGMA, MIX_MIN = 4096, 1.0, 16
LONG_MIN = 65536


def document_mix(total, seed, long_docs=0):
    """cu_seqlens (a list, 0 ... total) of one packed sequence of ``total`` tokens."""
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(LONG_MIN, 2 * LONG_MIN)) for _ in range(long_docs)]
    while sum(lengths) < total:
        lengths.append(int(np.clip(rng.lognormal(math.log(MIX_MEDIAN), MIX_SIGMA), MIX_MIN, total)))
    rng.shuffle(lengths)
    bounds = np.minimum(np.cumsum([0] + lengths), total)
    return sorted(set(bounds.tolist()))


def visible_pairs(row, held, causal):
    """(query, key) pairs of the full sequence that the queries at global positions ``held`` see."""
    held = np.asarray(held, dtype=np.int64)
    bounds = np.asarray(row, dtype=np.int64)
    doc = np.searchsorted(bounds, held, side="right") - 1
    if causal:
        return int((held - bounds[doc] + 1).sum())
    return int((bounds[doc + 1] - bounds[doc]).sum())


def rank_flops(row, world, layout, causal=True, heads=1, head_dim=128):
    """Forward attention FLOPs of the visible pairs of each rank's queries (ringfa4.flops' count of
    one query against one key, times the pairs)."""
    per_pair = flops.attention(1, 1, 1, heads, head_dim, causal=False)
    return [per_pair * visible_pairs(row, positions([row], r, world, layout, row[-1])[0].numpy(), causal)
            for r in range(world)]


def imbalance(row, world, layout, causal=True):
    """The worst rank's work over the mean (1.0: perfect balance)."""
    work = rank_flops(row, world, layout, causal)
    return max(work) / (sum(work) / world)


MIXES = (("log-normal", 0), ("log-normal + 3 long", 3))


def ring_steps(row, world, layout, causal=True):
    """Steps a ring over these documents takes (ringfa4.ring.documents.RingDocuments.steps)."""
    return RingDocuments([row], 0, world, layout, row[-1], "cpu").steps(causal)


def carried_share(row, world, layout, causal=True):
    """Of the rows of the blocks a ring's transfers would move whole, the share they carry
    (ringfa4.ring.documents.RingDocuments.carried: the rows another rank reads; every hop of a
    block carries the same rows)."""
    docs = RingDocuments([row], 0, world, layout, row[-1], "cpu")
    local_len = row[-1] // world
    return sum(len(range(*docs.carried(s, causal).indices(local_len))) for s in range(world)) / (world * local_len)


def report(totals=(1 << 17, 1 << 19), worlds=(2, 4, 8), seeds=(0, 1, 2)):
    """Lines of the table `python -m ringfa4.plan --documents` prints: worst rank / mean, causal,
    per layout, for each mix, total length and ring size, over a few seeds (their worst)."""
    lines = ["packed documents, causal: worst rank's visible-pair FLOPs / mean (max over seeds "
             f"{', '.join(map(str, seeds))}; log-normal lengths, median {MIX_MEDIAN}, sigma {MIX_SIGMA}), "
             "the most ring steps document_balanced takes (of W) and the largest share of its blocks' rows "
             "its transfers carry",
             f"{'mix':<20} {'total':>7} {'docs':>9} {'W':>2}  " + "  ".join(f"{x:>15}" for x in LAYOUTS)
             + "  steps  carried"]
    for name, long_docs in MIXES:
        for total in totals:
            rows = [document_mix(total, seed, long_docs) for seed in seeds]
            counts = sorted(len(r) - 1 for r in rows)
            for world in worlds:
                worst = [max(imbalance(r, world, layout) for r in rows) for layout in LAYOUTS]
                steps = max(ring_steps(r, world, documents.DOCUMENT_BALANCED) for r in rows)
                carried = max(carried_share(r, world, documents.DOCUMENT_BALANCED) for r in rows)
                lines.append(f"{name:<20} {total // 1024:>6}k {counts[0]:>4}-{counts[-1]:<4} {world:>2}  "
                             + "  ".join(f"{w:>14.3f}x" for w in worst) + f"  {steps:>5}  {carried:>7.1%}")
    return lines
