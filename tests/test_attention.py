"""Single-device attention with the torch reference backend against the fp64 ground truth."""
import math

import pytest
import torch

import ringfa4
import ringfa4.backends.torch_ref as torch_ref
from reference import attention_fp64


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(torch_ref, "BLOCK", 32)  # several KV blocks even on short sequences


@pytest.mark.parametrize(
    "b, sq, sk, h, hk, d, causal, scale",
    [
        (2, 100, 100, 4, 4, 64, True, None),
        (1, 77, 130, 8, 2, 80, False, 0.5),
        (3, 33, 33, 6, 1, 128, True, 2.0),
        (1, 1, 65, 2, 1, 40, False, None),
        (2, 17, 17, 4, 2, 96, True, None),
    ],
)
def test_blockwise_reference_matches_fp64_attention_and_gradients(b, sq, sk, h, hk, d, causal, scale):
    q = torch.randn(b, sq, h, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = ringfa4.attention(q, k, v, causal=causal, softmax_scale=scale, backend="torch")
    ref_out, ref_lse = attention_fp64(q, k, v, causal=causal, softmax_scale=scale)
    assert lse.dtype == torch.float64 and lse.shape == (b, h, sq)
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    for name, g, r in zip("qkv", got, ref):
        assert (g - r).abs().max() < 1e-12, f"d{name}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_keep_their_dtype_with_fp32_lse(dtype):
    q, k, v = (torch.randn(2, 50, 4, 32).to(dtype).requires_grad_() for _ in range(3))
    out, lse = ringfa4.attention(q, k, v, causal=True, backend="torch")
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = attention_fp64(q, k, v, causal=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref_out).abs().max() < tol and (lse.double() - ref_lse).abs().max() < tol
    out.sum().backward()
    assert all(t.grad.dtype == dtype for t in (q, k, v))


def test_no_keys_gives_minus_infinite_lse_and_zero_output():
    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    k = v = torch.randn(1, 0, 2, 16, requires_grad=True)
    out, lse = ringfa4.attention(q, k, v, backend="torch")
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and not q.grad.isnan().any()


def test_given_gradient_buffers_receive_the_gradient_added_to_their_contents():
    q, k, v, dout = (torch.randn(1, 40, 2, 16, dtype=torch.float64) for _ in range(4))
    out, lse = torch_ref.forward(q, k, v, True, 0.25)
    fresh = torch_ref.backward(dout, q, k, v, out, lse, True, 0.25)
    bufs = [torch.ones_like(t, dtype=torch.float64) for t in (q, k, v)]
    summed = torch_ref.backward(dout, q, k, v, out, lse, True, 0.25, *bufs)
    for f, s, buf in zip(fresh, summed, bufs):
        assert s is buf and torch.allclose(s, f + 1, rtol=0, atol=1e-14)


def test_auto_backend_on_cpu_is_the_torch_reference(caplog):
    q = torch.randn(1, 8, 2, 16)
    with caplog.at_level("INFO", logger="ringfa4"):
        out, _ = ringfa4.attention(q, q, q, backend="auto")
    assert torch.equal(out, ringfa4.attention(q, q, q, backend="torch")[0])
    assert "'torch'" in caplog.text


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backends_backward(monkeypatch, deterministic):
    seen = []
    real = torch_ref.backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_ref, "backward", spy)
    q, k, v = (torch.randn(1, 64, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = ringfa4.attention(q, k, v, causal=True, backend="torch", deterministic=deterministic)
    out.sum().backward()
    assert seen == [deterministic]
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        ringfa4.attention(q, k, v, deterministic="yes")
