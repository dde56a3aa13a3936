"""Packed documents: ``cu_seqlens`` checked once, turned into per-row document ids, and the
layouts that follow the documents ("document_zigzag", "document_balanced").

cu_seqlens is FlashAttention's varlen format: ONE 1-D int32 tensor of cumulative document
lengths, starting at 0, strictly increasing. Its last value says how it applies to a batch of
(b, s) sequences:
  - s:      one set of boundaries shared by every row of the batch;
  - b * s:  FA's packed batch, the rows concatenated (documents never cross a row, so every
            multiple of s is a boundary); rows may then hold different documents.
A 1-D tensor is what users of flash_attn_varlen_func already build; a (b, n+1) tensor would
force every row to hold the same number of documents, and a list of tensors cannot travel
through custom operators or be checked as one value across ranks.

It may live on the CPU or on q's device. On the device, reading it waits for the GPU, so it is
read once per tensor version: change it in place with torch operations (which advance the
version) or pass a new tensor, never by writes torch does not see (a raw kernel, DLPack).

Positions are global: those of the full, unsharded sequence. A query at position i sees a key at
position j iff both lie in the same document (and j <= i when causal).

Backends receive ``doc_ids = (q_ids, k_ids)``: int32 (b, sq) and (b, sk) on q's device, the
document index of every query and key row, nondecreasing along the sequence (ringfa4.backends).

Which rank holds a document changes no result (attention is per document), so the document
layouts place them for the ring's sake; each rank holds its positions in increasing order:
  - document_zigzag: every document cut into 2W pieces, rank r holding pieces r and 2W-1-r (the
    same causal work of every document on every rank, but every piece short);
  - document_balanced: documents whole where they can be, longest first, each on the least
    loaded rank that has room and work to spare; one with more work than that in consecutive
    pieces of equal work on consecutive ranks (at most W/2 of them); one that needs more, or finds
    no room, cut as document_zigzag cuts it. The shortest documents (up to an eighth of the
    tokens) then fill the room left, rank by rank, one cut at each rank's end and continued on the
    next. That placement is tried with the longest 0, 1, 2, 4, ... documents folded first (at
    most all: document_zigzag), and with documents that find no consecutive ranks folded or left
    to the fill; besides it, every document chained in one order (or all but the longest two,
    placed first in consecutive pieces), each continued on the next rank where it does not fit,
    the order found by a short local search. Of those leaving no rank
    more than 8% over the mean, the one with the least modelled ring time (_Packing.cost: folded
    pieces are short, and every other rank's block a rank reads is a ring step) is taken. Every
    rank holds exactly
    L/W tokens, most documents sit on one rank, and a ring needs only as many steps as the
    farthest piece a rank must reach (ringfa4.ring.documents); one folded document makes it W.
"""
import functools
import math
import random
import zlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

DOCUMENT_ZIGZAG = "document_zigzag"
DOCUMENT_BALANCED = "document_balanced"
LAYOUTS = (DOCUMENT_ZIGZAG, DOCUMENT_BALANCED)

_read = WeakIdKeyDictionary()  # cu_seqlens on a GPU -> (its version when read, its values)


def _host_values(cu_seqlens, device):
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D torch.int32 tensor (FlashAttention's varlen format), "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 values (0 and the sequence length), "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on the CPU or on q's device {device}, got {cu_seqlens.device}")
    if cu_seqlens.device.type == "cpu" or cu_seqlens.is_inference():  # inference tensors keep no version
        return cu_seqlens.tolist()
    # Reading a GPU tensor waits for the device, and every layer of a model passes the same one:
    # it is read once per version (which torch's in-place writes advance).
    seen = _read.get(cu_seqlens)
    if seen is None or seen[0] != cu_seqlens._version:
        seen = _read[cu_seqlens] = (cu_seqlens._version, tuple(cu_seqlens.tolist()))
    return list(seen[1])


def from_starts(starts):
    """cu_seqlens (int32, on the CPU) of a (rows, s) bool mask that marks the first token of every
    document (every row's first token among them): the rows concatenated, which for one row is the
    form shared by a batch."""
    flat = starts.cpu().flatten().nonzero().flatten()
    return torch.cat([flat, flat.new_tensor([starts.numel()])]).to(torch.int32)


def row_boundaries(cu_seqlens, batch, seq_len, device):
    """Per batch row, the document boundaries [0, ..., seq_len] (host ints); raises TypeError or
    ValueError naming cu_seqlens (see the module docstring for the two forms)."""
    values = _host_values(cu_seqlens, device)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    bad = next((i for i in range(1, len(values)) if values[i] <= values[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be strictly increasing, got {values[bad - 1]} then {values[bad]} "
                         f"at index {bad}")
    if values[-1] == seq_len:
        return [values] * batch
    if values[-1] != batch * seq_len or batch == 1:
        raise ValueError(f"cu_seqlens must end at the sequence length {seq_len} (shared by the batch) or at "
                         f"batch x sequence length {batch * seq_len} (FA's packed batch), got {values[-1]}")
    present = set(values)
    missing = [r * seq_len for r in range(1, batch) if r * seq_len not in present]
    if missing:
        raise ValueError(f"cu_seqlens over the packed batch ({batch} rows of {seq_len}) must hold every row "
                         f"end: documents never cross rows; {missing[0]} is missing")
    return [[x - r * seq_len for x in values if r * seq_len <= x <= (r + 1) * seq_len] for r in range(batch)]


def checksum(rows, layout=None, world=1):
    """(documents, crc32 of the boundaries): what every rank of a ring of ``world`` must agree on.
    Under document_balanced the crc covers each row's placement too: its local search runs on every
    rank, which must all find the same."""
    flat = [x for row in rows for x in row]
    if layout == DOCUMENT_BALANCED:
        flat += [x for row in rows for piece in balanced_pieces(row, world) for x in piece]
    return sum(len(row) - 1 for row in rows), zlib.crc32(torch.tensor(flat, dtype=torch.int64).numpy().tobytes())


def is_dense(rows):
    """True when every row is one document: the call is plain attention, bit for bit."""
    return all(len(row) == 2 for row in rows)


def ids_at(rows, positions):
    """int32 document ids (b, n) of the global positions (b, n) (a CPU tensor)."""
    width = max(len(row) for row in rows)
    # Rows with fewer documents are padded with their end, which no position reaches.
    bounds = torch.tensor([row + [row[-1]] * (width - len(row)) for row in rows], dtype=torch.int64)
    return (torch.searchsorted(bounds, positions.contiguous(), right=True) - 1).to(torch.int32)


def pieces(row, world):
    """document_zigzag: every document of ``row`` cut into 2W pieces, as (document, piece index,
    start, stop). A document of n tokens gets pieces of n // 2W tokens; its n % 2W remaining
    tokens go one each to pieces chosen round-robin over the whole row, so every piece index
    gets the same count and every rank the same length."""
    n_pieces = 2 * world
    turn = 0
    out = []
    for d, (start, stop) in enumerate(zip(row[:-1], row[1:])):
        base, extra = divmod(stop - start, n_pieces)
        longer = {(turn + t) % n_pieces for t in range(extra)}
        turn += extra
        for p in range(n_pieces):
            size = base + (p in longer)
            out.append((d, p, start, start + size))
            start += size
    return out


def zigzag_rank(piece, world):
    """The rank that holds piece ``piece`` of 2W (zigzag: rank r holds pieces r and 2W-1-r)."""
    return min(piece, 2 * world - 1 - piece)


def _pairs(n):
    """Causal (query, key) pairs of the first n tokens of a document."""
    return n * (n + 1) // 2


@functools.lru_cache(maxsize=8)
def _folds(row, world):
    """Per document of ``row``, its pieces as document_zigzag cuts it: [(rank, start, stop)]."""
    folds = {d: [] for d in range(len(row) - 1)}
    for d, p, a, b in pieces(row, world):
        folds[d].append((zigzag_rank(p, world), a, b))
    return folds


class _Packing:
    """document_balanced's placement of one row's documents: each rank's room (tokens), causal
    work and modelled ring time so far, and the pieces placed."""

    def __init__(self, row, world):
        self.world, self.share = world, row[-1] // world
        self.docs = list(zip(row[:-1], row[1:]))
        self.target = sum(_pairs(b - a) for a, b in self.docs) / world  # an even share of the work
        self.room, self.work, self.out = [self.share] * world, [0] * world, []
        self.model, self.reads = [0.0] * world, [0] * world  # cost()'s terms per rank
        self.seen = {}  # document -> (tile-rounded rows of its pieces so far, their ranks as a bit mask)
        self.span = max(2, world // 2)  # the most consecutive ranks one document takes: hops for the ring
        self.folds = _folds(tuple(row), world)

    def length(self, d):
        return self.docs[d][1] - self.docs[d][0]

    def imbalance(self):
        """The worst rank's causal work over the mean."""
        return max(self.work) * self.world / max(1, sum(self.work))

    def cost(self):
        """The slowest rank's modelled ring time, in pairs: every (query piece, earlier key piece)
        pair of a document counted out to whole tiles (TILE_ROWS; a short piece wastes most of
        its tiles), and STEP_PAIRS for every other rank whose block the rank reads (place()
        keeps both terms per rank)."""
        return max(w + STEP_PAIRS * bin(m).count("1") for w, m in zip(self.model, self.reads))

    def copy(self):
        twin = object.__new__(_Packing)
        twin.__dict__.update(self.__dict__)
        for name in ("room", "work", "out", "model", "reads"):
            setattr(twin, name, list(getattr(self, name)))
        twin.seen = dict(self.seen)
        return twin

    def place(self, rank, d, a, b):
        """Piece [a, b) of document d on ``rank``; a document's pieces come in increasing order."""
        first = self.docs[d][0]
        self.out.append((rank, a, b))
        self.room[rank] -= b - a
        self.work[rank] += _pairs(b - first) - _pairs(a - first)
        keys, ranks = self.seen.get(d, (0, 0))
        n = b - a + TILE_ROWS
        self.model[rank] += n * n / 2 + n * keys
        self.reads[rank] |= ranks & ~(1 << rank)
        self.seen[d] = (keys + n, ranks | 1 << rank)

    def fold(self, d):
        """Document d cut as document_zigzag cuts it (the same work on every rank), if there is room."""
        need = [0] * self.world
        for r, a, b in self.folds[d]:
            need[r] += b - a
        if any(n > left for n, left in zip(need, self.room)):
            return False
        for r, a, b in self.folds[d]:
            self.place(r, d, a, b)
        return True

    def parts(self, d):
        """Consecutive pieces of equal work document d takes: each adds at most three quarters of
        what the least loaded rank has left of an even share (the rest is for the documents still
        to come), the first (the longest) at most half a rank's tokens (room for others' pieces)."""
        by_work = math.ceil(_pairs(self.length(d)) / max(1.0, 0.75 * (self.target - min(self.work))))
        return min(self.world, max(by_work, math.ceil((2 * self.length(d) / self.share) ** 2)))

    def consecutive(self, d):
        """Document d whole where a rank has room and work to spare, else in parts(d) pieces on the
        least loaded consecutive ranks with room, each seeing the pieces before it (a prefix of x
        tokens holds x(x+1)/2 pairs); False where no ranks can take it so."""
        a, b = self.docs[d]
        fits = any(r >= b - a and w + _pairs(b - a) <= self.target for r, w in zip(self.room, self.work))
        k = 1 if fits else self.parts(d)
        if k > self.span:
            return False
        cuts = [a + round((b - a) * math.sqrt(j / k)) for j in range(k + 1)]
        windows = [r for r in range(self.world - k + 1)
                   if all(self.room[r + j] >= cuts[j + 1] - cuts[j]
                          and self.work[r + j] + _pairs(b - a) / k <= self.target for j in range(k))]
        if not windows:
            return False
        start = min(windows, key=lambda r: max(self.work[r:r + k]))
        for j in range(k):
            self.place(start + j, d, cuts[j], cuts[j + 1])
        return True

    def chain(self, order):
        """The documents of ``order`` one after another into the room left, rank by rank: one that
        does not fit continues on the next rank (pieces on consecutive ranks, one hop each)."""
        rank = 0
        for d in order:
            a, b = self.docs[d]
            while a < b:
                while self.room[rank] == 0:
                    rank += 1
                stop = a + min(self.room[rank], b - a)
                self.place(rank, d, a, stop)
                a = stop

    def fill(self, kept):
        """The room left, rank by rank, from ``kept``: documents that fit whole (under the target
        the longest, over it the shortest), then the longest cut at the rank's end and continued
        on the next (one hop for the ring)."""
        kept = sorted(kept, key=lambda d: -self.length(d))
        carried = []

        def take(rank, d, a):
            """As much of document d from token a on as fits the rank; the rest to the next."""
            stop = a + min(self.room[rank], self.docs[d][1] - a)
            self.place(rank, d, a, stop)
            if stop < self.docs[d][1]:
                carried.append((d, stop))

        for rank in range(self.world):
            for d, a in [carried.pop() for _ in range(len(carried))]:
                take(rank, d, a)
            while self.room[rank] > 0 and kept:
                fits = [d for d in kept if self.length(d) <= self.room[rank]]
                d = (fits[0] if self.work[rank] < self.target else fits[-1]) if fits else kept[0]
                kept.remove(d)
                take(rank, d, self.docs[d][0])


def balanced_pieces(row, world):
    """document_balanced: the pieces of ``row`` as (rank, start, stop), every rank's summing to
    row[-1] / world tokens (see the module docstring)."""
    return _balanced_pieces(tuple(row), world)


# How far the worst rank's causal work may exceed the mean before more documents are folded
# (issue 14 asks for 1.10; whole documents leave steps of their own size).
BALANCE_BOUND = 1.08
# _Packing.cost's model of a rank's ring time, fitted to a profile of the simulated 8-rank ring
# (H100, 32/8 heads, hdim 128, 4k documents, 2026-11-25): a step over another rank's block costs
# ~0.5 ms beyond its pairs (passes, launches, short walks), ~5.6M pairs at the ~11M pairs/ms its
# kernels ran; pieces are computed in tiles of 128 rows.
STEP_PAIRS = 5_600_000
TILE_ROWS = 128


@functools.lru_cache(maxsize=64)
def _balanced_pieces(row, world):
    """balanced_pieces, once per row: every rank's positions come from the same placement. Whole
    documents do not always divide evenly (a rank left with room only for a heavy suffix), so
    the greedy placement is tried with the longest 0, 1, 2, 4, ... documents folded first
    (folding all is document_zigzag, exactly even), with documents that find no consecutive
    ranks folded or left to the fill, and the chained placements where those are not near the
    floor (CHAIN_ABOVE); the cheapest (_Packing.cost) within BALANCE_BOUND x the mean is taken,
    else the most even. Once within
    the bound, folding more only cuts more documents short: a sequence stops at the first
    placement that costs more than the one before it."""
    count = len(row) - 1
    counts = sorted({0, count} | {1 << i for i in range(count.bit_length())})
    tried = []
    for fold_misfits in (True, False):
        last = math.inf
        for folded in counts:
            pack = _placement(row, world, folded, fold_misfits)
            tried.append(pack)
            if pack.imbalance() > BALANCE_BOUND:
                continue
            cost = pack.cost()
            if cost > last:
                break
            last = cost
    within = [pack for pack in tried if pack.imbalance() <= BALANCE_BOUND]
    floor = tried[0].target + STEP_PAIRS  # an even share of the pairs, and one block read
    if not within or min(map(_Packing.cost, within)) > CHAIN_ABOVE * floor:
        tried += [_chained(row, world, split) for split in CHAINED_SPLITS if split < count]
        within = [pack for pack in tried if pack.imbalance() <= BALANCE_BOUND]
    return tuple((min(within, key=_Packing.cost) if within else min(tried, key=_Packing.imbalance)).out)


def _placement(row, world, folded, fold_misfits):
    """The greedy placement with the ``folded`` longest documents folded first; ``fold_misfits``:
    a document that finds no consecutive ranks is folded, else left to the fill."""
    pack = _Packing(row, world)
    longest = sorted(range(len(pack.docs)), key=lambda d: -pack.length(d))
    # Those and documents needing more ranks than a span fold first, while every rank has room for them.
    longest = [d for i, d in enumerate(longest) if not ((i < folded or pack.parts(d) > pack.span) and pack.fold(d))]
    # The shortest, up to an eighth of the tokens, are kept to fill the room left at the end.
    kept = []
    while longest and sum(map(pack.length, kept)) + pack.length(longest[-1]) <= row[-1] // 8:
        kept.append(longest.pop())
    for d in longest:
        if not (pack.consecutive(d) or (fold_misfits and pack.fold(d))):
            kept.append(d)
    pack.fill(kept)
    return pack


# The chained placements: how many of the longest documents are first placed in consecutive
# pieces of equal work (_Packing.consecutive), and the moves of their local search (fewer where
# a row holds many documents: each move places the row anew, CHAIN_BUDGET bounds moves x
# documents and with it the host time of a new cu_seqlens).
CHAINED_SPLITS = (0, 2)
CHAIN_MOVES = 1500
CHAIN_BUDGET = 60_000
CHAIN_PATIENCE = 400  # moves without a better placement before the search stops
# The search runs only where the best greedy placement is modelled this far over the floor: below,
# it gained at most ~2% on the mixes for ~0.2 s of host time per cu_seqlens.
CHAIN_ABOVE = 1.05


def _chained(row, world, split):
    """The ``split`` longest documents in consecutive pieces of equal work where they find the
    ranks, the rest chained (_Packing.chain) in the order a local search finds: from the longest
    and the shortest alternating, a random document moved or two swapped (a fixed seed: every
    rank finds the same), each change kept that is no worse by (excess over BALANCE_BOUND, cost).
    Unlike the greedy placement, a document's cut follows from the order, which lets a heavy
    suffix share its rank with light whole documents."""
    pack = _Packing(row, world)
    longest = sorted(range(len(pack.docs)), key=lambda d: -pack.length(d))
    rest = [d for i, d in enumerate(longest) if not (i < split and pack.consecutive(d))]
    order = [d for pair in zip(rest, reversed(rest)) for d in pair][:len(rest)]

    def placed(order):
        twin = pack.copy()
        twin.chain(order)
        return (max(0.0, twin.imbalance() - BALANCE_BOUND), twin.cost()), twin

    best, best_pack = placed(order)
    rng, n, last = random.Random(0), len(order), 0
    for move in range(min(CHAIN_MOVES, CHAIN_BUDGET // n) if n > 1 else 0):
        if move - last > CHAIN_PATIENCE:
            break
        i, j = rng.randrange(n), rng.randrange(n)
        trial = list(order)
        if rng.random() < 0.5:
            trial[i], trial[j] = trial[j], trial[i]
        else:
            trial.insert(j, trial.pop(i))
        score, twin = placed(trial)
        if score < best:
            last = move
        if score <= best:
            order, best, best_pack = trial, score, twin
    return best_pack


def held_positions(rows, rank, world, layout):
    """(b, L) int64, the global positions ring rank ``rank`` of ``world`` holds under a document
    layout, in increasing order (ringfa4.ring.documents.positions: any layout)."""
    if layout == DOCUMENT_ZIGZAG:
        ranges = [[(a, b) for _, p, a, b in pieces(row, world) if zigzag_rank(p, world) == rank] for row in rows]
    else:
        ranges = [sorted((a, b) for r, a, b in balanced_pieces(row, world) if r == rank) for row in rows]
    return torch.stack([torch.cat([torch.arange(a, b) for a, b in row]) for row in ranges])


def _gather_index(index, x):
    return index.to(x.device).view(*index.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])


def part(x, rows, rank, world, layout, dim=1, head_rank=0, head_world=1):
    """The part of the full sequence ``x`` (batch rows along dim 0, the sequence along ``dim``)
    that ring rank ``rank`` of ``world`` holds under a document ``layout``; with a head group,
    piece ``head_rank`` of ``head_world`` of it (as ringfa4.ring.layout.part)."""
    x = x.movedim(dim, 1)
    local = torch.gather(x, 1, _gather_index(held_positions(rows, rank, world, layout), x))
    if head_world > 1:
        local = local.chunk(head_world, dim=1)[head_rank]
    return local.movedim(1, dim)


def assemble(parts, rows, world, layout, dim=1):
    """The full sequence from every ring rank's part (in rank order) under a document ``layout``."""
    parts = [p.movedim(dim, 1) for p in parts]
    seq_len = parts[0].shape[1] * world
    full = parts[0].new_zeros(parts[0].shape[0], seq_len, *parts[0].shape[2:])
    for rank, local in enumerate(parts):
        full = full.scatter(1, _gather_index(held_positions(rows, rank, world, layout), local), local)
    return full.movedim(1, dim)


def call_kwargs(doc_ids):
    """Keyword arguments of a backend call: none without documents, so that path is the call of
    a ringfa4 without documents, bit for bit (and backends that take no documents still run it)."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}


class DocIds(tuple):
    """doc_ids as backends take them, (q_ids, k_ids), with ``longest``: the most query rows one
    document holds in a batch row (a host int; None: not known), by which a backend may choose
    its kernels without reading the ids from the device."""

    def __new__(cls, q_ids, k_ids, longest=None):
        ids = super().__new__(cls, (q_ids, k_ids))
        ids.longest = longest
        return ids


def local_ids(rows, seq_len, device):
    """doc_ids (q_ids, k_ids) of one unsharded sequence of ``seq_len`` per row, on ``device``: the
    same tensors for the same documents, so a model's layers and their backward share them and
    what the kernels derive from them (ringfa4.backends.cute.interface) instead of rebuilding both
    at every call."""
    return _local_ids(tuple(map(tuple, rows)), seq_len, device)


@functools.lru_cache(maxsize=8)
def _local_ids(rows, seq_len, device):
    ids = ids_at([list(row) for row in rows], torch.arange(seq_len).expand(len(rows), -1)).to(device)
    return DocIds(ids, ids, max(b - a for row in rows for a, b in zip(row, row[1:])))
