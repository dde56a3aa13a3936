"""Packed documents inside a ring: which documents each step's rows hold, the ids its backend
call gets, the steps that launch nothing, and a count of them for benchmarks.

Every rank knows cu_seqlens (the same on every rank) and the layout, so it derives the document
ids of every rank's rows by itself: nothing about documents travels with the KV blocks.

A step whose query rows and held keys share no document (in any batch row) launches nothing: no
kernel, no merge, no dK/dV add. Its KV block still travels (later ranks need it), so no
transfer is saved. ``counting()`` reports, per phase, the steps computed and skipped, and the
bytes of K and V the skipped steps' kernels did not read.

document_zigzag (ringfa4.documents.pieces): rank r holds pieces r and 2W-1-r of every document,
so for another rank's block every document's visible part is all-or-nothing per piece:
  - from an earlier rank s < r: both local pieces see the block's first piece (s) and not its
    second (2W-1-s);
  - from a later rank s > r: only the local second piece (2W-1-r) sees, and it sees both.
Such a step is one non-causal call over all rows whose ids say exactly that: document d's
visible rows get id 2d, its invisible ones 2d+1 (keys after) or 2d-1 (queries before), which
match nothing and keep the ids nondecreasing.
"""
import contextlib
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ringfa4 import documents
from ringfa4.ring.layout import chunk_ids, num_chunks


@dataclass
class SkipCount:
    """Ring steps of the calls inside a ``counting()`` block, per phase ("fwd", "bwd")."""
    computed: dict
    skipped: dict
    skipped_kv_bytes: dict


_active = None


@contextlib.contextmanager
def counting():
    """Count the steps of every ring call with documents inside the block (the yielded SkipCount)."""
    global _active
    if _active is not None:
        raise RuntimeError("documents.counting() blocks do not nest")
    _active = SkipCount({"fwd": 0, "bwd": 0}, {"fwd": 0, "bwd": 0}, {"fwd": 0, "bwd": 0})
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


def positions(rows, rank, world, layout, seq_len):
    """(b, L) int64: the global positions ring rank ``rank`` of ``world`` holds, in local order."""
    if layout == documents.DOCUMENT_ZIGZAG:
        return documents.zigzag_positions(rows, rank, world)
    chunk = seq_len // num_chunks(world, layout)
    local = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, world, layout)])
    return local.expand(len(rows), -1)


class RingDocuments:
    """The documents of one ring call on ring rank ``rank`` of ``world`` (``rows``: per batch row
    the boundaries, see ringfa4.documents.row_boundaries). Ids live on the host, where the skip
    decision is taken without a device sync, and on the device, for the backend."""

    def __init__(self, rows, rank, world, layout, seq_len, device):
        self.rank, self.world = rank, world
        host = [documents.ids_at(rows, positions(rows, r, world, layout, seq_len)) for r in range(world)]
        late = ([documents.late_rows(rows, r, world) for r in range(world)]
                if layout == documents.DOCUMENT_ZIGZAG else None)
        self._host = (host, late)
        self._device = ([t.to(device) for t in host], None if late is None else [t.to(device) for t in late])

    @property
    def local(self):
        """doc_ids (q_ids, k_ids) of this rank's rows against themselves."""
        ids = self._device[0][self.rank]
        return ids, ids

    def _ids(self, where, source, causal):
        """(q ids, k ids) of all local rows against ``source``'s block (see the module docstring)."""
        ids, late = where
        q, k = ids[self.rank], ids[source]
        if late is None or not causal or source == self.rank:
            return q, k
        if source < self.rank:
            return q * 2, k * 2 + late[source]
        return q * 2 - (~late[self.rank]).to(q.dtype), k * 2

    def step(self, step, source, causal, phase, kv):
        """(step, doc_ids) for the backend, or (None, None) when the step shares no document
        (counted as skipped, with the bytes of the ``kv`` rows it would have read)."""
        if step is None:
            return None, None
        q, k = self._ids(self._host, source, causal)
        q, k = q[:, step.q].numpy(), k[:, step.kv].numpy()
        if not any(np.intersect1d(qr, kr).size for qr, kr in zip(q, k)):
            _count(phase, True, sum(t[:, step.kv].numel() * t.element_size() for t in kv))
            return None, None
        _count(phase, False)
        q, k = self._ids(self._device, source, causal)
        return step, (q[:, step.q], k[:, step.kv])


def ring_documents(rows, rank, world, layout, seq_len, device):
    """The RingDocuments of a call, shared by calls with the same documents: a model's layers
    (and their backward) all ask for the same one in a training step."""
    return _cached(tuple(map(tuple, rows)), rank, world, layout, seq_len, device)


@functools.lru_cache(maxsize=8)
def _cached(rows, rank, world, layout, seq_len, device):
    return RingDocuments([list(row) for row in rows], rank, world, layout, seq_len, device)
