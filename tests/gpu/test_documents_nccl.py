"""Packed documents through the ring over NCCL on 2 GPUs: out, lse, dq, dk, dv against
per-document fp64 attention, bf16, zigzag and document_zigzag, for the backend auto picks with
documents and for torch.

    torchrun --nproc_per_node=2 -m pytest -m gpu -q tests/gpu/test_documents_nccl.py

Tolerance: the ring's error may be at most 2x the error of one GPU running the same backend on
the whole sequence plus 2x bf16's rounding at the reference's magnitude (tests/gpu/test_ring_nccl.py
explains the rule). Every rank checks its rows; the verdict is shared so no rank is left waiting.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ringfa4

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_documents_ring import document_attention_fp64  # noqa: E402

pytestmark = pytest.mark.gpu

SEQ = 4096
ROWS = [[0, 1, 700, 701, 1024, 2048, 3000, 4095, SEQ], [0, 5, SEQ - 5, SEQ]]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("layout", ["zigzag", "document_zigzag", "document_balanced"])
def test_ring_with_documents_over_nccl_matches_fp64(world, backend, layout):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v, dout = (torch.randn(2, SEQ, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for n in (8, 2, 2, 8))
    cu = torch.tensor(ROWS[0] + [SEQ + x for x in ROWS[1][1:]], dtype=torch.int32, device="cuda")
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = document_attention_fp64(*full, ROWS, causal=True)
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, full, dout.double()))
    one = [t.clone().requires_grad_() for t in (q, k, v)]
    o1, l1 = ringfa4.attention(*one, causal=True, backend=backend, cu_seqlens=cu)
    single = (o1, l1, *torch.autograd.grad(o1, one, dout))

    def sharded(t, dim=1):
        return ringfa4.shard(t, dim=dim, layout=layout, cu_seqlens=cu)

    local = [sharded(t).requires_grad_() for t in (q, k, v)]
    out, lse = ringfa4.ring_attention(*local, causal=True, layout=layout, backend=backend, return_lse=True,
                                      cu_seqlens=cu)
    got = (out, lse, *torch.autograd.grad(out, local, sharded(dout)))
    failures = []
    for what, g, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, ref):
        dim = 2 if what == "lse" else 1
        r_local, s_local = sharded(r, dim), sharded(s, dim)
        rounding = 0.0 if what == "lse" else 2 * 2 ** -8 * r.abs().max().item()
        bound = 2 * (s_local.double() - r_local).abs().max().item() + rounding + (1e-4 if what == "lse" else 0)
        err = (g.double() - r_local).abs().max().item()
        if not torch.isfinite(g).all() or err > bound:
            failures.append(f"rank {dist.get_rank()}: {what} error {err:.3g} > {bound:.3g}")
    verdicts = [None] * world
    dist.all_gather_object(verdicts, failures)
    assert not any(verdicts), verdicts
