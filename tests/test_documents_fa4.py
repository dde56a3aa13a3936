"""The fa4 backend's varlen packing of documents, on the CPU: upstream's _flash_attn_fwd/_bwd are
replaced by a stand-in that runs each varlen sequence through the torch reference (what upstream
computes for it), so this checks our side exactly: the pieces, the packing, the scatter back, the
rows of no shared document, and the gradients' adds."""
import math

import pytest
import torch

import ringfa4.backends.fa4 as fa4
import ringfa4.backends.torch_ref as torch_ref


class VarlenStandIn:
    """flash_attn.cute.interface as far as our varlen calls use it, computed by the torch reference."""

    @staticmethod
    def _sequences(cu_q, cu_k):
        return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False,
                        return_lse=False):
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for qa, qb, ka, kb in cls._sequences(cu_seqlens_q, cu_seqlens_k):
            o, l = torch_ref.forward(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], causal, softmax_scale)
            out[qa:qb], lse[:, qa:qb] = o[0], l[0]
        return out, lse

    @classmethod
    def _flash_attn_bwd(cls, q, k, v, out, dout, lse, softmax_scale=None, causal=False, deterministic=False,
                        cu_seqlens_q=None, cu_seqlens_k=None):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for qa, qb, ka, kb in cls._sequences(cu_seqlens_q, cu_seqlens_k):
            g = torch_ref.backward(dout[None, qa:qb], q[None, qa:qb], k[None, ka:kb], v[None, ka:kb],
                                   out[None, qa:qb], lse[None, :, qa:qb], causal, softmax_scale)
            for acc, part, (a, b) in zip(grads, g, ((qa, qb), (ka, kb), (ka, kb))):
                acc[a:b] = part[0]
        return tuple(grads)


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_varlen_packing_equals_the_torch_reference_with_documents(monkeypatch, causal):
    monkeypatch.setattr(fa4, "_interface", lambda: VarlenStandIn)
    gen = torch.Generator().manual_seed(3)
    b, s, sk = 2, 24, (24 if causal else 20)
    q, dout = (torch.randn(b, s, 4, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, sk, 2, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    # Row 0: a query-only document first (rows that see nothing when not causal), a length-1 one.
    q_ids = torch.tensor([[0] * 5 + [1] * 10 + [2] + [3] * 8, [0] * 24], dtype=torch.int32)
    k_ids = q_ids if causal else torch.tensor([[1] * 6 + [2] + [3] * 9 + [4] * 4, [0] * 20], dtype=torch.int32)
    ids = (q_ids, k_ids)
    out, lse = fa4.forward(q, k, v, causal, 0.3, doc_ids=ids)
    ref_out, ref_lse = torch_ref.forward(q, k, v, causal, 0.3, doc_ids=ids)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.equal(lse.isinf(), ref_lse.isinf())
    assert torch.allclose(lse[lse.isfinite()].double(), ref_lse[ref_lse.isfinite()], atol=1e-6)
    if not causal:
        assert (lse[0, :, :5] == -math.inf).all() and (out[0, :5] == 0).all()
    given = [torch.ones_like(t) for t in (q, k, v)]
    grads = fa4.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3, *given, doc_ids=ids)
    ref = torch_ref.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3, doc_ids=ids)
    for name, g, r in zip("qkv", grads, ref):
        assert torch.allclose(g, r + 1, atol=1e-12), f"d{name}"
