"""Packed documents on the GPU: ringfa4.attention(cu_seqlens=) with the backend auto chooses for
documents (cute once its kernels mask documents, else upstream FA4's varlen path) and with fa4
explicitly, against per-document fp64 attention: out, lse and the gradients, bf16 and fp16,
head dims 64 and 128, the boundary cases of the CPU ring tests."""
import os
import sys

import pytest
import torch

import ringfa4
from ringfa4 import backends, documents

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
    for what, g, r, tol in zip(("out", "lse", "dq", "dk", "dv"), got, ref, (2e-2, 1e-3, 5e-2, 5e-2, 5e-2)):
        assert torch.isfinite(g).all(), what
        err = (g.double() - r).abs().max().item()
        assert err <= tol * max(1.0, r.abs().max().item()), f"{what}: error {err:.3g} ({name}, {dtype}, d={head_dim})"
