"""Agreement of a ring's ranks on everything the ring depends on, checked before the first transfer.

Ranks that disagree on a shape send and receive buffers of different sizes: gloo aborts one rank
while another returns, NCCL hangs or reads past the data. Ranks that disagree on ``causal``,
``layout`` or the scale exchange well-formed blocks and compute a wrong result. So before the
first transfer every rank contributes a small fixed-size signature of its call, all ranks gather
the whole table (an all-gather over the ring group, then one over the head group of what that
gathered: every rank ends with the same U x R table) and every rank raises the same ValueError
for the same first disagreement, naming the argument and two ranks' values.

Cost: the exchange runs once per new (groups, signature); a call whose signature its groups have
agreed on before costs one tuple and one set lookup on the host. The limit of that cache: a rank
whose signature was agreed earlier skips the exchange that a rank with a new one enters, so a
disagreement that appears after a signature was agreed meets the ring's transfers instead of this
check. What differs between ranks of a correct call (their rows) is not in the cache key.

Unsharded input (the full sequence given to every rank) agrees on every shape: each rank simply
claims a global length W times too long. What gives it away is content: the first rows of q are
bit-for-bit the same on every rank although they differ from each other (so not a constant
input). Only the first call of a signature looks (two rows, summed on the device).
"""
import zlib

import torch
import torch.distributed as dist

from ringfa4.ring.layout import LAYOUTS

# Codes for the dtypes a signature carries; anything else is reported by its position past these.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)

# (what the error calls it, how to print a value): the fields every rank must agree on, in the
# order of the signature.
FIELDS = (
    ("ring group size", int),
    ("head_group size", int),
    ("batch (q.shape[0])", int),
    ("local sequence length (q.shape[1])", int),
    ("heads (q.shape[2])", int),
    ("kv heads (k.shape[2])", int),
    ("head_dim (q.shape[3])", int),
    ("dtype", lambda code: str(_DTYPES[int(code)]) if code < len(_DTYPES) else f"other dtype #{int(code)}"),
    ("causal", bool),
    ("layout", lambda code: repr(LAYOUTS[int(code)])),
    ("softmax_scale", float),
    ("deterministic", bool),
    ("requires_grad (any of q, k, v, with grad enabled)", bool),
    ("cu_seqlens (documents in it; 0 without)", int),
    ("cu_seqlens (CRC-32 of its boundaries, and of document_balanced's placement of them)", int),
)
# After the fields: the rank's global rank, then the sum and the sum of squares of q's rows 0 and 1.
_RANK, _PRINT = len(FIELDS), len(FIELDS) + 1
_SIZE = _PRINT + 4

_agreed = {}  # (id(ring group), id(head group)) -> (the groups, kept alive so ids stay theirs; set of keys)


def _dtype_code(dtype):
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + zlib.crc32(str(dtype).encode()) % 1000


def _key(q, k, causal, layout, softmax_scale, deterministic, ring_world, head_world, documents):
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k))
    return (ring_world, head_world, *q.shape[:3], k.shape[2], q.shape[3], _dtype_code(q.dtype), bool(causal),
            LAYOUTS.index(layout), float(softmax_scale), bool(deterministic), grad, *(documents or (0, 0)))


def _fingerprint(q):
    """Sum and sum of squares of q's first two local rows (row 0 twice for a one-row shard), in fp64."""
    rows = q[:, :2].detach().to(torch.float64)
    if rows.shape[1] == 1:
        rows = torch.cat([rows, rows], dim=1)
    rows = rows.transpose(0, 1).reshape(2, -1)
    return torch.stack([rows.sum(1), rows.square().sum(1)], dim=1).flatten()


def _gather(vec, group):
    """(group size, n): every rank's ``vec`` in group-rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return vec[None]
    parts = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(parts, vec, group=group)
    return torch.stack(parts)


def _first_disagreement(table):
    """(field index, row a, row b) of the first field on which two rows differ, or None."""
    for i in range(len(FIELDS)):
        first = table[0][i]
        for row in table[1:]:
            if row[i] != first:
                return i, table[0], row
    return None


def check_table(table):
    """Raise the ValueError every rank raises for this table of signatures (one row per rank)."""
    found = _first_disagreement(table)
    if found is not None:
        i, a, b = found
        name, show = FIELDS[i]
        raise ValueError(f"ring_attention: the ranks disagree on {name}: rank {int(a[_RANK])} has {show(a[i])}, "
                         f"rank {int(b[_RANK])} has {show(b[i])}; every rank of the ring and its head group "
                         f"must pass the same")
    ranks = sorted(int(row[_RANK]) for row in table)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ring_attention: group and head_group must share exactly one rank, the caller "
                         f"(their product must tile U x R distinct ranks); together they hold ranks {ranks}")
    prints = [tuple(row[_PRINT:]) for row in table]
    if len(prints) > 1 and len(set(prints)) == 1 and prints[0][:2] != prints[0][2:]:
        raise ValueError("ring_attention: q holds the same rows on every rank (its first two rows are "
                         "bit-for-bit equal across ranks and differ from each other): every rank must pass "
                         "its own shard of the sequence (ringfa4.shard), not the full sequence")


def check(q, k, causal, layout, softmax_scale, deterministic, group, head_group, documents=None):
    """Raise the same ValueError on every rank of group x head_group unless their calls agree.

    ``head_group`` None is a head group of this rank alone. ``documents``: (count, checksum) of
    cu_seqlens (ringfa4.documents.checksum), None without. Collective over both groups the first
    time a signature is seen; a host-side lookup afterwards.
    """
    ring_world = dist.get_world_size(group)
    head_world = 1 if head_group is None else dist.get_world_size(head_group)
    key = _key(q, k, causal, layout, softmax_scale, deterministic, ring_world, head_world, documents)
    groups = (id(group), id(head_group))
    if key in _agreed.get(groups, ((), ()))[1]:
        return
    header = torch.tensor(key + (dist.get_rank(),), dtype=torch.float64)
    vec = torch.cat([header.to(q.device), _fingerprint(q)])
    table = _gather(vec, group)
    if head_group is not None:
        table = _gather(table.flatten(), head_group)
    check_table(table.reshape(-1, _SIZE).tolist())
    _agreed.setdefault(groups, ((group, head_group), set()))[1].add(key)
