"""The sm90 CuTe forward kernel (backend "cute") against an fp64 reference, lse included.

Inputs are fresh random tensors each run (seed printed on failure). Error bound for out and for
lse: 2x the error of PyTorch doing the same computation in the input precision (fp16/bf16
matmuls, fp32 softmax) against the fp64 reference, plus 1e-4 absolute. Outputs given to the
kernel are poisoned with NaN first, so anything it does not write fails.
"""
import math
import random

import pytest
import torch

import ringfa4.backends.torch_ref as torch_ref

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
    import ringfa4.backends.cute as cute_backend
    from ringfa4.backends.cute import compile as kc
    from ringfa4.backends.cute.configs import fwd_variant
else:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")]

ATOL = 1e-4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fresh_seed():
    return random.SystemRandom().randrange(2**31)


def _inputs(b, sq, sk, h, hk, d, dtype, seed, seq_offset=0):
    """q, k, v; with seq_offset > 0 they are views into a longer sequence (non-contiguous in the
    sequence dim, the way ring steps slice chunks)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for s, n in ((sq, h), (sk, hk), (sk, hk)):
        full = torch.randn(b, s + seq_offset, n, d, device="cuda", dtype=torch.float32, generator=gen)
        out.append(full.to(dtype)[:, seq_offset:])
    return out


def _lowp_reference(q, k, v, causal, scale):
    """What PyTorch gets in the input precision: low-precision matmuls, fp32 softmax."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, vh).transpose(1, 2), lse


def _check(q, k, v, causal, scale, seed, out=None, lse=None, config=None):
    eff_scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref_out, ref_lse = torch_ref.forward(*(t.double() for t in (q, k, v)), causal, eff_scale)
    pt_out, pt_lse = _lowp_reference(q, k, v, causal, eff_scale)
    got_out, got_lse = cute_backend.forward(q, k, v, causal, scale, out=out, lse=lse, config=config)
    if out is not None:
        assert got_out is out and got_lse is lse
    assert got_out.dtype == q.dtype and got_out.shape == q.shape
    assert got_lse.dtype == torch.float32 and got_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    for name, got, pt, ref in (("out", got_out, pt_out, ref_out), ("lse", got_lse, pt_lse, ref_lse)):
        assert torch.isfinite(got).all(), f"{name} has non-finite values (seed={seed})"
        err = (got.double() - ref).abs().max().item()
        bound = 2 * (pt.double() - ref).abs().max().item() + ATOL
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (seed={seed})"


def _poisoned(q):
    b, sq, h, _ = q.shape
    out = torch.full_like(q, math.nan)
    lse = torch.full((b, h, sq), math.nan, device=q.device, dtype=torch.float32)
    return out, lse


# (b, sq, sk, h, hk, d, causal, scale)
SHAPES = [
    (2, 1000, 1000, 4, 4, 128, False, None),
    (2, 1000, 1000, 4, 4, 64, False, None),
    (1, 1, 1, 2, 2, 128, False, None),
    (3, 17, 17, 2, 1, 64, False, 0.3),
    (1, 4097, 4097, 2, 2, 128, False, None),
    (1, 4097, 4097, 3, 1, 64, False, None),  # MQA
    (2, 17, 1000, 8, 2, 128, False, None),  # GQA, sq < sk
    (2, 1000, 17, 8, 2, 64, False, 1.7),  # sq > sk
    (1, 4097, 300, 4, 4, 128, False, None),
    (1, 1, 1, 2, 2, 64, True, None),
    (2, 17, 17, 4, 2, 128, True, None),
    (2, 1000, 1000, 4, 4, 128, True, 0.2),
    (1, 1000, 1000, 6, 3, 64, True, None),
    (1, 4097, 4097, 2, 1, 128, True, None),
    (1, 4097, 4097, 2, 2, 64, True, None),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_hk{}_d{}_{}_{}".format(
    *s[:6], "causal" if s[6] else "full", s[7]))
def test_forward_matches_fp64_reference(shape, dtype):
    b, sq, sk, h, hk, d, causal, scale = shape
    seed = _fresh_seed()
    q, k, v = _inputs(b, sq, sk, h, hk, d, DTYPES[dtype], seed)
    out, lse = _poisoned(q)
    _check(q, k, v, causal, scale, seed, out=out, lse=lse)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_on_sequence_slices_of_longer_tensors(causal):
    """Ring steps hand the kernel chunk views: strided in the sequence dimension."""
    seed = _fresh_seed()
    q, k, v = _inputs(2, 777, 777, 4, 2, 128, torch.bfloat16, seed, seq_offset=300)
    assert not q.is_contiguous()
    _check(q, k, v, causal, None, seed)


def test_scores_with_large_spread_are_exact_under_conditional_rescale():
    """Keys whose scores grow along the sequence force real rescales; a row max that rises by
    less than the threshold must leave the result exact too."""
    seed = _fresh_seed()
    q, k, v = _inputs(1, 1000, 3000, 2, 2, 128, torch.bfloat16, seed)
    ramp = torch.linspace(0.0, 6.0, 3000, device="cuda")[None, :, None, None]
    k = (k.float() * ramp).to(torch.bfloat16)
    _check(q, k, v, False, None, seed)


# Every technique switch must keep results right, since the benchmark times each of them.
# 2 x 2000 x 8 heads is 256 query tiles: more than the 132 SMs, so persistent CTAs loop.
FLAG_VARIANTS = [
    dict(intra_wg_overlap=False),
    dict(pingpong=False),
    dict(intra_wg_overlap=False, pingpong=False),
    dict(rescale_threshold=None),
    dict(ex2_fma_per16=3),
    dict(ex2_fma_per16=16),
    dict(lpt=False),
    dict(lpt=True),
    dict(num_stages=3, tile_n=128),  # a third 176-key stage does not fit in shared memory
    dict(persistent=True, tile_n=128),  # nor do persistent CTAs' separate O buffer with 176 keys
    dict(tile_n=128),
    dict(tile_n=176),
    dict(tile_n=192),
    dict(persistent=False),
]


@pytest.mark.parametrize("flags", FLAG_VARIANTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("causal", [False, True])
def test_technique_switches_keep_results_exact(flags, causal):
    seed = _fresh_seed()
    q, k, v = _inputs(2, 2000, 2000, 8, 2, 128, torch.bfloat16, seed)
    out, lse = _poisoned(q)
    _check(q, k, v, causal, None, seed, out=out, lse=lse,
           config=fwd_variant("bf16", 128, causal, **flags))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas_running_many_tiles_each(d, causal):
    """7 CTAs for ~100 tiles: every CTA walks many tiles, reusing its Q/O buffers and carrying
    pipeline phases and the ping-pong barriers across tiles."""
    seed = _fresh_seed()
    q, k, v = _inputs(3, 1111, 1111, 4, 2, d, torch.bfloat16, seed)
    out, lse = _poisoned(q)
    # 128-key tiles: persistent CTAs' separate O buffer does not fit beside 176-key K/V stages.
    fn = kc.compile_variant(fwd_variant("bf16", d, causal, persistent=True, tile_n=128))
    fn(q, k, v, out, lse, d ** -0.5, 7)
    ref_out, ref_lse = torch_ref.forward(*(t.double() for t in (q, k, v)), causal, d ** -0.5)
    pt_out, pt_lse = _lowp_reference(q, k, v, causal, d ** -0.5)
    for name, got, pt, ref in (("out", out, pt_out, ref_out), ("lse", lse, pt_lse, ref_lse)):
        err = (got.double() - ref).abs().max().item()
        bound = 2 * (pt.double() - ref).abs().max().item() + ATOL
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (seed={seed})"


def test_new_sequence_lengths_reuse_the_compiled_kernel():
    seed = _fresh_seed()
    cute_backend.forward(*_inputs(1, 300, 300, 2, 2, 128, torch.bfloat16, seed), False, None)
    compiled = dict(kc._cache)
    for s in (1, 129, 2000):
        cute_backend.forward(*_inputs(3, s, s + 5, 4, 2, 128, torch.bfloat16, seed), False, None)
    assert kc._cache == compiled


def test_emulated_exp2_relative_error_is_below_1e4_on_device():
    """ex2_fma (Cody-Waite + degree-3 polynomial) measured in fp32 on the GPU over the range
    softmax feeds it, against float64 2**x."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from ringfa4.kernels.softmax import ex2_fma

    @cute.kernel
    def ex2_kernel(x: cute.Tensor, y: cute.Tensor):
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        if i < x.shape[0]:
            y[i] = ex2_fma(x[i])

    @cute.jit
    def run(x: cute.Tensor, y: cute.Tensor):
        ex2_kernel(x, y).launch(grid=[(x.shape[0] + 255) // 256, 1, 1], block=[256, 1, 1])

    x = torch.cat([
        torch.linspace(-126.0, 8.0, 1 << 20, device="cuda"),
        -torch.rand(1 << 20, device="cuda") * 30.0,
    ])
    y = torch.empty_like(x)
    xt, yt = from_dlpack(x, assumed_align=16), from_dlpack(y, assumed_align=16)
    cute.compile(run, xt, yt)(xt, yt)
    rel = ((y.double() - torch.exp2(x.double())) / torch.exp2(x.double())).abs().max().item()
    print(f"emulated exp2 max relative error on device: {rel:.3e}")
    assert rel <= 1e-4
