"""Packed documents: the ring over gloo processes equals per-document fp64 attention on the full
sequence (out, lse, dq, dk, dv), for every layout, causal and not, GQA, many boundary shapes."""
import itertools
import math
import random

import pytest
import torch

import ringfa4
import ringfa4.backends.torch_ref as torch_ref
from distributed import run
from ringfa4 import documents
from ringfa4.ring import attention as ring_attention
from ringfa4.ring import documents as documents_ring
from ringfa4.ring.documents import RingDocuments, counting
from ringfa4.ring.schedule import ROW_ALIGN, plan

TOL = 1e-9
LAYOUTS = ("zigzag", "contiguous") + documents.LAYOUTS


def document_attention_fp64(q, k, v, rows, causal, scale=None):
    """(out, lse) of attention masked to documents (``rows``: per batch row its boundaries), fp64."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    ids = documents.ids_at(rows, torch.arange(q.shape[1]).expand(q.shape[0], -1)).to(s.device)
    hidden = ids[:, None, :, None] != ids[:, None, None, :]
    if causal:
        hidden = hidden | torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: out 0 (lse -inf)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def boundary_sets(world, seq, rng):
    """Named cu_seqlens lists over one row of ``seq`` tokens."""
    chunk = seq // (2 * world)
    cuts = sorted(rng.sample(range(1, seq), 5))
    return {
        "random with length-1 documents": sorted({0, seq, *cuts, cuts[0] + 1, seq - 1}),
        "one document spanning every rank": [0, 1, seq - 2, seq],
        "boundaries on chunk edges": list(range(0, seq + 1, chunk)),
        "many tiny documents": sorted({0, seq, *range(0, seq, 3)}),
        "a document longer than a rank's share": [0, 3, 3 + seq // world + 5, seq],
    }


def _run_ring(local, layout, causal, scale, cu, dout):
    out, lse = ringfa4.ring_attention(*local, causal=causal, softmax_scale=scale, layout=layout, backend="torch",
                                      return_lse=True, cu_seqlens=cu)
    return (out, lse, *torch.autograd.grad(out, local, dout))


def _check(rank, world, seed):
    torch_ref.BLOCK = 16
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for layout in LAYOUTS:
        for causal in (False, True):
            b, h, hk, d, scale = rng.choice([(1, 4, 2, 16, None), (2, 4, 1, 8, 0.5), (1, 2, 2, 32, None)])
            seq = 8 * 2 * world
            sets = boundary_sets(world, seq, rng)
            for name, row in sets.items():
                if b == 1:
                    cu, rows = torch.tensor(row, dtype=torch.int32), [row]
                else:  # FA's packed batch: the second row holds other documents
                    second = [0, seq // 2 + 1, seq]
                    cu = torch.tensor(row + [seq + x for x in second[1:]], dtype=torch.int32)
                    rows = [row, second]
                case = f"W={world} {layout} causal={causal} b={b} h={h} hk={hk} {name} cu={cu.tolist()}"
                tensors = [torch.randn(b, seq, n, d, dtype=torch.float64, generator=gen) for n in (h, hk, hk, h)]
                _assert_ring_matches_fp64(rank, tensors, rows, cu, layout, causal, scale, case)


def _assert_ring_matches_fp64(rank, tensors, rows, cu, layout, causal, scale, case):
    """The ring on this rank's rows of q, k, v, dout (full sequences) against per-document fp64
    attention: out, lse, dq, dk, dv; and unshard(shard(x)) == x."""
    q, k, v, dout = tensors
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = document_attention_fp64(*full, rows, causal, scale)
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout))

    def sharded(t, dim=1):
        return ringfa4.shard(t, dim=dim, layout=layout, cu_seqlens=cu)

    local = [sharded(t).requires_grad_() for t in (q, k, v)]
    got = _run_ring(local, layout, causal, scale, cu, sharded(dout))
    for what, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        r = sharded(r, dim=2 if what == "lse" else 1)
        assert torch.isfinite(g).all(), f"rank {rank}: {what} not finite ({case})"
        err = (g - r).abs().max().item()
        assert g.shape == r.shape and err < TOL, f"rank {rank}: {what} error {err:.3g} ({case})"
    back = ringfa4.unshard(sharded(ref_out.detach()), layout=layout, cu_seqlens=cu)
    assert torch.equal(back, ref_out.detach()), f"rank {rank}: unshard(shard(x)) != x ({case})"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_with_documents_matches_per_document_fp64_attention(world):
    run(_check, world, random.randrange(2**31))


def _check_single_document(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = 16 * world
    for layout in LAYOUTS:
        for causal in (False, True):
            q, k, v, dout = (torch.randn(2, seq, n, 16, dtype=torch.float64, generator=gen) for n in (4, 2, 2, 4))
            shard_layout = "zigzag" if layout in documents.LAYOUTS else layout
            local = [ringfa4.shard(t, layout=shard_layout).requires_grad_() for t in (q, k, v)]
            dense = _run_ring(local, shard_layout, causal, None, None, ringfa4.shard(dout, layout=shard_layout))
            for cu in ([0, seq], [0, seq, 2 * seq]):  # shared by the batch; FA's packed batch
                one = _run_ring(local, layout, causal, None, torch.tensor(cu, dtype=torch.int32),
                                ringfa4.shard(dout, layout=shard_layout))
                for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), one, dense):
                    assert torch.equal(a, b), f"rank {rank}: {what} of one document per row differs from dense ({layout})"


def test_one_document_per_row_is_the_dense_ring_bit_for_bit():
    run(_check_single_document, 2, random.randrange(2**31))


def _check_bf16_partials(rank, world, seed, block=16):
    torch_ref.BLOCK = 16
    gen = torch.Generator().manual_seed(seed)
    seq = block * world
    row = [0, 3, seq - 5, seq]  # a document longer than two ranks' share: a ring of W steps
    cu = torch.tensor(row, dtype=torch.int32)
    tensors = [torch.randn(1, seq, n, 16, dtype=torch.float64, generator=gen) for n in (4, 2, 2, 4)]
    full = [t.clone().requires_grad_() for t in tensors[:3]]
    ref_out, _ = document_attention_fp64(*full, [row], True)
    ref = torch.autograd.grad(ref_out, full, tensors[3])
    steps = []  # per backward step, its calls' given dK: (dtype, dv dtype, documents, a view of the sums)
    backward, calls = torch_ref.backward, ring_attention._calls

    def recording(*args, dk=None, dv=None, **kwargs):
        steps[-1].append(None if dk is None else (dk.dtype, dv.dtype, kwargs.get("doc_ids") is not None,
                                                  dk._base is not None, dk.shape[1]))
        return backward(*args, dk=dk, dv=dv, **kwargs)

    def stepping(*args, **kwargs):
        if args[4] == "bwd":
            steps.append([])
        return calls(*args, **kwargs)

    torch_ref.backward, ring_attention._calls = recording, stepping
    try:
        local = [ringfa4.shard(t.to(torch.bfloat16), layout="document_balanced", cu_seqlens=cu).requires_grad_()
                 for t in tensors[:3]]
        dout = ringfa4.shard(tensors[3].to(torch.bfloat16), layout="document_balanced", cu_seqlens=cu)
        got = _run_ring(local, "document_balanced", True, None, cu, dout)[2:]
    finally:
        torch_ref.backward, ring_attention._calls = backward, calls
    given = [g for step in steps for g in step]
    assert given and all(g[:3] == (torch.float32, torch.float32, True) for g in given if g is not None), given
    assert given.count(None) == 1 and steps[-1] == [None], steps  # the local causal step returns its own, in bf16
    assert not any(g[3] for g in steps[0]), steps  # the block's sums start from the first step's
    for step in steps[1:-1]:
        # Past the first step a remote step holds fresh fp32 dK/dV of its first call only, half
        # its one call's keys at most (+ the cut's rounding): the rest add into the arrived sums.
        fresh = [g[4] for g in step if not g[3]]
        assert len(fresh) == 1 and fresh[0] <= block // 2 + ROW_ALIGN // 2, steps
    for what, g, r in zip(("dq", "dk", "dv"), got, ref):
        r = ringfa4.shard(r, layout="document_balanced", cu_seqlens=cu)
        err = (g.double() - r).abs().max().item()
        assert g.dtype == torch.bfloat16 and err < 5e-2, f"rank {rank}: bf16 {what} error {err:.3g}"


def test_ring_with_documents_sums_bf16_gradients_from_fp32_partials():
    """Over more than two ranks the dK/dV sums are fp32: each remote backward call with documents
    adds its gradients into fp32 buffers, never rounding a partial to bf16 first."""
    run(_check_bf16_partials, 3, random.randrange(2**31))


@pytest.mark.parametrize("world", [3, 4])
def test_a_remote_steps_later_calls_add_into_the_arrived_dk_dv_sums(world):
    """Past the first backward step, a remote step with documents gives fresh fp32 dK/dV to its
    first call (the first half of its keys when it has one call) and adds the others straight
    into the block's sums once they arrived: no third fp32 block beside the sums sent and the
    sums arriving (the dense ring holds bf16 there)."""
    run(_check_bf16_partials, world, random.randrange(2**31), 4 * ROW_ALIGN)


def _check_skips(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    # Zigzag over 3 ranks, 6 chunks of 4 (rank 0: chunks 0, 5; rank 1: 1, 4; rank 2: 2, 3); one
    # document spans chunks 1 and 2, the others stay in a chunk: only rank 2 sees another rank's
    # keys (rank 1's, one hop), so the ring takes 2 steps, and ranks 0 and 1 skip their second.
    cu = torch.tensor([0, 4, 12, 16, 20, 24], dtype=torch.int32)
    local = [ringfa4.shard(t).requires_grad_()
             for t in (torch.randn(1, 24, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))]
    with counting() as count:
        out = ringfa4.ring_attention(*local, causal=True, backend="torch", cu_seqlens=cu)
        out.sum().backward()
    seen = rank == 2
    assert count.computed == {"fwd": 1 + seen, "bwd": 1 + seen}, count
    assert count.skipped == {"fwd": 1 - seen, "bwd": 1 - seen}, count
    kv_bytes = 2 * 8 * 2 * 8 * 8  # k and v rows of a block, fp64
    # The skipped step's keys: rank 0's (a later source) every key, rank 1's (an earlier one) the
    # first chunk's (ringfa4.ring.schedule).
    skipped = {0: kv_bytes, 1: kv_bytes // 2, 2: 0}[rank]
    assert count.skipped_kv_bytes == {"fwd": skipped, "bwd": skipped}, count
    # Not made by the 2-step ring: 1 of the forward's 2 KV transfers; in the backward its 1 KV
    # transfer and 1 of its 2 dK/dV sums. Of the transfers left only those of rank 1's block carry
    # anything (rank 2 reads its first 4 of 8 rows): rank 1 sends those rows in the forward, rank 2
    # (which holds the block in the backward) their dK/dV sums; the blocks of ranks 0 and 2 and
    # their sums are not sent.
    whole = {0: 1, 1: 0, 2: 1}[rank]  # the forward's remaining transfer not made
    half = {0: 0, 1: 1, 2: 0}[rank]  # ... or made with half the rows
    assert count.transfers_saved == {"fwd": 1 + whole, "bwd": 2 + (rank != 2)}, count
    assert count.transfer_bytes_saved == {"fwd": kv_bytes * (1 + whole) + kv_bytes // 2 * half,
                                          "bwd": kv_bytes * (2 + (rank != 2)) + kv_bytes // 2 * (rank == 2)}, count


def test_steps_without_a_shared_document_launch_nothing_and_the_ring_stops_after_the_farthest_hop():
    run(_check_skips, 3, random.randrange(2**31))


def _long_block_cases(world, rng):
    """(layout, causal, cu_seqlens) over blocks of 640 rows per rank (5 x ROW_ALIGN; zigzag's
    halves of 320 are not a multiple of it): a few random documents, so that steps share a few."""
    seq = 640 * world
    cu = sorted({0, seq, *rng.sample(range(1, seq), 2 * world)})
    return [(layout, causal, cu) for layout in LAYOUTS for causal in (False, True)]


def _check_long_blocks(rank, world, seed, split_rows):
    documents_ring.SPLIT_ROWS = split_rows
    documents.CHAINED_SPLITS = _GREEDY_ONLY[split_rows == 64]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for layout, causal, row in _long_block_cases(world, rng):
        tensors = [torch.randn(1, row[-1], n, 8, dtype=torch.float64, generator=gen) for n in (2, 1, 1, 2)]
        _assert_ring_matches_fp64(rank, tensors, [row], torch.tensor(row, dtype=torch.int32), layout, causal, None,
                                  f"W={world} {layout} causal={causal} SPLIT_ROWS={split_rows} cu={row}")


# With SPLIT_ROWS 64, document_balanced places the rows as its greedy placements do: folded documents
# among whole ones, shared by a step with rows that see nothing between them (the chained
# placements share one document per neighbour, which no step splits).
_GREEDY_ONLY = {False: documents.CHAINED_SPLITS, True: ()}


@pytest.mark.parametrize("world, split_rows", [(2, documents_ring.SPLIT_ROWS), (2, 64), (3, 64)])
def test_ring_with_documents_over_blocks_longer_than_a_row_run_is_exact(world, split_rows):
    """Steps narrowed to one call (blocks of 640 rows) or split into several (SPLIT_ROWS 64)."""
    run(_check_long_blocks, world, random.randrange(2**31), split_rows)


@pytest.mark.parametrize("split_rows", [documents_ring.SPLIT_ROWS, 64])
def test_a_step_calls_the_backend_over_the_rows_that_share_documents_only(monkeypatch, request, split_rows):
    """Every pair of same-document rows of a step lies in exactly one of its calls; the calls'
    query runs and key runs do not overlap, query runs start and end on ROW_ALIGN or the step's
    edges, and the ids given are those of the rows called. With a short SPLIT_ROWS steps split
    into several calls."""
    monkeypatch.setattr(documents_ring, "SPLIT_ROWS", split_rows)
    monkeypatch.setattr(documents, "CHAINED_SPLITS", _GREEDY_ONLY[split_rows == 64])
    documents._balanced_pieces.cache_clear()
    request.addfinalizer(documents._balanced_pieces.cache_clear)  # no placement of this test outlives it
    rng = random.Random(0)
    narrower = split = 0
    for world in (2, 3, 4):
        for layout, causal, row in _long_block_cases(world, rng):
            local_len = row[-1] // world
            for rank in range(world):
                docs = RingDocuments([row], rank, world, layout, row[-1], torch.device("cpu"))
                for source in range(world):
                    whole = plan(rank, source, layout, causal, local_len)
                    calls = docs.calls(whole, source, causal, "fwd", [])
                    if not calls or source == rank:
                        continue
                    case = (world, layout, causal, rank, source, row)
                    q_ids, k_ids = docs._ids_for(source, causal)[:2]  # ids of the whole blocks
                    (q0, q1, _), (k0, k1, _) = whole.q.indices(local_len), whole.kv.indices(local_len)
                    covered = torch.zeros(local_len, local_len, dtype=torch.int64)
                    for step, ids in calls:
                        assert torch.equal(ids[0], q_ids[:, step.q]) and torch.equal(ids[1], k_ids[:, step.kv]), case
                        assert step.q.start in (q0,) or step.q.start % ROW_ALIGN == 0, case
                        assert step.q.stop in (q1,) or step.q.stop % ROW_ALIGN == 0, case
                        assert q0 <= step.q.start < step.q.stop <= q1 and k0 <= step.kv.start < step.kv.stop <= k1
                        covered[step.q, step.kv] += 1
                    same = torch.zeros(local_len, local_len, dtype=torch.bool)
                    same[q0:q1, k0:k1] = q_ids[0, q0:q1, None] == k_ids[0, None, k0:k1]
                    calls_per_pair = covered[same]
                    assert (calls_per_pair == 1).all(), f"a same-document pair called {calls_per_pair.max()}x or never: {case}"
                    q_runs = sorted((c[0].q.start, c[0].q.stop) for c in calls)
                    k_runs = sorted((c[0].kv.start, c[0].kv.stop) for c in calls)
                    assert all(a[1] <= b[0] for runs in (q_runs, k_runs) for a, b in zip(runs, runs[1:])), case
                    narrower += sum(b - a for a, b in q_runs) < q1 - q0
                    split += len(calls) > 1
    assert narrower > 0, "no step was narrowed: the cases do not test it"
    if split_rows == 64:
        assert split > 0, "no step was split into several calls: the cases do not test it"


def _longest_run(ids):
    return max(max(len(list(g)) for _, g in itertools.groupby(row)) for row in ids.tolist())


@pytest.mark.parametrize("layout", ["zigzag", "document_balanced"])
def test_every_calls_ids_carry_their_longest_document_on_the_host(layout):
    """DocIds.longest (what a backend may choose kernels by without reading the ids back from the
    device): the longest document of a one-device call, and per ring call the longest run of one
    id among its query rows."""
    rows = [[0, 5, 300, 310, 700, 1024]]
    assert documents.local_ids(rows, 1024, "cpu").longest == 390
    for world in (2, 4):
        for rank in range(world):
            docs = RingDocuments(rows, rank, world, layout, 1024, torch.device("cpu"))
            assert docs.local.longest == _longest_run(docs.local[0])
            for source in range(world):
                for causal in (False, True):
                    step = plan(rank, source, layout, causal, docs.local[0].shape[1])
                    for part, ids in docs.calls(step, source, causal, "fwd", [torch.zeros(1, 1024 // world)]):
                        assert ids.longest == _longest_run(ids[0]), (rank, source, part)


def test_a_blocks_transfers_carry_the_rows_other_ranks_read():
    """RingDocuments.carried over 4 contiguous ranks of 4096 rows (balance.carried_share, the
    share of all blocks' rows): one causal document: every block but the last is read whole by the
    ranks after it; not causal, the last too; a document per rank: none; a first document of 2048
    rows that the rest does not see: rank 0 carries only its other 2048 rows."""
    from ringfa4.ring import balance

    assert balance.carried_share([0, 16384], 4, "contiguous") == 0.75
    assert balance.carried_share([0, 16384], 4, "contiguous", causal=False) == 1.0
    assert balance.carried_share([0, 4096, 8192, 12288, 16384], 4, "contiguous") == 0.0
    assert balance.carried_share([0, 2048, 16384], 4, "contiguous") == (2048 + 2 * 4096) / 16384
    docs = RingDocuments([[0, 2048, 16384]], 0, 4, "contiguous", 16384, torch.device("cpu"))
    assert [docs.carried(s, True) for s in range(4)] == [slice(2048, 4096), slice(0, 4096), slice(0, 4096),
                                                         slice(0, 0)]
