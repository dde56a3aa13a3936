"""Packed documents inside a ring: which documents each step's rows hold, the ids its backend
call gets, the steps that launch nothing, how many steps the ring needs, and a count of them.

Every rank knows cu_seqlens (the same on every rank) and the layout, so it derives the document
ids of every rank's rows by itself: nothing about documents travels with the KV blocks.

A step whose query rows and held keys share no document (in any batch row) launches nothing: no
kernel, no merge, no dK/dV add. Beyond the farthest hop at which any rank still sees keys (rank
r seeing rank r - h's), no rank needs another block: the ring then takes h + 1 steps instead of
W and the blocks travel h hops (ringfa4.ring.attention). ``counting()`` reports, per phase, the
steps computed and skipped, the bytes of K and V the skipped steps' kernels did not read, and
the transfers the shorter ring did not make. A block's transfers carry only the rows of the
documents other ranks see (``carried``), and the count has the bytes they left out too.

Under a document layout (ringfa4.documents) a rank holds each document as one or two pieces of
consecutive positions, and for another rank's block every pair of pieces of a document is seen
all or nothing (a key piece before a query piece is seen whole, after it not at all). Such a step
is one non-causal call over all rows whose ids say exactly that: a document d's rows get 4d, its
key pieces no query piece sees 4d + 1, or its query pieces that see no key piece 4d - 1, which
match nothing and keep the ids nondecreasing. (document_zigzag: from an earlier rank both local
pieces see the block's first piece and not its second; from a later one only the local second
piece sees, and it sees both.)

A step that runs covers only the rows that can see anything: ids are nondecreasing, so each
shared document is one run of query rows and one of key rows, and the step becomes one call per
group of shared documents that lie close together (SPLIT_ROWS), its merge and its dK/dV add over
those runs only, not the whole block (most of a step's rows see nothing when a rank holds many
documents). Query runs are widened to multiples of ROW_ALIGN, where the backward's dQ state wants
them to start (ringfa4.ring.schedule.row_chunk); the calls' runs never overlap, so no pair is
computed twice. A batch of several rows keeps one call over the hull of its runs.
"""
import contextlib
import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from ringfa4 import documents
from ringfa4.ring.layout import chunk_ids, num_chunks
from ringfa4.ring.schedule import ROW_ALIGN

# Rows seeing nothing between two shared documents from which they go to separate calls: a call
# costs ~0.1 ms of launches and passes, a query tile that sees nothing ~10 us of a CTA's setup over
# the GPU's ~130 SMs, so gaps of a few thousand rows are worth a call.
SPLIT_ROWS = 2048


@dataclass
class SkipCount:
    """Ring steps of the calls inside a ``counting()`` block, per phase ("fwd", "bwd")."""
    computed: dict
    skipped: dict
    skipped_kv_bytes: dict
    transfers_saved: dict  # block transfers (KV, or dK/dV sums) not made: a shorter ring, or no rank reads the block
    transfer_bytes_saved: dict  # their bytes, and those of the rows the transfers made left out (carried)


_active = None


@contextlib.contextmanager
def counting():
    """Count the steps of every ring call with documents inside the block (the yielded SkipCount)."""
    global _active
    if _active is not None:
        raise RuntimeError("documents.counting() blocks do not nest")
    _active = SkipCount(*({"fwd": 0, "bwd": 0} for _ in range(5)))
    try:
        yield _active
    finally:
        _active = None


def _count(phase, skipped, kv_bytes=0):
    if _active is None:
        return
    if skipped:
        _active.skipped[phase] += 1
        _active.skipped_kv_bytes[phase] += kv_bytes
    else:
        _active.computed[phase] += 1


def count_saved(phase, transfers, nbytes):
    """Record ``transfers`` block transfers that a shorter ring (or a block no other rank reads)
    did not make, and ``nbytes`` not sent, theirs and the rows of the blocks sent that no rank reads."""
    if _active is not None and (transfers or nbytes):
        _active.transfers_saved[phase] += transfers
        _active.transfer_bytes_saved[phase] += nbytes


def positions(rows, rank, world, layout, seq_len):
    """(b, L) int64: the global positions ring rank ``rank`` of ``world`` holds, in local order
    (increasing, for every layout)."""
    if layout in documents.LAYOUTS:
        return documents.held_positions(rows, rank, world, layout)
    chunk = seq_len // num_chunks(world, layout)
    local = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, world, layout)])
    return local.expand(len(rows), -1)


def _spans(ids, pos):
    """Per batch row, {document: (first position, last position)} of a rank's rows."""
    out = []
    for d_row, p_row in zip(ids.numpy(), pos.numpy()):
        docs, first = np.unique(d_row, return_index=True)
        last = np.append(first[1:], len(d_row)) - 1
        out.append(dict(zip(docs.tolist(), zip(p_row[first].tolist(), p_row[last].tolist()))))
    return out


def _pieces(pos):
    """Per row, the start position of the piece (run of consecutive positions) it lies in."""
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    index = torch.where(new, torch.arange(pos.shape[1]).expand_as(pos), 0).cummax(dim=1).values
    return torch.gather(pos, 1, index)


def _piece_ids(q_doc, q_piece, k_doc, k_piece, layout):
    """(q ids, k ids) of one batch row for a causal step between two ranks' pieces (the module
    docstring's 4d, 4d + 1, 4d - 1)."""
    q_ids, k_ids = 4 * q_doc.astype(np.int64), 4 * k_doc.astype(np.int64)
    for d in np.intersect1d(q_doc, k_doc):
        q_starts, k_starts = np.unique(q_piece[q_doc == d]), np.unique(k_piece[k_doc == d])
        sees = k_starts[None, :] < q_starts[:, None]  # (q piece, k piece)
        if sees.all():
            continue
        if (sees == sees[:1]).all():  # each key piece seen by every query piece or by none
            k_ids[(k_doc == d) & np.isin(k_piece, k_starts[~sees[0]])] += 1
        elif (sees == sees[:, :1]).all():  # each query piece sees every key piece or none
            q_ids[(q_doc == d) & np.isin(q_piece, q_starts[~sees[:, 0]])] -= 1
        else:
            raise RuntimeError(f"layout {layout!r}: document {d}'s pieces interleave across two ranks, which "
                               f"one call's ids cannot express")
    return q_ids, k_ids


class RingDocuments:
    """The documents of one ring call on ring rank ``rank`` of ``world`` (``rows``: per batch row
    the boundaries, see ringfa4.documents.row_boundaries). Ids live on the host, where the skip
    decision is taken without a device sync, and on the device, for the backend."""

    def __init__(self, rows, rank, world, layout, seq_len, device):
        self.rank, self.world, self.layout, self.device = rank, world, layout, device
        pos = [positions(rows, r, world, layout, seq_len) for r in range(world)]
        self._ids = [documents.ids_at(rows, p) for p in pos]
        self._spans = [_spans(i, p) for i, p in zip(self._ids, pos)]
        self._piece = [_pieces(p) for p in pos]
        local = self._ids[rank]
        self._local = documents.DocIds(*(local.to(device),) * 2, _longest(local))
        self._step_ids, self._step_parts, self._steps, self._carried = {}, {}, {}, {}

    @property
    def local(self):
        """doc_ids (q_ids, k_ids) of this rank's rows against themselves."""
        return self._local

    def _sees(self, rank, source, causal):
        """Whether any query of ``rank`` sees a key of ``source`` (same document, and causal, an
        earlier position)."""
        for mine, theirs in zip(self._spans[rank], self._spans[source]):
            for d, (first, _) in theirs.items():
                if d in mine and (not causal or first < mine[d][1]):
                    return True
        return False

    def steps(self, causal):
        """Ring steps the call needs: one more than the farthest hop at which a rank sees keys."""
        w = self.world
        if causal not in self._steps:
            self._steps[causal] = 1 + max((r - s) % w for r in range(w) for s in range(w)
                                          if s == r or self._sees(r, s, causal))
        return self._steps[causal]

    def _ids_for(self, source, causal):
        """(q ids, k ids) of all local rows against ``source``'s block (the module docstring), on
        the host and on the device."""
        key = (source, causal)
        if key not in self._step_ids:
            q, k = self._ids[self.rank], self._ids[source]
            if causal and source != self.rank and self.layout in documents.LAYOUTS:
                pairs = [_piece_ids(qd, qp, kd, kp, self.layout) for qd, qp, kd, kp in
                         zip(q.numpy(), self._piece[self.rank].numpy(), k.numpy(), self._piece[source].numpy())]
                q, k = (torch.from_numpy(np.stack(t)).to(torch.int32) for t in zip(*pairs))
            self._step_ids[key] = (q, k, q.to(self.device), k.to(self.device))
        return self._step_ids[key]

    def _parts(self, step, source, causal):
        """``step`` cut into the calls over the query and key rows of the documents both sides
        hold ([] when they share none). The local step keeps every row (its result starts the
        ring's sums) and so does a causal one (its queries and keys must stay aligned row for row)."""
        q, k = (t.numpy() for t in self._ids_for(source, causal)[:2])
        q, k = q[:, step.q], k[:, step.kv]
        shared = [np.intersect1d(qr, kr) for qr, kr in zip(q, k)]
        if not any(s.size for s in shared):
            return []
        if source == self.rank or step.causal:
            return [step]
        local_len = self._local[0].shape[1]
        q0, q1, _ = step.q.indices(local_len)
        k0 = step.kv.indices(local_len)[0]
        groups = _groups(q[0], k[0], shared[0]) if len(q) == 1 else [_hull(q, k, shared)]
        parts = []
        for (qa, qb), (ka, kb) in groups:
            first = max(q0, (q0 + qa) // ROW_ALIGN * ROW_ALIGN)
            stop = min(q1, -(-(q0 + qb) // ROW_ALIGN) * ROW_ALIGN)
            kv = slice(k0 + ka, k0 + kb)
            if parts and first < parts[-1].q.stop:  # widened query runs that meet: one call
                last = parts.pop()
                first, kv = last.q.start, slice(last.kv.start, kv.stop)
            parts.append(replace(step, q=slice(first, stop), kv=kv))
        return parts

    def calls(self, step, source, causal, phase, kv, halved=False):
        """[(step, doc_ids)] of the backend calls of this ring step: its rows that share documents,
        in one call or a few (none when nothing is shared, counted as skipped, with the bytes of
        the ``kv`` rows it would have read). The same doc_ids objects every call, so that a
        backend may derive what it reads of them once (ringfa4.backends.cute.interface).
        ``halved``: a step of one call has it cut in two at half its keys (a ring backward step
        adds the second half's dK/dV straight into the block's sums, ringfa4.ring.attention)."""
        if step is None:
            return []
        key = (source, causal)
        if key not in self._step_parts:
            self._step_parts[key] = self._described(source, causal, self._parts(step, source, causal))
        parts = self._step_parts[key]
        if halved and len(parts) == 1 and not parts[0][0].causal:
            # Only the halves are new: a call too short to cut keeps the whole step's doc_ids.
            key = (source, causal, "halved")
            if key not in self._step_parts:
                halves = _halves(parts[0][0])
                self._step_parts[key] = parts if len(halves) == 1 else self._described(source, causal, halves)
            parts = self._step_parts[key]
        if parts:
            _count(phase, False)
        else:
            _count(phase, True, sum(t[:, step.kv].numel() * t.element_size() for t in kv))
        return parts

    def _described(self, source, causal, parts):
        """[(step, doc_ids)] of calls over ``parts`` of a step of ``source``'s block."""
        q_host, _, q_dev, k_dev = self._ids_for(source, causal)
        return [(part, documents.DocIds(q_dev[:, part.q], k_dev[:, part.kv], _longest(q_host[:, part.q])))
                for part in parts]

    def carried(self, source, causal):
        """The rows of ``source``'s K/V block (and of its dK/dV sums) that the ring's transfers
        carry: from the first to the last of its rows in a document that a rank the block reaches
        sees (holds, and causal, holds past the block's first key of it); a superset of the rows
        those ranks' calls read, found from the documents' spans alone (exact calls of every rank
        would cost W^2 of them). slice(0, 0) when no rank sees any. Every transfer of the block
        carries the same rows, so that the ranks it passes on to find theirs, and sender and
        receiver agree without a word. A batch of several rows carries every row (a row range of
        it is no contiguous buffer)."""
        key = (source, causal)
        if key not in self._carried:
            local_len = self._local[0].shape[1]
            readers = [(source + hop) % self.world for hop in range(1, self.steps(causal))]
            ranges = []
            for row, (ids, keys) in enumerate(zip(self._ids[source].numpy(), self._spans[source])):
                seen = [d for d, (first, _) in keys.items()
                        if any(d in self._spans[r][row] and (not causal or first < self._spans[r][row][d][1])
                               for r in readers)]
                if seen:  # ids are nondecreasing: the first seen document's rows come first
                    ranges.append((int(_rows_of(ids, min(seen))[0]), int(_rows_of(ids, max(seen))[1])))
            if len(self._ids[source]) > 1 and ranges:
                ranges = [(0, local_len)]
            self._carried[key] = (slice(min(a for a, _ in ranges), max(b for _, b in ranges)) if ranges
                                  else slice(0, 0))
        return self._carried[key]


def _longest(ids):
    """DocIds.longest of host ids (b, n): the longest run of one id in a row."""
    return max(int(np.unique(row, return_counts=True)[1].max()) for row in ids.numpy()) if ids.numel() else 0


def _halves(step):
    """``step`` as two calls over the halves of its keys, cut on the ROW_ALIGN multiple nearest
    the middle; one call when that leaves a half empty."""
    first, stop = step.kv.start, step.kv.stop
    cut = first + round((stop - first) / (2 * ROW_ALIGN)) * ROW_ALIGN
    if not first < cut < stop:
        return [step]
    return [replace(step, kv=slice(first, cut)), replace(step, kv=slice(cut, stop))]


def _rows_of(ids, d):
    """[first, last + 1) of the rows holding id d (ids nondecreasing)."""
    return np.searchsorted(ids, d, "left"), np.searchsorted(ids, d, "right")


def _groups(q, k, shared):
    """One batch row: [((q first, q stop), (k first, k stop))] of the shared documents, those less
    than SPLIT_ROWS rows apart (on either side) grouped into one."""
    groups = []
    for d in shared:
        (qa, qb), (ka, kb) = _rows_of(q, d), _rows_of(k, d)
        if groups and (qa - groups[-1][0][1] < SPLIT_ROWS or ka - groups[-1][1][1] < SPLIT_ROWS):
            (qa, _), (ka, _) = groups.pop()
        groups.append(((qa, qb), (ka, kb)))
    return groups


def _hull(q, k, shared):
    """Several batch rows: the one group from the first to the last row of any shared document."""
    runs = [(_rows_of(qr, s[0])[0], _rows_of(qr, s[-1])[1], _rows_of(kr, s[0])[0], _rows_of(kr, s[-1])[1])
            for qr, kr, s in zip(q, k, shared) if s.size]
    return (min(r[0] for r in runs), max(r[1] for r in runs)), (min(r[2] for r in runs), max(r[3] for r in runs))


def ring_documents(rows, rank, world, layout, seq_len, device):
    """The RingDocuments of a call, shared by calls with the same documents: a model's layers
    (and their backward) all ask for the same one in a training step."""
    return _cached(tuple(map(tuple, rows)), rank, world, layout, seq_len, device)


@functools.lru_cache(maxsize=8)
def _cached(rows, rank, world, layout, seq_len, device):
    return RingDocuments([list(row) for row in rows], rank, world, layout, seq_len, device)
