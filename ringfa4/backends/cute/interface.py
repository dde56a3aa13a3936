"""The backend contract (ringfa4.backends) for our CuTe kernels on Hopper: which inputs they
take, and the allocation and launch of the forward and backward.

Arguments arrive checked: ringfa4.api validates them once per call and asks unsupported_reason
once when it chooses the backend, so forward and backward do not check them again (a ring calls
them once per step). What they do check is what only direct callers pass: preallocated outputs,
a forward configuration, a QueryRows of another scale.
"""
import collections
import math
import weakref
from dataclasses import replace
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ringfa4.backends import DqBuffer
from ringfa4.backends.cute.configs import (CLUSTER_SHARES, BwdSm90Config, bwd_defaults, fwd_defaults,
                                           query_tile)
from ringfa4.backends.cute.launch import (capability, compiled, device_index, dq_turn_counters, dsl_installed,
                                          key_tile, num_sms)
from ringfa4.backends.cute.query_rows import (FLAT_MAX, QueryRows, QueryState, padded_rows, postprocess_dq,
                                               query_rows)
from ringfa4.backends.cute.tensors import (DTYPE_NAMES, INPUT_DTYPES, layout_reason, tma_compatible,
                                           tma_ready)

HEAD_DIMS = (64, 128)


def unsupported_reason(q, k, v, causal, grad, doc_ids=None):
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"cute kernels run on CUDA tensors only, got devices {q.device}, {k.device}, {v.device}"
    major, minor = capability(device_index(q))
    if (major, minor) != (9, 0):
        return f"cute kernels are built for Hopper (sm_90), this GPU is sm_{major}{minor}"
    if q.dtype not in INPUT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"cute kernels take bfloat16 or float16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (batch, seq, heads, head_dim)"
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"cute kernels support head_dim in {HEAD_DIMS} (same for q, k, v), got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
    if causal and q.shape[1] != k.shape[1]:
        return f"cute causal attention needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = layout_reason(name, t)
        if reason:
            return reason
    if not dsl_installed():
        return "nvidia-cutlass-dsl is not installed"
    return None


def _scale(softmax_scale, head_dim):
    return head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)


def _sms(t):
    """SMs of the GPU holding ``t``."""
    return num_sms(device_index(t))


def _check_given(name, t, shape, dtype, device):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def _forward_outputs(q, out, lse):
    """(out, lse) to write: the given ones, checked, or new ones."""
    b, sq, h, _ = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_given("out", out, q.shape, q.dtype, q.device)
        reason = layout_reason("out", out)
        if reason:
            raise ValueError(reason)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    else:
        _check_given("lse", lse, (b, h, sq), torch.float32, q.device)
        if lse.stride(-1) != 1:
            raise ValueError(f"lse must have a contiguous last dimension, got strides {lse.stride()}")
    return out, lse


def _tight(lo, hi, tile):
    """lo, hi (int (b, n) nondecreasing ranges, one per row) with every empty row's range moved
    inside its tile's: a tile visits from its first row's lo to its last row's hi, so an empty
    row (a query or key of a ring step whose document the other side does not hold) must not
    widen that hull over rows of other documents; empty, it sees nothing wherever it sits. It
    takes the hi of the tile's last row before it that is not empty, else the lo of the first
    after it; both ends stay nondecreasing."""
    b, n = lo.shape
    pad = -n % tile
    empty = torch.nn.functional.pad(lo == hi, (0, pad), value=True).view(b, -1, tile)
    lo_t, hi_t = (torch.nn.functional.pad(t, (0, pad)).view(b, -1, tile) for t in (lo, hi))
    none = torch.iinfo(lo.dtype).max
    before = torch.where(empty, -1, hi_t).cummax(dim=2).values
    after = torch.where(empty, none, lo_t).flip(2).cummin(dim=2).values.flip(2)
    at = torch.where(before >= 0, before, after)
    moved = empty & (at != none)
    return tuple(torch.where(moved, at, t).view(b, -1)[:, :n] for t in (lo_t, hi_t))


_derived = WeakIdKeyDictionary()  # q_ids -> {(what, k_ids' id, ...): (weakref to k_ids, tensors)}


def _once(doc_ids, what, compute):
    """compute() for these doc_ids and ``what``, once while both id tensors live: a ring passes
    the same ids objects to every layer's step and its backward (ringfa4.ring.documents), so the
    ranges a step's kernels read are derived once, not per call (ids are never written). Under
    CUDA graph capture (_capturing) a value made before is held for the graph (_held), and one
    made now is not kept."""
    capturing = _capturing(doc_ids[0].device)
    value = _cached(doc_ids, what)
    if value is not None:
        return _held(value) if capturing else value
    value = compute()
    if not capturing:
        q_ids, k_ids = doc_ids
        _derived.setdefault(q_ids, {})[(what, id(k_ids))] = (weakref.ref(k_ids), value)
    return value


def _cached(doc_ids, what):
    """What _once keeps for these doc_ids and ``what``, or None."""
    q_ids, k_ids = doc_ids
    entry = _derived.get(q_ids, {}).get((what, id(k_ids)))
    return entry[1] if entry is not None and entry[0]() is k_ids else None


def _capturing(device):
    """Whether ``device``'s current stream is being captured into a CUDA graph. What is computed
    then is computed by the graph's kernels, at each replay: its values do not exist before the
    first replay, so an eager call must not find it cached."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


_graph_held = []  # what captured graphs read that was made before their capture


def _held(value):
    """``value`` (made eagerly, read by a graph being captured) kept for good: a graph reads its
    memory at every replay, after any cache that made it has let it go."""
    _graph_held.append(value)
    return value


def visible_keys(doc_ids, tile_m):
    """Each query's visible keys [key_lo, key_hi) (int32 (b, sq) each) from doc_ids = (q_ids,
    k_ids): the keys of its document, contiguous since the ids are nondecreasing; rows that see
    nothing kept inside the range of their ``tile_m``-row query tile (_tight). Computed on the
    GPU (no host sync); what the kernels' document masks read."""
    def compute():
        q_ids, k_ids = (t.contiguous() for t in doc_ids)
        return _tight(*(torch.searchsorted(k_ids, q_ids, side=side, out_int32=True) for side in ("left", "right")),
                      tile_m)
    return _once(doc_ids, ("keys", tile_m), compute)


def visible_blocks(doc_ids, causal, tile_m):
    """What the backward kernel reads of doc_ids, all int32 on the GPU (no host sync): each
    key's visible queries [query_lo, query_hi) (b, sk) each: its document's, causal from the key
    on, empty keys' ranges kept inside their K/V block's (_tight); per K/V block the query tiles
    [first, end) its keys' documents reach (b, kv blocks, 2); per query tile the first and last
    K/V block reaching it (b, query tiles, 2), the blocks whose dQ reductions a deterministic
    run orders. Both ends of a key's range are nondecreasing along the keys, so a block reaches
    the queries from its first key's lo to its last key's hi, and the blocks reaching a tile
    are one run."""
    def compute():
        tile_n = key_tile()
        q_ids, k_ids = (t.contiguous() for t in doc_ids)
        b, sq, sk = q_ids.shape[0], q_ids.shape[1], k_ids.shape[1]
        lo, hi = _tight(*(torch.searchsorted(q_ids, k_ids, side=side) for side in ("left", "right")), tile_n)
        if causal:
            lo = torch.maximum(lo, torch.arange(sk, device=q_ids.device))
        first_key = torch.arange(0, sk, tile_n, device=q_ids.device)
        last_key = (first_key + tile_n).clamp(max=sk) - 1
        block_lo, block_hi = lo[:, first_key], hi[:, last_key]
        m_first, m_end = block_lo // tile_m, (torch.maximum(block_hi, block_lo) + tile_m - 1) // tile_m
        tiles = torch.arange((sq + tile_m - 1) // tile_m, device=q_ids.device).expand(b, -1).contiguous()
        first_block = torch.searchsorted(m_end.contiguous(), tiles, side="right")
        last_block = torch.searchsorted(m_first.contiguous(), tiles, side="right") - 1
        return (lo.int(), hi.int(), torch.stack((m_first, m_end), -1).int(),
                torch.stack((first_block, last_block), -1).int())
    return _once(doc_ids, ("blocks", causal, tile_m), compute)


def launch_order(doc_ids, causal, tile_m, kv_slots):
    """The backward's launch order with documents (doc_order; int32 (b, kv_slots * kv blocks) on
    the GPU, no host sync): CTA i runs the (kv slot, KV block) order[:, i] = slot * kv blocks +
    block. Blocks go by the document of their first key, the document whose walk is longest
    first, every kv slot of a document before the next, a document's blocks in order."""
    def compute():
        query_blocks = visible_blocks(doc_ids, causal, tile_m)[2]
        walk = (query_blocks[..., 1] - query_blocks[..., 0]).long()
        b, n = walk.shape
        doc = doc_ids[1][:, ::key_tile()].contiguous()
        first_block = torch.searchsorted(doc, doc)  # the first block of each block's document
        longest = torch.zeros_like(walk).scatter_reduce(1, first_block, walk, "amax")
        place = (query_blocks[..., 1].amax() + 1 - longest.gather(1, first_block)) * n + first_block
        slot = torch.arange(kv_slots, device=walk.device)[None, :, None]
        block = torch.arange(n, device=walk.device)
        key = ((place[:, None, :] * kv_slots + slot) * n + block).view(b, -1)
        return torch.argsort(key, dim=1).int()
    return _once(doc_ids, ("order", causal, tile_m, kv_slots), compute)


def _walks(doc_ids, config, batch, seqlen_q, seqlen_k, device):
    """Key blocks each query block of the forward visits (int64 (batch, blocks)): fwd_sm90's
    n_blocks, or with documents its doc_blocks."""
    tile_pos, tile_n = config.tile_m // config.pack_gqa, config.tile_n
    first = torch.arange(0, seqlen_q, tile_pos, device=device)
    last = (first + tile_pos).clamp(max=seqlen_q) - 1
    if doc_ids is None:
        hi = torch.clamp(last + 1, max=seqlen_k) if config.causal else torch.full_like(last, seqlen_k)
        return ((hi + tile_n - 1) // tile_n).expand(batch, -1)
    key_lo, key_hi = visible_keys(doc_ids, tile_pos)
    lo, hi = key_lo[:, first].long(), key_hi[:, last].long()
    if config.causal:
        hi = torch.minimum(hi, last + 1)
    n_lo = lo.clamp(max=seqlen_k - 1) // tile_n
    return torch.maximum((hi + tile_n - 1) // tile_n, n_lo + 1) - n_lo


def _dealt(walk, config, heads, reach, grid):
    """tile_order's order of tiles whose query blocks visit ``walk`` key blocks, none of them
    farther than ``reach`` keys apart (the key length, or the longest document)."""
    from ringfa4.kernels.tile_scheduler import L2_BUDGET  # the kernel's LPT groups (imports the DSL)

    blocks, bh = walk.shape[1], walk.shape[0] * heads
    kv_bytes = reach * config.head_dim * 2 * 2  # the K and V of a head that its walks read, 16-bit
    group = max(1, min(bh, L2_BUDGET // kv_bytes))
    raster = torch.arange(bh * blocks, device=walk.device).view(bh, blocks).flip(1)  # query blocks last first
    length = walk.flip(1).repeat_interleave(heads, dim=0)
    pad_bh = -bh % group  # the last group may be short: its rows of -1 are dropped below
    raster, length = (torch.nn.functional.pad(t, (0, 0, 0, pad_bh), value=-1)
                      .view(-1, group, blocks).transpose(1, 2).flatten() for t in (raster, length))
    keep = raster >= 0
    raster, length = raster[keep], length[keep]
    n = raster.numel()
    pad = -n % (2 * grid)
    length = torch.nn.functional.pad(length, (0, pad), value=-1).view(-1, 2 * grid)
    raster = torch.nn.functional.pad(raster, (0, pad), value=-1).view(-1, 2 * grid)
    ranked = torch.argsort(length, dim=1, descending=True, stable=True)
    length, raster = (torch.gather(t, 1, ranked).view(-1, grid) for t in (length, raster))
    order = torch.empty_like(raster)
    load = torch.zeros(grid, dtype=torch.long, device=walk.device)
    rounds = -(-n // grid)
    for r in range(rounds):
        ctas = grid if r + 1 < rounds else n - r * grid  # the last round: positions c < its tiles only
        least = torch.argsort(load[:ctas])
        order[r, least] = raster[r, :ctas]
        load[least] += length[r, :ctas]
    return order.flatten()[:n].int()


# Orders without documents, by shape, the most recently used DENSE_ORDERS (a few KB each; one
# per sequence length where lengths vary).
DENSE_ORDERS = 64
_dense_orders = collections.OrderedDict()


def tile_order(config, batch, seqlen_q, seqlen_k, heads, grid, device, doc_ids=None):
    """The forward's tile order for persistent CTAs (config.tile_order; int32 (tiles,) on the
    GPU, no host sync): position i runs the tile of raster id order[i] (query block + blocks x
    (batch x heads + head), as the kernel decodes it). A static share of the kernel's own order
    (CTA c: every grid-th tile from c) is even only where neighbouring tiles walk alike; with
    documents a tile's key blocks depend on where its rows' documents start, not on its
    position, and that share leaves persistent CTAs 2-9% apart. Base order: the kernel's LPT
    order (heads in groups whose K/V fits L2 together, a group's query blocks last first, its
    heads fastest; within a document its longest walks first). With documents a head's walks
    read the K/V of its longest document at most, so the groups hold more heads: at 128k tokens
    of 4k-token documents (longest 15-16k) 4 heads instead of 1, the query heads of a kv head
    together, which read each document's K/V from DRAM once instead of 4 times: forward
    1.031-1.044x (H100, 32/8, hdim 128, two seeds x two runs; 32k: 0.98-1.00x, within the A/A
    spread; bench/RESULTS.md 2026-11-27 XI). It is cut into windows of 2 x
    ``grid`` tiles (nearby tiles: nearby K/V in L2), each sorted by key blocks, longest first,
    and dealt in rounds of ``grid``: a CTA takes one tile per round (positions c, c + grid, ...),
    the round's longest going to the CTA with the fewest key blocks so far. Made once per ids
    object with documents, once per shape without (of the DENSE_ORDERS shapes used last). None
    where it is not made yet and the stream is being captured into a CUDA graph (making it reads
    sizes back from the GPU, which capture forbids): the caller then runs the launch order,
    which gives the same bits."""
    what = ("tile_order", config, heads, grid)
    key = (config, batch, seqlen_q, seqlen_k, heads, grid, device)
    if _capturing(device):
        order = _dense_orders.get(key) if doc_ids is None else _cached(doc_ids, what)
        return None if order is None else _held(order)
    longest = getattr(doc_ids, "longest", None)
    reach = seqlen_k if longest is None else min(seqlen_k, longest)
    make = lambda: _dealt(_walks(doc_ids, config, batch, seqlen_q, seqlen_k, device),  # noqa: E731
                          config, heads, reach, grid)
    if doc_ids is not None:
        return _once(doc_ids, what, make)
    order = _dense_orders.get(key)
    if order is None:
        order = _dense_orders[key] = make()
        if len(_dense_orders) > DENSE_ORDERS:
            _dense_orders.popitem(last=False)
    _dense_orders.move_to_end(key)
    return order


def forward_config(q, k, causal, doc_ids=None):
    """The forward's kernel configuration for these inputs (configs.fwd_defaults)."""
    return fwd_defaults(DTYPE_NAMES[q.dtype], q.shape[-1], bool(causal), doc_ids is not None, k.shape[1],
                        q.shape[2] // k.shape[2], getattr(doc_ids, "longest", None))


def forward(q, k, v, causal, softmax_scale, out=None, lse=None, config=None, doc_ids=None):
    """(out, lse). ``out`` (like q) and ``lse`` (float32, (b, h, sq), contiguous last dim) may be
    given preallocated; they are then written and returned. ``config`` (a
    ringfa4.backends.cute.configs.FwdSm90Config for these dtype/head_dim/causal/documents)
    replaces the default kernel configuration, for benchmarks and tests of the technique
    switches. ``doc_ids``: packed documents (ringfa4.backends), the has_docs variant."""
    d, heads_per_kv = q.shape[-1], q.shape[2] // k.shape[2]
    out, lse = _forward_outputs(q, out, lse)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys at all: every row is fully masked
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    has_docs = doc_ids is not None
    if config is None:
        config = forward_config(q, k, causal, doc_ids)
    elif ((config.dtype, config.head_dim, config.causal, config.has_docs)
          != (DTYPE_NAMES[q.dtype], d, causal, has_docs) or config.pack_gqa not in (1, heads_per_kv)):
        raise ValueError(f"config {config.name} does not match dtype={q.dtype}, head_dim={d}, "
                         f"causal={causal}, documents={has_docs}, pack_gqa 1 or {heads_per_kv} "
                         f"(query heads per kv head)")
    key_lo, key_hi = (visible_keys(doc_ids, config.tile_m // config.pack_gqa) if has_docs
                      else (None, None))
    order = None
    if config.tile_order:
        heads = q.shape[2] // config.pack_gqa  # the kernel's: kv heads when packed
        tiles = q.shape[0] * heads * -(-q.shape[1] * config.pack_gqa // config.tile_m)
        grid = min(tiles, _sms(q)) if config.persistent else tiles
        order = tile_order(config, q.shape[0], q.shape[1], k.shape[1], heads, grid, q.device, doc_ids)
        if order is None:
            config = replace(config, persistent=False, tile_order=False)
    compiled(config)(q.detach(), k.detach(), v.detach(), out.detach(), lse, key_lo, key_hi, order,
                     _scale(softmax_scale, d), _sms(q))
    return out, lse


# Causal keys, by head_dim, from which deterministic GQA takes one query head per backward CTA
# (head_splits).
DETERMINISTIC_SPLIT_KEYS = {64: 16384, 128: 2048}
# Causal keys up to which deterministic GQA at head dim 128 takes two query heads per CTA
# instead of one where the grid is then still DETERMINISTIC_PAIR_WAVES waves deep: half the
# fp32 dK/dV shares, and walks short enough (H200, 32/8: b 16 x 2k 1.06-1.09x, b 8 x 4k
# 1.03-1.04x; with one sequence of 2k-4k 0.91-0.95x, at 16k-32k 0.95-0.99x; RESULTS 2026-11-28 IV).
DETERMINISTIC_PAIR_KEYS = 4096
DETERMINISTIC_PAIR_WAVES = 16
# Causal keys from which the default backward at head dim 128 takes one query head per CTA, so
# that the CTAs running at once read one query head's Q, dO and dQ from L2 (head_splits).
L2_SPLIT_KEYS = 65536
# The same for causal documents, by the longest one's rows (DocIds.longest): one query head per
# CTA ran 1.02-1.03x with documents of 32k-115k tokens and 0.96x with 4k-token ones (16k the
# longest; H100, 32/8, RESULTS 2026-11-27 IX). The document launch order (doc_order) gains at
# 32k already, where the dense grid order does not.
DOC_L2_SPLIT_KEYS = 32768


def head_splits(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, deterministic, sms,
                has_docs=False, longest=None):
    """How many backward CTAs share the query heads of one (K/V block, kv head) (GQA).

    One CTA walking every query head of its group needs no dK/dV reduction, but with few K/V
    blocks that grid leaves SMs idle (non-causal) or ends on its longest causal blocks (a block
    near the start of the sequence is visited by every query tile of every head of the group).
    The group is halved while that is so: non-causal while half the SMs would still idle,
    causal while the longest CTA holds more than half an SM's even share. Shares sum dK/dV by
    fp32 reduce-adds, whose order varies. Where the causal grid launches longest walks first
    (launches_lpt) at head dim 64, the longest CTA may hold the whole even share: with 32/8 heads
    at one sequence of 4k / 8k keys, 2 shares ran 0.86-0.87x / 0.92-0.94x of none (two runs),
    and at 2k 2 shares 1.07x of 4 (H100; at head dim 128 the half-share rule still picked the
    fastest split but at 2k, RESULTS 2026-11-26 night).

    Deterministic mode orders each dQ tile's reductions over the K/V blocks, and the shares'
    dK/dV reduce-adds by query head (causal pairs written in dtype sum in a cluster instead,
    CLUSTER_SHARES). Causal, a group of 4 heads per CTA ran at 0.69-0.73x of the
    default at 2k-4k keys and 0.57-0.64x at 8k-32k with hdim 128 (H100, 32/8 heads), against
    0.84-0.95x with one head per CTA; with hdim 64 unsplit stays ahead up to 8k (0.94-0.99x against
    0.67-0.96x) and falls behind from 16k (0.89x against 0.92x; 0.66x against 0.96x at 32k). So
    from DETERMINISTIC_SPLIT_KEYS[head_dim] causal keys on, and where the default splits, it takes
    one query head per CTA; non-causal (rotated walks) it does not split (0.87-0.93x against
    0.73-0.89x). At head dim 128 up to DETERMINISTIC_PAIR_KEYS keys, where the grid stays
    DETERMINISTIC_PAIR_WAVES deep, two query heads per CTA halve the dK/dV shares.

    Long causal sequences at head dim 128 (from L2_SPLIT_KEYS keys): a CTA walking its group's
    query heads one after the other sets the CTAs running at once on every head of the group at
    different places, and their Q, dO and dQ no longer fit in L2. One query head per CTA, as
    upstream FA4 does, cuts the kernel's DRAM traffic at b 1 x 64k, 32/8 from 61.5 / 34.4 GB read
    / written to 7.9 / 4.5 GB (ncu; FA4 7.9 / 4.5) and runs 1.02-1.05x at 64k keys, ~1.01x at
    128k, no faster at 32k (H100, sustained turns, each contender twice; RESULTS 2026-11-26 night
    III). Head dim 64 reads 3 GB either way.

    With documents a K/V block walks only the query tiles its documents reach, so the blocks'
    walks differ widely and the longest sets the kernel's time: non-causal calls (a ring's remote
    steps) give every query head a CTA. On the simulated 8-rank document ring (128k tokens, 4k
    documents, H200) the slowest rank went 16.7 -> 14.2 ms; dense non-causal steps run 5-20%
    slower split, so they keep the rule above. Causal documents at head dim 128 take one query
    head per CTA where the longest (``longest`` rows; None: not known) reaches DOC_L2_SPLIT_KEYS."""
    group = heads // kv_heads
    tile_m, tile_n = query_tile(head_dim), key_tile()
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    ctas = n_blocks * kv_heads * batch
    # causal: K/V block j is visited by the query tiles from j * tile_n / tile_m on
    per_head = (n_blocks * m_blocks - tile_n / tile_m * n_blocks * (n_blocks - 1) / 2 if causal
                else n_blocks * m_blocks)
    even_share = per_head * group * kv_heads * batch / sms

    def halvings(longest_bound):
        splits = 1
        while splits * 2 <= group and group % (splits * 2) == 0:
            if causal and m_blocks * group / splits <= longest_bound:
                break
            if not causal and ctas * splits * 2 > sms:
                break
            splits *= 2
        return splits

    splits = halvings(even_share / 2)
    if deterministic:
        if not causal or (splits == 1 and seqlen_k < DETERMINISTIC_SPLIT_KEYS[head_dim]):
            return 1
        if (head_dim == 128 and group % 2 == 0 and seqlen_k <= DETERMINISTIC_PAIR_KEYS
                and ctas * 2 >= DETERMINISTIC_PAIR_WAVES * sms):
            return 2
        return group
    if has_docs and not causal:
        return group
    long_walks = (longest or 0) >= DOC_L2_SPLIT_KEYS if has_docs else seqlen_k >= L2_SPLIT_KEYS
    if causal and head_dim == 128 and long_walks:
        return group
    if head_dim == 64 and launches_lpt(batch, seqlen_q, heads, head_dim, causal, deterministic, has_docs):
        return halvings(even_share)
    return splits


# Rotated groups per row of the deterministic backward at most. H200 (bench/RESULTS.md, "Rotation in
# groups"): two groups ran 1.00-1.06x the unrotated walks at 16k keys, four 0.90-1.00x at 32k.
MAX_ROTATION_GROUPS = 2


def rotation_group(seqlen_k, causal, deterministic, sms, in_groups):
    """K/V blocks per rotated group of the deterministic backward's walks (ringfa4.kernels.bwd_sm90;
    0: not rotated). A rotated CTA waits on CTAs of its group launched after it, so a group is
    at most half the SMs (the other half left to whatever runs beside the kernel: the ring's
    NCCL kernels, say): every K/V block of a row where they fit, else, where the kernel rotates
    in groups (``in_groups``: BwdSm90Config.rotate_groups), equal groups that do, up to
    MAX_ROTATION_GROUPS."""
    if not deterministic or causal:
        return 0
    blocks, most = -(-seqlen_k // key_tile()), sms // 2
    if blocks <= most:
        return blocks
    groups = -(-blocks // most)
    if not in_groups or groups > MAX_ROTATION_GROUPS:
        return 0
    return -(-blocks // groups)


# The causal backward launches each batch row longest walk first (lpt) up to this many query
# elements (b x sq x h x d; 64 MiB of bf16 q): measured on H100 (RESULTS 2026-11-26 night), 1.01-1.32x
# the grid's order at every shape up to it (one or two rows of 1k-8k keys at hdim 128, four at
# hdim 64), 0.92-0.99x at twice it (16k keys, or four rows of 4k at hdim 128), where the tail is
# short against the whole and the longest-first CTAs, spread over every kv head, share less of L2.
LPT_MAX_Q_ELEMENTS = 1 << 25


def launches_lpt(batch, seqlen_q, heads, head_dim, causal, deterministic, has_docs):
    """Whether the default causal backward launches each batch row longest walk first
    (ringfa4.kernels.bwd_sm90), so that the last kv head's longest walk does not start late and
    end alone. Deterministic mode keeps its own order (its waits rely on it), documents theirs."""
    return (causal and not deterministic and not has_docs
            and batch * seqlen_q * heads * head_dim <= LPT_MAX_Q_ELEMENTS)


def _added(given, fresh):
    """fresh, or given += fresh (returned) when a buffer was given."""
    return fresh if given is None else given.add_(fresh)


class _BackwardPlan(NamedTuple):
    splits: int  # head_splits
    sums: bool  # the shares add into fp32 sums of the call's own, cast to dtype after
    config: BwdSm90Config
    rotation: int  # rotation_group
    lpt: int  # launches_lpt, as the kernel's flag


def _backward_plan(dtype, b, sq, sk, h, hk, d, causal, deterministic, sms, has_docs, longest, given_fp32):
    """The backward's choices for these inputs, before anything is allocated. ``given_fp32``:
    the caller's dk/dv are fp32 buffers the kernel can address (it adds into them). Not cached:
    tests replace what it reads (CLUSTER_SHARES, bwd_defaults, launches_lpt) to run other
    variants, and it costs a few microseconds."""
    splits = head_splits(b, sq, sk, h, hk, d, causal, deterministic, sms, has_docs, longest)
    # Split shares sum dK/dV into the caller's fp32 buffers, or in fp32 sums of the call's own
    # (deterministic: in a fixed order), or, deterministic and causal, in clusters of the shares.
    cluster = deterministic and causal and not has_docs and splits in CLUSTER_SHARES and not given_fp32
    sums = splits > 1 and not (cluster or given_fp32)
    config = bwd_defaults(dtype, d, causal, deterministic, given_fp32 or sums, has_docs, sk % key_tile() == 0, sk)
    if cluster:
        config = replace(config, cluster_shares=splits)
    return _BackwardPlan(splits, sums, config, rotation_group(sk, causal, deterministic, sms, config.rotate_groups),
                         int(launches_lpt(b, sq, h, d, causal, deterministic, has_docs)))


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False, doc_ids=None, doc_order=None):
    """Gradients of attention with the softmax normalised by the given lse. Given dq/dk/dv
    receive the gradients added to what they hold (fp32 dk/dv by the kernel itself; dq by the
    postprocess that reads the kernel's accumulator). dq may also be the QueryRows of these
    queries (query_state): the kernel then adds into its accumulator and uses its lse2 and
    delta (lse and out are not read again) and returns it as dq. ``doc_ids``: packed documents
    (ringfa4.backends), the has_docs variant; K/V blocks no query sees get dK = dV = 0.
    ``doc_order`` replaces the default launch order with documents (configs.bwd_defaults), for
    benchmarks and tests."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = _scale(softmax_scale, d)
    if min(b, sq, sk) == 0:  # nothing to launch: no query sees a key, every gradient is zero
        return tuple(_added(buf, torch.zeros_like(t)) for buf, t in ((dq, q), (dk, k), (dv, v)))
    dout = tma_ready(dout)
    given_fp32 = all(t is not None and t.dtype == torch.float32 and tma_compatible(t) for t in (dk, dv))
    plan = _backward_plan(DTYPE_NAMES[q.dtype], b, sq, sk, h, hk, d, bool(causal), bool(deterministic), _sms(q),
                          doc_ids is not None, getattr(doc_ids, "longest", None), given_fp32)
    config = plan.config if doc_order is None else replace(plan.config, doc_order=doc_order)
    # Deterministic without documents, every dQ tile and every (K/V block, kv head) has a first
    # turn: into buffers of this call's own it stores (the kernel's dq_fresh and dkv_fresh), so
    # they need no zeroing.
    first_turns = deterministic and doc_ids is None
    dq_fresh = first_turns and not isinstance(dq, QueryRows)
    sums_shape = (2, *k.shape) if plan.sums else None
    # Deterministic: turn counters ordering the dQ tiles' and the dK/dV blocks' reductions.
    tile_m, kv_turns = query_tile(d), config.cluster_shares == 1
    n_q = padded_rows(sq, tile_m) // tile_m * dq_turn_counters(config.dq_warp_per_part) if deterministic else 0
    n_n = -(-sk // key_tile()) if deterministic and kv_turns else 0
    n_counters = b * (h * n_q + hk * n_n)
    if isinstance(dq, QueryRows):
        if dq.softmax_scale != scale:
            raise ValueError(f"softmax_scale ({scale}) must be the one of dq's QueryState "
                             f"({dq.softmax_scale})")
        rows = dq
        sums = ((torch.empty if first_turns else torch.zeros)(sums_shape, dtype=torch.float32, device=k.device)
                if plan.sums else None)
        counters = torch.zeros(n_counters, dtype=torch.int32, device=q.device) if deterministic else None
    else:
        rows, sums, counters = query_rows(dout, out, lse, scale, zeroed=not dq_fresh, sums_shape=sums_shape,
                                          counters=n_counters)
    if given_fp32:
        dk_out, dv_out = dk, dv
    elif plan.sums:
        dk_out, dv_out = sums.unbind(0)
    else:
        dk_out, dv_out = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    sems = (None, None)
    if deterministic:
        sems = (counters[:b * h * n_q].view(b, h, n_q), counters[b * h * n_q:].view(b, hk, n_n) if n_n else None)
    docs = (None,) * 5
    if doc_ids is not None:
        order = launch_order(doc_ids, causal, tile_m, hk * plan.splits) if config.doc_order else None
        docs = (*visible_blocks(doc_ids, causal, tile_m), order)
    compiled(config)(q.detach(), k.detach(), v.detach(), dout, rows.lse2, rows.delta, rows.dq_acc,
                     dk_out, dv_out, sems[0], *docs, sems[1], scale, plan.splits, plan.rotation, plan.lpt,
                     int(dq_fresh), int(first_turns and plan.sums))

    # The split shares' sums become new dk, dv in dtype (two tensors: an operator's results may
    # not alias), written by the postprocess where it writes a new dq, else cast here.
    new_dkv = plan.sums and dk is None and dv is None
    if rows is not dq:  # dq <- (or +=) the accumulator; a dq it cannot address gets a fresh one added
        add = dq is not None and tma_compatible(dq)
        dq_out = dq if add else torch.empty_like(q, memory_format=torch.contiguous_format)
        if new_dkv and not add and sums.numel() <= FLAT_MAX:
            dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
            postprocess_dq(rows, dq_out, add, sums.view(-1), dk.view(-1), dv.view(-1))
        else:
            postprocess_dq(rows, dq_out, add)
        dq = dq_out if add else _added(dq, dq_out)
    if new_dkv and dk is None:
        dk, dv = (t.to(k.dtype) for t in sums.unbind(0))
    elif not new_dkv and dk_out is not dk:
        dk, dv = (_added(given, fresh if given is not None else fresh.to(t.dtype))
                  for given, fresh, t in ((dk, dk_out, k), (dv, dv_out, v)))
    return dq, dk, dv


def query_state(dout, q, out, lse, softmax_scale, chunk, deterministic):
    """The backward kernel's QueryState when the steps' rows start on its query tiles (chunks of
    whole tiles, or every step over all rows; either mode runs the same tiles), else DqBuffer."""
    s, d = q.shape[1], q.shape[-1]
    if chunk >= s or chunk % query_tile(d) == 0:
        return QueryState(dout, q, out, lse, _scale(softmax_scale, d))
    return DqBuffer(q, lse)
