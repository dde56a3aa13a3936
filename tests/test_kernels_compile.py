"""The CuTe kernels compile for Hopper on a machine without a GPU, and the cute backend names
what it cannot run (ringfa4.api raises it; tests/test_bad_input.py).

The 108 shipped attention variants (52 with documents) take ~5 min to compile on 2
cores (the 14 backward pre- and postprocess variants a few seconds), so CI compiles a
representative subset (SUBSET, ~1.5 min): every forward variant, with and without documents,
and one backward variant per (head_dim, causal) in bf16 with and without documents, plus the
deterministic fp32-add backward with documents.
`python -m ringfa4.kernels --dump DIR` compiles them all."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import ringfa4.backends.cute as cute_backend
from ringfa4.backends.cute.configs import (VARIANTS, DqPostprocessConfig, MergeConfig, fwd_defaults,
                                           fwd_variant)


SUBSET = (r"^fwd_sm90_|^bwd_sm90_bf16_d(64_m128|128_m64)_(full|causal)_atomic_dkvstore(_docs_docorder|_wholekeys)?"
          r"_stagger(_dqwarp2)?$|^bwd_sm90_bf16_d128_m64_causal_det_dkvadd32_docs_stagger_dqwarp2$"
          r"|^bwd_sm90_bf16_d128_m64_full_det_dkvstore_stagger_dqwarp2$")


def test_dump_cli_writes_ptx_with_wgmma_and_tma_for_shipped_variants(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    run = subprocess.run(
        [sys.executable, "-m", "ringfa4.kernels", "--arch", "sm_90a", "--dump", str(tmp_path),
         "--only", SUBSET],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    chosen = [v for v in VARIANTS if re.search(SUBSET, v.name)]
    # 2 dtypes x 2 head dims x causal or not, long and short walks (causal; d128 not causal: 128-
    # and 160-key blocks), d64 also packed GQA
    assert sum(v.name.startswith("fwd_") for v in chosen) == 44
    assert sum(v.name.startswith("fwd_") and "_docs" in v.name for v in chosen) == 22
    # causal short walks: persistent in the host's order (d128; d64 unpacked and packed)
    assert sum(v.name.startswith("fwd_") and v.name.endswith("_order") for v in chosen) == 12
    assert sum(v.name.startswith("fwd_") and v.name.endswith("_docs_order") for v in chosen) == 6
    assert sum(v.name.startswith("fwd_") and "_gqa4" in v.name for v in chosen) == 12
    # d64 and d128 x causal or not, without and with documents; 2 deterministic;
    # d128 not causal without key mask (keys in whole K/V blocks)
    assert sum(v.name.startswith("bwd_") for v in chosen) == 11
    assert sum(v.name.startswith("bwd_") and "_docs" in v.name for v in chosen) == 5
    # the warp groups staggered in every mode
    assert sum(v.name.startswith("bwd_") and "_stagger" in v.name for v in chosen) == 11
    # a dQ warp per warp group's part: deterministic, and d128 not causal
    assert sum(v.name.startswith("bwd_") and v.name.endswith("_dqwarp2") for v in chosen) == 5
    assert sum(v.name.startswith("bwd_") and "_wholekeys" in v.name for v in chosen) == 1
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == len(chosen)
    if shutil.which("ptxas"):
        # No warp role outgrows its setmaxnreg budget (8 bytes of spills once cost the
        # deterministic backward 3-7% at head dim 128).
        assert [line for line in lines if not line.endswith("spills=0/0 B")] == []
    for variant in chosen:
        ptx = (tmp_path / f"{variant.name}.ptx").read_text()
        assert ".target sm_90a" in ptx, variant.name
        assert "wgmma.mma_async" in ptx, variant.name
        assert "cp.async.bulk.tensor" in ptx, variant.name
        assert "setmaxnreg" in ptx, variant.name
        # Every pair of fp32 values is rounded to 16 bits once, however many readers it has
        # (dS has two: its shared-memory store and the dK product).
        pairs = re.findall(r"cvt\.rn\.b?f16x2\.f32\s+%r\d+,\s*(%r\d+),\s*(%r\d+);", ptx)
        assert pairs and len(pairs) == len(set(pairs)), f"{variant.name}: a pair is converted twice"
        if variant.name.startswith("bwd_"):
            # The only shared-memory loads are the rows' lse and delta, 16 bytes at a time
            # (ringfa4.kernels.stats_layout).
            assert set(re.findall(r"\bld\.shared[.\w]*", ptx)) == {"ld.shared.v4.b32"}, variant.name


@pytest.mark.parametrize("dtype,add", [("bf16", False), ("fp16", False), ("fp32", True),
                                       ("bf16", True)])
@pytest.mark.parametrize("head_dim,tile_m", [(64, 128), (128, 64)])
def test_dq_postprocess_moves_16_bytes_per_access(dtype, add, head_dim, tile_m, tmp_path):
    """The backward's dQ postprocess reads the kernel's accumulator and writes (or adds into) dq
    with 16-byte accesses only: per thread, 2 runs of 64 bytes in, 2 x 2 row pieces of 8 values
    out."""
    from ringfa4.backends.cute.compile import compile_variant

    config = DqPostprocessConfig(dtype, head_dim, tile_m, add)
    ptx = compile_variant(config, options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    assert ".target sm_90a" in ptx
    per_piece = {"bf16": 1, "fp16": 1, "fp32": 2}[dtype]  # 16-byte accesses per 8 values of dq
    assert all(".v4" in match.group(0) for match in re.finditer(r"\b(ld|st)\.global[.\w]*", ptx))
    assert len(re.findall(r"\bld\.global", ptx)) == 8 + (4 * per_piece if add else 0)
    assert len(re.findall(r"\bst\.global", ptx)) == 4 * per_piece


@pytest.mark.parametrize("out_dtype,part_dtype", [("bf16", "bf16"), ("fp32", "bf16")])
def test_ring_merge_reads_and_writes_each_element_once_in_16_byte_accesses(out_dtype, part_dtype, tmp_path):
    """Per thread: 8 values of out and of the partial in, 8 of out back, lse and the partial's
    lse read once, the merged lse written once after the block barrier."""
    from ringfa4.backends.cute.compile import compile_variant

    ptx = compile_variant(MergeConfig(out_dtype, part_dtype, 128),
                          options=f"--keep-ptx --dump-dir {tmp_path}").__ptx__
    per_out = {"bf16": 1, "fp32": 2}[out_dtype]
    wide = re.findall(r"\b(ld|st)\.global\.v4", ptx)
    assert wide.count("ld") == per_out + 1 and wide.count("st") == per_out
    assert len(re.findall(r"\bld\.global\.b32", ptx)) == 2 and len(re.findall(r"\bst\.global\.b32", ptx)) == 1
    assert ptx.index("bar.sync") < ptx.index("st.global.b32")


def _qkv(device="cpu", dtype=torch.bfloat16, d=128, sq=16, sk=16):
    return (torch.randn(1, s, 2, d, device=device, dtype=dtype) for s in (sq, sk, sk))


def test_cute_backend_names_the_missing_gpu():
    reason = cute_backend.unsupported_reason(*_qkv(), causal=False, grad=False)
    assert reason is not None and "CUDA" in reason


def test_forward_config_that_overflows_shared_memory_is_refused_by_name():
    from ringfa4.kernels.fwd_sm90 import FwdSm90

    cfg = fwd_variant("bf16", 128, False, tile_n=176, persistent=True)
    with pytest.raises(ValueError, match=f"{cfg.name} needs 246784 bytes of shared memory"):
        FwdSm90(cfg)


def test_forward_packs_the_query_heads_of_a_kv_head_at_head_dim_64_where_they_divide_its_tile():
    assert fwd_defaults("bf16", 64, True, heads_per_kv=4).pack_gqa == 4
    assert fwd_defaults("bf16", 64, False, heads_per_kv=8).pack_gqa == 8
    assert fwd_defaults("bf16", 64, True, heads_per_kv=5).pack_gqa == 1  # 192-row tiles
    assert fwd_defaults("bf16", 64, True, heads_per_kv=1).pack_gqa == 1
    assert fwd_defaults("bf16", 128, True, heads_per_kv=4).pack_gqa == 1


def test_forward_waits_for_p_v_after_the_softmax_only_at_head_dim_64_without_mask_packing_or_documents():
    assert fwd_defaults("bf16", 64, False).late_pv_wait
    assert fwd_defaults("fp16", 64, False, seqlen_k=1024).late_pv_wait
    assert not fwd_defaults("bf16", 64, True).late_pv_wait
    assert not fwd_defaults("bf16", 64, False, heads_per_kv=4).late_pv_wait
    assert not fwd_defaults("bf16", 64, False, True).late_pv_wait
    assert not fwd_defaults("bf16", 128, False).late_pv_wait
    assert "latepv" in fwd_defaults("bf16", 64, False).name


def test_short_non_causal_forward_at_hdim_128_runs_persistent_ctas_with_128_then_160_key_blocks():
    cfg = fwd_defaults("bf16", 128, False, seqlen_k=1024)
    assert cfg.persistent and cfg.tile_n == 128 and not cfg.tile_order
    for keys in (1025, 4096):
        cfg = fwd_defaults("bf16", 128, False, seqlen_k=keys)
        assert cfg.persistent and cfg.tile_n == 160 and not cfg.tile_order
    cfg = fwd_defaults("bf16", 128, False, seqlen_k=4097)
    assert not cfg.persistent and cfg.tile_n == 176
    assert fwd_defaults("bf16", 64, False).persistent  # 192-row tiles: persistent at any length


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_causal_forward_with_short_walks_runs_persistent_in_the_hosts_tile_order(d, docs):
    """Walks up to ORDER_KEYS[d] keys: the longest document where the ids carry it, else the
    key length; past it, or with neither known, the launch-order LPT grid."""
    from ringfa4.backends.cute.configs import ORDER_KEYS

    def order(**kw):
        cfg = fwd_defaults("bf16", d, kw.pop("causal", True), docs, **kw)
        assert cfg.persistent == cfg.tile_order or not cfg.tile_order
        return cfg.tile_order

    bound = ORDER_KEYS[d]
    assert order(seqlen_k=1) and order(seqlen_k=bound)
    assert not order(seqlen_k=bound + 1) and not order()
    assert order(seqlen_k=4 * bound, longest_document=bound)
    assert not order(seqlen_k=bound, longest_document=bound + 1)
    assert not order(causal=False, seqlen_k=1024)


@pytest.mark.parametrize("pack", [1, 4])
@pytest.mark.parametrize("docs", [False, True])
def test_forward_tile_order_deals_every_tile_once_and_evens_the_persistent_ctas_key_blocks(pack, docs):
    """tile_order (host side, plain torch): a permutation of the raster ids, over batch rows
    with different documents or causal without, whose static share (CTA c: positions c, c +
    grid, ...) gives every CTA about the same key blocks; packed heads count kv heads."""
    from dataclasses import replace

    from ringfa4.backends.cute.interface import tile_order, visible_keys

    gen = torch.Generator().manual_seed(pack)
    cfg = replace(fwd_defaults("bf16", 64 if pack > 1 else 128, True, docs, seqlen_k=4096), pack_gqa=pack,
                  persistent=True, tile_order=True)
    tile_pos = cfg.tile_m // pack
    for b, seq, heads, grid in ((1, 8192, 8, 132), (3, 4000, 4, 16), (2, 300, 2, 132)):
        first = torch.arange(0, seq, tile_pos)
        last = (first + tile_pos).clamp(max=seq) - 1
        ids = None
        if docs:
            rows = []
            for _ in range(b):
                cuts = torch.randint(1, seq, (int(torch.randint(0, 12, (), generator=gen)),), generator=gen)
                rows.append(sorted({0, seq, *cuts.tolist()}))
            q_ids = torch.stack([_document_ids([e - a for a, e in zip(r, r[1:])])[0] for r in rows])
            ids = (q_ids, q_ids)
            key_lo, key_hi = visible_keys(ids, tile_pos)
            n_lo = key_lo[:, first] // cfg.tile_n
            walk = torch.maximum(-(-torch.minimum(key_hi[:, last], last + 1) // cfg.tile_n), n_lo + 1) - n_lo
        else:
            walk = (-(-(last + 1) // cfg.tile_n)).expand(b, -1)
        order = tile_order(cfg, b, seq, seq, heads, grid, torch.device("cpu"), ids)
        assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(b * heads * len(first)))
        cost = walk.repeat_interleave(heads, dim=0).flatten()[order.long()]
        share = torch.nn.functional.pad(cost, (0, -len(cost) % grid)).view(-1, grid).sum(0).float()
        if len(cost) >= 8 * grid:  # many tiles a CTA: the greedy deal leaves them within 5%
            assert share.max() <= 1.05 * share.mean(), (b, seq, share.max() / share.mean())


def test_forward_tile_orders_without_documents_are_kept_for_the_most_recent_shapes(monkeypatch):
    """One order per shape, made once while it is among the DENSE_ORDERS shapes used last (a
    training run whose sequence lengths vary must not keep one per length for good)."""
    import collections
    from dataclasses import replace

    from ringfa4.backends.cute import interface

    monkeypatch.setattr(interface, "_dense_orders", collections.OrderedDict())
    cfg = replace(fwd_defaults("bf16", 128, True, seqlen_k=4096), persistent=True, tile_order=True)
    cpu = torch.device("cpu")
    first = interface.tile_order(cfg, 1, 256, 256, 2, 4, cpu)
    assert interface.tile_order(cfg, 1, 256, 256, 2, 4, cpu) is first
    for seq in range(257, 257 + interface.DENSE_ORDERS - 1):
        interface.tile_order(cfg, 1, seq, seq, 2, 4, cpu)
    assert interface.tile_order(cfg, 1, 256, 256, 2, 4, cpu) is first  # used last: kept
    interface.tile_order(cfg, 1, 1000, 1000, 2, 4, cpu)
    assert len(interface._dense_orders) == interface.DENSE_ORDERS
    assert (cfg, 1, 257, 257, 2, 4, cpu) not in interface._dense_orders  # the least recent went


def test_forward_tile_order_groups_the_heads_whose_walks_k_v_fits_l2_together():
    """The order's head groups (a group's query blocks last first, its heads fastest) hold the
    heads whose K/V that their walks read fits the L2 budget together: with documents that is a
    head's K/V over its longest document, not over the whole key length."""
    from dataclasses import replace

    from ringfa4.backends.cute.interface import tile_order
    from ringfa4.documents import DocIds
    from ringfa4.kernels.tile_scheduler import L2_BUDGET

    seq, heads, grid, longest = 131072, 8, 132, 16384
    cfg = replace(fwd_defaults("bf16", 128, True, True, seqlen_k=seq), persistent=True, tile_order=True)
    ids = _document_ids([longest] * (seq // longest))
    for doc_ids, reach in ((None, seq), (DocIds(ids, ids, longest), longest)):
        order = tile_order(cfg, 1, seq, seq, heads, grid, torch.device("cpu"), doc_ids)
        group = max(1, L2_BUDGET // (reach * 128 * 2 * 2))
        assert group == (1 if doc_ids is None else 4)
        first_heads = set((order[:grid].long() // (seq // cfg.tile_m)).tolist())
        assert first_heads == set(range(group)), (reach, first_heads)


def _document_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths))[None]


def _some_missing(lengths, gen):
    """Document lengths with about half the documents (never all) left out: on a ring step each
    side holds documents the other does not."""
    kept = torch.rand(len(lengths), generator=gen) < 0.5
    kept[int(torch.randint(0, len(lengths), (), generator=gen))] = True
    return torch.where(kept, lengths, 0)


def _random_documents(gen, causal, max_docs):
    """(q_ids, k_ids, seen) of random documents over up to 600 queries and keys (the same rows
    when causal, else some documents missing on either side), seen[q, k] whether q sees k."""
    sq = int(torch.randint(1, 600, (), generator=gen))
    sk = sq if causal else int(torch.randint(1, 600, (), generator=gen))
    docs = int(torch.randint(1, max_docs, (), generator=gen))
    q_len, k_len = (torch.bincount(torch.randint(0, docs, (n,), generator=gen), minlength=docs) for n in (sq, sk))
    if not causal:
        q_len, k_len = _some_missing(q_len, gen), _some_missing(k_len, gen)
    q_ids, k_ids = _document_ids(q_len.tolist()), _document_ids(k_len.tolist())
    seen = q_ids[0, :, None] == k_ids[0, None, :]
    if causal:
        seen &= torch.ones(seen.shape, dtype=torch.bool).tril()
    return q_ids, k_ids, seen


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_backward_document_ranges_cover_every_visible_pair_and_order_each_tile(causal, tile_m):
    """visible_blocks (host side, plain torch): every visible (query, key) pair lies in a query
    tile its key block visits, and the blocks visiting a query tile are exactly the run from its
    first to its last block (what deterministic mode orders). Random documents, empty ones
    included (a non-causal ring step's queries and keys hold different documents)."""
    from ringfa4.backends.cute.interface import visible_blocks
    from ringfa4.backends.cute.launch import key_tile

    gen = torch.Generator().manual_seed(tile_m + causal)
    tile_n = key_tile()
    for _ in range(40):
        q_ids, k_ids, seen = _random_documents(gen, causal, max_docs=40)
        sq, sk = seen.shape
        _, _, query_blocks, key_blocks = visible_blocks((q_ids, k_ids), causal, tile_m)
        query_blocks, key_blocks = query_blocks[0].tolist(), key_blocks[0].tolist()
        assert len(query_blocks) == -(-sk // tile_n) and len(key_blocks) == -(-sq // tile_m)
        for q, k in seen.nonzero().tolist():
            first, end = query_blocks[k // tile_n]
            assert first <= q // tile_m < end, (q, k)
        for m, (first, last) in enumerate(key_blocks):
            visiting = [n for n, (a, e) in enumerate(query_blocks) if a <= m < e]
            assert visiting == list(range(first, last + 1)), m
        # A block visits no query tile beyond its keys' documents (keys of documents the queries
        # do not hold do not widen it).
        same_doc = q_ids[0, :, None] == k_ids[0, None, :]
        for n, (first, end) in enumerate(query_blocks):
            rows = same_doc[:, n * tile_n:(n + 1) * tile_n].any(1).nonzero()
            if len(rows) and first < end:
                assert rows.min() // tile_m <= first and end <= rows.max() // tile_m + 1, (n, first, end)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_key_ranges_hold_exactly_the_visible_pairs_and_leave_only_whole_tiles_unmasked(causal):
    """visible_blocks' per-key query ranges, as the backward kernel's mask reads them: query q
    sees key k iff query_lo[k] <= q < query_hi[k]; and a (query tile, K/V block) whose queries
    lie in [lo of the block's last key, hi of its first key), the kernel's test for skipping
    the mask, holds only visible pairs. Random documents, empty ones included."""
    from ringfa4.backends.cute.interface import visible_blocks
    from ringfa4.backends.cute.launch import key_tile

    gen = torch.Generator().manual_seed(7 + causal)
    tile_n, tile_m = key_tile(), 64
    for _ in range(40):
        q_ids, k_ids, seen = _random_documents(gen, causal, max_docs=12)
        sq, sk = seen.shape
        query_lo, query_hi, _, _ = visible_blocks((q_ids, k_ids), causal, tile_m)
        assert query_lo.dtype == query_hi.dtype == torch.int32 and query_lo.shape == (1, sk)
        q = torch.arange(sq)[:, None]
        assert torch.equal((query_lo[0] <= q) & (q < query_hi[0]), seen)
        for n in range(-(-sk // tile_n)):
            first_key, last_key = n * tile_n, min((n + 1) * tile_n, sk) - 1
            block_lo, block_hi = int(query_lo[0, last_key]), int(query_hi[0, first_key])
            for m in range(-(-sq // tile_m)):
                first, last = m * tile_m, min((m + 1) * tile_m, sq) - 1
                if first >= block_lo and last < block_hi:
                    assert seen[first:last + 1, first_key:last_key + 1].all(), (n, m)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_launch_order_runs_every_cta_once_document_by_document_longest_walk_first(causal):
    """launch_order (host side, plain torch): a permutation of the (kv slot, KV block) CTAs; the
    CTAs of a document (of its blocks' first keys) are consecutive, every kv slot's run of
    blocks in order, and documents come by their longest walk, longest first."""
    from ringfa4.backends.cute.interface import launch_order, visible_blocks
    from ringfa4.backends.cute.launch import key_tile

    gen = torch.Generator().manual_seed(7 + causal)
    for _ in range(30):
        sq = int(torch.randint(1, 900, (), generator=gen))
        sk = sq if causal else int(torch.randint(1, 900, (), generator=gen))
        docs = int(torch.randint(1, 12, (), generator=gen))
        q_len, k_len = (torch.bincount(torch.randint(0, docs, (n,), generator=gen), minlength=docs) for n in (sq, sk))
        ids = (_document_ids(q_len.tolist()), _document_ids(k_len.tolist()))
        slots = int(torch.randint(1, 5, (), generator=gen))
        order = launch_order(ids, causal, 64, slots)[0].tolist()
        query_blocks = visible_blocks(ids, causal, 64)[2][0].tolist()
        n = len(query_blocks)
        assert sorted(order) == list(range(slots * n))
        doc = ids[1][0, ::key_tile()].tolist()
        longest = {d: max(e - f for (f, e), dd in zip(query_blocks, doc) if dd == d) for d in set(doc)}
        runs = [doc[code % n] for code in order]
        starts = [i for i in range(len(runs)) if i == 0 or runs[i] != runs[i - 1]]
        assert len(starts) == len(set(doc)), "one run of CTAs per document"
        assert all(longest[runs[a]] >= longest[runs[b]] for a, b in zip(starts, starts[1:]))
        for start, end in zip(starts, starts[1:] + [len(order)]):
            codes = order[start:end]
            assert codes == sorted(codes), "kv slots in turn, a document's blocks in order"


def test_backward_keeps_the_grids_launch_order_where_it_is_relied_on_or_meaningless():
    """doc_order only with documents and outside deterministic mode (whose dQ waits rely on
    the grid's order): the defaults choose so, and the kernel refuses a config asking otherwise."""
    from cutlass import BFloat16

    from ringfa4.backends.cute.configs import bwd_defaults
    from ringfa4.kernels.bwd_sm90 import AttentionBackwardSm90

    assert bwd_defaults("bf16", 128, True, False, False, True).doc_order
    assert not bwd_defaults("bf16", 128, True, True, False, True).doc_order
    assert not bwd_defaults("bf16", 128, True, False, False, False).doc_order
    for deterministic, has_docs in ((True, True), (False, False)):
        with pytest.raises(ValueError, match="doc_order"):
            AttentionBackwardSm90(BFloat16, 128, 64, True, deterministic, BFloat16, has_docs, doc_order=True)


def test_backward_drops_its_key_mask_only_for_keys_in_whole_blocks_at_head_dim_128():
    """The variant without key mask is chosen where the host knows seqlen_k fills whole K/V
    blocks, not causal, in the default mode at head dim 128 (where it measured faster), and
    refused with documents, whose masks it would drop."""
    from cutlass import BFloat16

    from ringfa4.backends.cute.configs import bwd_defaults
    from ringfa4.kernels.bwd_sm90 import AttentionBackwardSm90

    assert bwd_defaults("bf16", 128, False, False, False, False, True).whole_keys
    for args in ((128, False, False, False, False, False), (128, True, False, False, False, True),
                 (128, False, True, False, False, True), (128, False, False, False, True, True),
                 (64, False, False, False, False, True)):
        assert not bwd_defaults("bf16", *args).whole_keys, args
    with pytest.raises(ValueError, match="whole_keys"):
        AttentionBackwardSm90(BFloat16, 128, 64, False, False, BFloat16, True, whole_keys=True)


def test_deterministic_dq_warps_meet_at_head_dim_64_without_causal_mask_or_long_causal_calls():
    """The two dQ warps meet every step in deterministic mode without documents at head dim 64:
    without causal mask at every length, causal from MEET_KEYS keys on (where each measured
    faster); the kernel refuses meeting without a dQ warp per part."""
    from cutlass import BFloat16

    from ringfa4.backends.cute.configs import MEET_KEYS, bwd_defaults
    from ringfa4.kernels.bwd_sm90 import AttentionBackwardSm90

    long = MEET_KEYS[64]
    for causal, keys in ((True, long), (True, 4 * long), (False, 1024), (False, 4 * long), (False, None)):
        assert bwd_defaults("bf16", 64, causal, True, False, seqlen_k=keys).dq_warps_meet, (causal, keys)
    for d, causal, det, docs, keys in (
            (64, True, True, False, long - 1), (64, True, True, False, None), (64, True, False, False, long),
            (64, False, False, False, long), (64, True, True, True, long), (64, False, True, True, 1024),
            (128, True, True, False, 4 * long), (128, False, True, False, 1024)):
        config = bwd_defaults("bf16", d, causal, det, False, docs, seqlen_k=keys)
        assert not config.dq_warps_meet, (d, causal, det, docs, keys)
    with pytest.raises(ValueError, match="dq_warps_meet"):
        AttentionBackwardSm90(BFloat16, 64, 128, True, True, BFloat16, dq_warp_per_part=False, dq_warps_meet=True)


@pytest.mark.parametrize("tile_m", [64, 128, 192])
def test_queries_that_see_nothing_do_not_widen_their_tiles_key_range(tile_m):
    """visible_keys (host side): each query's [key_lo, key_hi) is its document's keys; a query
    whose document the keys do not hold gets an empty range placed so that its tile's first and
    last rows still bound exactly the keys its other queries see; both ends stay nondecreasing."""
    from ringfa4.backends.cute.interface import visible_keys

    gen = torch.Generator().manual_seed(tile_m)
    for _ in range(40):
        docs = int(torch.randint(2, 40, (), generator=gen))
        lengths = [int(torch.randint(1, 700, (), generator=gen)) for _ in range(2)]
        q_len, k_len = (_some_missing(torch.bincount(torch.randint(0, docs, (n,), generator=gen), minlength=docs), gen)
                        for n in lengths)
        q_ids, k_ids = _document_ids(q_len.tolist()), _document_ids(k_len.tolist())
        lo, hi = (t[0] for t in visible_keys((q_ids, k_ids), tile_m))
        same_doc = q_ids[0, :, None] == k_ids[0, None, :]
        sees = same_doc.any(1)
        keys = torch.arange(k_ids.shape[1])
        for q in range(q_ids.shape[1]):
            assert torch.equal((keys >= lo[q]) & (keys < hi[q]), same_doc[q]), q
        assert (lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all()
        for start in range(0, q_ids.shape[1], tile_m):
            rows = sees[start:start + tile_m].nonzero()[:, 0] + start
            last = min(start + tile_m, q_ids.shape[1]) - 1
            if len(rows):
                assert lo[start] == lo[rows[0]] and hi[last] == hi[rows[-1]], start


def test_deterministic_walks_rotate_whole_where_the_blocks_fit_half_the_sms_else_in_two_equal_groups():
    from ringfa4.backends.cute.configs import bwd_defaults
    from ringfa4.backends.cute.interface import rotation_group

    sms = 132
    assert rotation_group(8448, False, True, sms, True) == 66  # 66 K/V blocks: one group
    assert rotation_group(8449, False, True, sms, True) == 34  # 67: two groups of 34 and 33
    assert rotation_group(16384, False, True, sms, True) == 64  # 128: two of 64
    assert rotation_group(16897, False, True, sms, True) == 0  # 133: three groups would be needed
    assert rotation_group(8448, False, True, sms, False) == 66  # whole rows need no groups
    assert rotation_group(8449, False, True, sms, False) == 0
    for causal, det in ((True, True), (False, False)):
        assert rotation_group(16384, causal, det, sms, True) == 0
    assert bwd_defaults("bf16", 64, False, True, False).rotate_groups
    assert not bwd_defaults("bf16", 128, False, True, False).rotate_groups  # its remapped launch spills
    assert not bwd_defaults("bf16", 64, False, True, False, has_docs=True).rotate_groups


def test_backward_splits_a_kv_heads_query_heads_only_where_kv_blocks_are_few():
    """head_splits (host side): a ring step's 4k causal square with 32/8 heads leaves the longest
    CTAs with a whole SM's share and splits; a 32k sequence, a batch of short sequences and MHA
    do not; causal sequences from 64k keys at head dim 128 take one query head per CTA, causal
    documents from 32k rows in the longest (32k keys or more in all, 16k in the longest: not); a split
    always divides the group; deterministic mode takes one head per CTA for causal attention from
    2k keys (hdim 128; 16k with hdim 64) or where the default splits, two at hdim 128 up to 4k keys
    where the grid is then 16 waves deep, and none otherwise."""
    from ringfa4.backends.cute.interface import head_splits

    sms = 132
    assert head_splits(1, 4096, 4096, 32, 8, 128, True, False, sms) == 2
    assert head_splits(1, 2048, 2048, 32, 8, 128, True, False, sms) == 4
    assert head_splits(1, 32768, 32768, 32, 8, 128, True, False, sms) == 1
    assert head_splits(1, 65536, 65536, 32, 8, 128, True, False, sms) == 4  # one head's Q, dO in L2
    assert head_splits(1, 65536, 65536, 32, 8, 64, True, False, sms) == 1
    assert head_splits(1, 65536, 65536, 32, 8, 128, False, False, sms) == 1
    assert head_splits(32, 1024, 1024, 32, 8, 128, True, False, sms) == 1
    assert head_splits(1, 4096, 2048, 32, 8, 128, False, False, sms) == 1  # 128 CTAs: one wave
    assert head_splits(1, 4096, 512, 32, 8, 128, False, False, sms) == 4   # 32 CTAs
    assert head_splits(1, 2048, 2048, 16, 16, 128, True, False, sms) == 1
    assert head_splits(1, 640, 200, 6, 1, 64, False, False, sms) == 2      # 6 = 2 shares of 3
    assert head_splits(1, 32768, 32768, 32, 8, 128, True, True, sms) == 4
    assert head_splits(8, 4096, 4096, 32, 8, 128, True, True, sms) == 2  # 4096 CTAs
    assert head_splits(16, 2048, 2048, 32, 8, 128, True, True, sms) == 2
    assert head_splits(2, 2048, 2048, 32, 8, 128, True, True, 8) == 2  # the GPU test's case: 8 SMs
    assert head_splits(4, 4096, 4096, 32, 8, 128, True, True, sms) == 4  # 2048 CTAs at 2 heads each
    assert head_splits(8, 8192, 8192, 32, 8, 128, True, True, sms) == 4
    assert head_splits(32, 1024, 1024, 32, 8, 128, True, True, sms) == 1
    assert head_splits(4, 8192, 8192, 32, 8, 64, True, True, sms) == 1
    assert head_splits(2, 16384, 16384, 32, 8, 64, True, True, sms) == 4
    assert head_splits(1, 4096, 4096, 32, 8, 128, True, True, sms) == 4  # where the default splits
    assert head_splits(1, 32768, 32768, 32, 8, 128, False, True, sms) == 1
    assert head_splits(1, 32768, 32768, 16, 16, 128, True, True, sms) == 1
    # Causal documents: by the longest document, not the sequence.
    assert head_splits(1, 131072, 131072, 32, 8, 128, True, False, sms, True, longest=16384) == 1
    assert head_splits(1, 131072, 131072, 32, 8, 128, True, False, sms, True, longest=32768) == 4
    assert head_splits(1, 131072, 131072, 32, 8, 128, True, False, sms, True) == 1
    assert head_splits(1, 131072, 131072, 32, 8, 64, True, False, sms, True, longest=65536) == 1


def test_backward_splits_less_at_head_dim_64_where_longest_walks_launch_first():
    """At head dim 64 a causal call that launches longest walks first (launches_lpt) splits only
    while its longest CTA holds more than an SM's even share (not half of it); deterministic mode
    keeps the half-share rule's decision."""
    from ringfa4.backends.cute.interface import head_splits

    sms = 132
    assert head_splits(1, 2048, 2048, 32, 8, 64, True, False, sms) == 2
    assert head_splits(1, 4096, 4096, 32, 8, 64, True, False, sms) == 1
    assert head_splits(1, 8192, 8192, 32, 8, 64, True, False, sms) == 1
    assert head_splits(1, 4096, 4096, 32, 8, 128, True, False, sms) == 2
    assert head_splits(1, 4096, 4096, 32, 8, 64, True, True, sms) == 4


def test_causal_backward_launches_longest_walks_first_only_for_small_calls():
    """launches_lpt (host side): up to LPT_MAX_Q_ELEMENTS query elements (a ring step of one
    sequence up to 8k keys with 32 heads of 128); not beyond (16k keys, or a batch of four 4k
    rows), not non-causal (equal walks), deterministic (its own order) or with documents
    (theirs)."""
    from ringfa4.backends.cute.interface import launches_lpt

    assert launches_lpt(1, 8192, 32, 128, True, False, False)
    assert launches_lpt(2, 4096, 32, 128, True, False, False)
    assert launches_lpt(4, 4096, 32, 64, True, False, False)
    assert not launches_lpt(1, 16384, 32, 128, True, False, False)
    assert not launches_lpt(4, 4096, 32, 128, True, False, False)
    assert not launches_lpt(1, 4096, 32, 128, False, False, False)
    assert not launches_lpt(1, 4096, 32, 128, True, True, False)
    assert not launches_lpt(1, 4096, 32, 128, True, False, True)


def test_backward_gives_every_query_head_a_cta_in_non_causal_calls_with_documents():
    """Documents make the K/V blocks' walks uneven: a non-causal call (a ring's remote step)
    splits the whole group, whatever the CTA count; causal and deterministic calls keep the rule."""
    from ringfa4.backends.cute.interface import head_splits

    sms = 132
    assert head_splits(1, 16384, 16384, 32, 8, 128, False, False, sms) == 1
    assert head_splits(1, 16384, 16384, 32, 8, 128, False, False, sms, has_docs=True) == 4
    assert head_splits(1, 640, 200, 6, 1, 64, False, False, sms, has_docs=True) == 6
    assert head_splits(1, 32768, 32768, 32, 8, 128, True, False, sms, has_docs=True) == 1
    assert head_splits(1, 16384, 16384, 32, 8, 128, False, True, sms, has_docs=True) == 1


def test_document_ranges_are_derived_once_per_ids_objects():
    """A ring passes the same ids objects to every layer's step (ringfa4.ring.documents): the
    ranges the kernels read are computed once for them; other objects, even equal, get their own."""
    from ringfa4.backends.cute.interface import visible_blocks, visible_keys

    ids = (_document_ids([3, 5, 0, 7]), _document_ids([2, 0, 4, 9]))
    assert all(a is b for a, b in zip(visible_blocks(ids, False, 128), visible_blocks(ids, False, 128)))
    assert all(a is b for a, b in zip(visible_keys(ids, 64), visible_keys(ids, 64)))
    assert visible_keys(ids, 128)[0] is not visible_keys(ids, 64)[0]
    again = tuple(t.clone() for t in ids)
    fresh = visible_blocks(again, False, 128)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(fresh, visible_blocks(ids, False, 128)))


def test_row_statistics_stay_in_their_16_row_group_with_a_threads_four_rows_side_by_side():
    """stats_layout: a permutation of each group of 16 rows; the rows an MMA thread of the
    backward holds there (2c + e, 8 + 2c + e: the wgmma accumulator's columns) land at 4c..4c+3."""
    from ringfa4.kernels.stats_layout import ROW_GROUP, stats_position

    rows = range(4 * ROW_GROUP)
    assert sorted(stats_position(r) for r in rows) == list(rows)
    assert all(stats_position(r) // ROW_GROUP == r // ROW_GROUP for r in rows)
    for c in range(4):
        held = [h * 8 + 2 * c + e for h in (0, 1) for e in (0, 1)]
        assert [stats_position(ROW_GROUP + r) for r in held] == [ROW_GROUP + 4 * c + i for i in range(4)]
