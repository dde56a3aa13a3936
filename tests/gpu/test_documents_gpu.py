"""Packed documents on the GPU: ringfa4.attention(cu_seqlens=) with the backend auto chooses for
documents (cute once its kernels mask documents, else upstream FA4's varlen path) and with fa4
explicitly, against per-document fp64 attention: out, lse and the gradients, bf16 and fp16,
head dims 64 and 128, the boundary cases of the CPU ring tests. And every rank of a ring with
documents simulated on this GPU (its steps narrowed to the rows that share documents): out, lse
and dq against the same reference."""
import math
import os
import sys

import pytest
import torch

import ringfa4
from ringfa4 import backends, documents
from ringfa4.ring import layout as ring_layout
from ringfa4.ring.attention import ring_backward, ring_forward
from ringfa4.ring.documents import RingDocuments
from ringfa4.ring.simulate import SimulatedRing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_documents_ring import document_attention_fp64  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs a CUDA GPU")]

SEQ = 2048
BOUNDARIES = {
    "random with length-1 documents": [0, 1, 2, 700, 701, 1500, 2047, SEQ],
    "boundaries on 128-row tiles": list(range(0, SEQ + 1, 256)),
    "one long document and tiny ones": [0, 3, 6, 1800, SEQ],
    "many tiny documents": list(range(0, SEQ + 1, 16)),
}


TOLERANCE = {"out": 2e-2, "lse": 1e-3, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}


def _assert_close(what, got, ref, case):
    assert torch.isfinite(got).all(), f"{what} not finite ({case})"
    err = (got.double() - ref).abs().max().item()
    assert err <= TOLERANCE[what] * max(1.0, ref.abs().max().item()), f"{what}: error {err:.3g} ({case})"


@pytest.mark.parametrize("backend", ["auto", "fa4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_attention_with_documents_matches_fp64(backend, dtype, head_dim, name):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v, dout = (torch.randn(1, SEQ, n, head_dim, device="cuda", dtype=dtype, generator=gen)
                     for n in (8, 2, 2, 8))
    row = BOUNDARIES[name]
    cu = torch.tensor(row, dtype=torch.int32, device="cuda")
    reason = backends.get("fa4").unsupported_reason(q, k, v, True, True, documents.local_ids([row], SEQ, q.device))
    if backend == "fa4" and reason is not None:
        pytest.skip(reason)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = document_attention_fp64(*full, [row], causal=True)
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout.double()))
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringfa4.attention(*mine, causal=True, backend=backend, cu_seqlens=cu)
    got = (out, lse, *torch.autograd.grad(out, mine, dout))
    for what, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        _assert_close(what, g, r, f"{name}, {dtype}, d={head_dim}")


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_causal_documents_with_one_query_head_per_backward_cta_match_fp64(name, monkeypatch):
    # What long documents take (interface.DOC_L2_SPLIT_KEYS), forced on short ones: the split
    # shares' fp32 dK/dV sums in the document launch order.
    from ringfa4.backends.cute import interface
    monkeypatch.setattr(interface, "DOC_L2_SPLIT_KEYS", 1)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(1, SEQ, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for n in (8, 2, 2, 8))
    row = BOUNDARIES[name]
    assert interface.head_splits(1, SEQ, SEQ, 8, 2, 128, True, False, 132, True,
                                 longest=max(b - a for a, b in zip(row, row[1:]))) == 4
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = document_attention_fp64(*full, [row], causal=True)
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout.double()))
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringfa4.attention(*mine, causal=True, backend="cute", cu_seqlens=torch.tensor(row, dtype=torch.int32, device="cuda"))
    got = (out, lse, *torch.autograd.grad(out, mine, dout))
    for what, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        _assert_close(what, g, r, name)


def test_a_gpu_cu_seqlens_changed_in_place_gives_its_new_documents():
    # Read once per version (ringfa4.documents): torch's in-place writes must be seen.
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, SEQ, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (8, 2, 2))
    cu = torch.tensor([0, 700, SEQ], dtype=torch.int32, device="cuda")
    for row in ([0, 700, SEQ], [0, 1300, SEQ]):
        cu[1] = row[1]
        out, lse = ringfa4.attention(q, k, v, causal=True, cu_seqlens=cu)
        ref_out, ref_lse = document_attention_fp64(*(t.double() for t in (q, k, v)), [row], causal=True)
        _assert_close("out", out, ref_out, row)
        _assert_close("lse", lse, ref_lse, row)


@pytest.mark.parametrize("pack", [1, 4])
def test_persistent_forward_in_the_hosts_tile_order_writes_every_row_of_a_packed_batch(pack):
    """The causal document forward's default at head dim 128 (persistent CTAs dealt tiles in
    interface.tile_order), also with packed heads, over a packed batch whose rows hold different
    documents, with many more tiles than SMs: every element of out and lse written (both
    preallocated as NaN), equal to fp64, and bit for bit the non-persistent launch-order
    kernel's (a tile's work does not depend on when it runs)."""
    from dataclasses import replace

    from ringfa4.backends.cute import interface

    b, seq = 3, 4096
    rows = [[0, 1, 130, 2000, seq], [0, seq], [0, 64, 128, 1000, 1001, 3000, seq]]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(b, seq, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (16, 4, 4))
    ids = documents.local_ids(rows, seq, q.device)
    config = replace(interface.forward_config(q, k, True, ids), pack_gqa=pack)
    assert config.persistent and config.tile_order
    out = torch.full_like(q, math.nan)
    lse = torch.full((b, 16, seq), math.nan, device="cuda")
    interface.forward(q, k, v, True, None, out=out, lse=lse, config=config, doc_ids=ids)
    ref_out, ref_lse = document_attention_fp64(q, k, v, rows, causal=True)
    _assert_close("out", out, ref_out, "persistent, host order")
    _assert_close("lse", lse, ref_lse, "persistent, host order")
    launch_order = replace(config, persistent=False, tile_order=False)
    out2, lse2 = interface.forward(q, k, v, True, None, config=launch_order, doc_ids=ids)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


RING_SEQ = 8192
RING_ROWS = [0, 1, 700, 701, 1500, 2100, 2105, 4096, 5000, 7900, RING_SEQ]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "document_zigzag", "document_balanced"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_rank_of_a_simulated_ring_with_documents_matches_fp64(world, layout, causal):
    # Out, lse and dq of a simulated rank are exact (ringfa4.ring.simulate); dk and dv are not.
    gen = torch.Generator(device="cuda").manual_seed(world)
    q, k, v, dout = (torch.randn(1, RING_SEQ, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for n in (8, 2, 2, 8))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = document_attention_fp64(*full, [RING_ROWS], causal)
    ref_dq = torch.autograd.grad(ref_out, full[0], dout.double())[0]

    def part(x, rank, dim=1):
        return ring_layout.part(x, rank, world, layout, dim=dim, rows=[RING_ROWS])

    backend, scale = backends.get("cute"), q.shape[-1] ** -0.5
    blocks = [[part(t, r) for t in (k, v)] for r in range(world)]
    for rank in range(world):
        docs = RingDocuments([RING_ROWS], rank, world, layout, RING_SEQ, q.device)
        ring = SimulatedRing(rank, world, blocks, q.device, steps=docs.steps(causal))
        q_local = part(q, rank)
        out, lse, kv_last = ring_forward(backend, q_local, *blocks[rank], causal, scale, ring, layout, docs)
        dq, _, _ = ring_backward(backend, part(dout, rank), q_local, *blocks[rank], out, lse, kv_last, causal, scale,
                                 ring.turned(), layout, False, docs)
        case = f"W={world} rank {rank} {layout} causal={causal}"
        for what, g, r in (("out", out, part(ref_out, rank)), ("lse", lse, part(ref_lse, rank, dim=2)),
                           ("dq", dq, part(ref_dq, rank))):
            _assert_close(what, g, r, case)
