"""The sm90 CuTe backward kernel against fp64 autograd, on fresh random inputs.

Error bound for each gradient: 2x the error of PyTorch doing the same computation in the input
precision (fp16/bf16 matmuls, fp32 softmax) against fp64, plus 1e-4 absolute.
"""
import math
import os
import sys
from dataclasses import replace

import pytest
import torch

import ringfa4

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from reference import attention_fp64  # noqa: E402

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
    import ringfa4.backends.cute as cute_backend
    from ringfa4.backends.cute.configs import bwd_defaults, query_tile
    from ringfa4.backends.cute.launch import key_tile
    from ringfa4.backends.cute import query_rows as query_rows_module
    from ringfa4.backends.cute.query_rows import QueryRows, QueryState, padded_rows, query_rows
else:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")]


def _inputs(b, sq, sk, h, hk, d, dtype, seed, offset=0):
    """q, k, v, dout of the given shapes; with offset > 0 they are views into a longer sequence
    (non-contiguous in the sequence dim, as ring steps pass them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)):
        t = torch.randn(b, s + 2 * offset, n, d, device="cuda", generator=gen).to(dtype)
        out.append(t[:, offset:offset + s] if offset else t)
    return out


def _lowp_attention(q, k, v, causal, scale):
    """Attention as PyTorch computes it in the input precision: 16-bit matmuls, fp32 softmax."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          -math.inf)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _references(q, k, v, dout, causal, scale):
    """(out, lse, fp64 grads, low-precision PyTorch grads)."""
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    out64, lse64 = attention_fp64(*leaves, causal=causal, softmax_scale=scale)
    g64 = torch.autograd.grad(out64, leaves, dout.to(torch.float64))
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    glow = torch.autograd.grad(_lowp_attention(*low, causal, scale), low, dout)
    return out64.to(q.dtype), lse64.float(), g64, glow


def _assert_close(name, got, ref64, lowp):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref64).abs().max().item()
    bound = 2 * (lowp.double() - ref64).abs().max().item() + 1e-4
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


def _poison_allocator(*like):
    """Fill freed blocks of the caching allocator with NaN so that outputs the kernel fails to
    write show up as NaN."""
    blocks = [torch.full_like(t, math.nan) for t in like for _ in range(2)]
    del blocks


CASES = [
    # b, sq, sk, h, hk, d, causal, dtype
    (2, 1000, 1000, 4, 4, 128, False, torch.bfloat16),
    (2, 1000, 1000, 4, 4, 128, True, torch.bfloat16),
    (1, 777, 777, 4, 4, 64, True, torch.bfloat16),
    (2, 300, 555, 4, 4, 64, False, torch.bfloat16),
    (1, 513, 513, 8, 2, 128, True, torch.float16),
    (1, 640, 200, 6, 1, 64, False, torch.float16),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", CASES)
def test_gradients_match_fp64_reference(b, sq, sk, h, hk, d, causal, dtype):
    scale = 0.7 / math.sqrt(d)
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, dtype, seed=sq * 31 + d, offset=3 * (b + 1))
    out, lse, g64, glow = _references(q, k, v, dout, causal, scale)
    _poison_allocator(q, k, v, q.float())
    grads = cute_backend.backward(dout, q, k, v, out, lse, causal, scale)
    for name, got, r64, rlow, like in zip("dq dk dv".split(), grads, g64, glow, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        _assert_close(name, got, r64, rlow)


@pytest.mark.parametrize("b,s,h,hk,d,causal,deterministic,sms", [
    (1, 2048, 32, 8, 128, True, False, None), (1, 640, 6, 1, 64, False, False, None),
    (2, 1024, 8, 2, 128, False, False, None), (1, 2048, 32, 8, 128, True, True, None),
    (1, 8192, 4, 2, 64, True, True, None), (2, 2048, 32, 8, 128, True, True, 8)])
def test_query_heads_split_over_ctas_when_kv_blocks_are_few(b, s, h, hk, d, causal, deterministic, sms,
                                                            monkeypatch):
    """Few K/V blocks (or, deterministic, long causal keys): the query heads of a kv head are
    shared by several CTAs (asserted, so the case cannot drift out of the test) whose dK/dV sum
    in fp32; deterministic runs repeat bit for bit, over freed memory filled with NaN (the first
    share of each K/V block stores into sums nobody zeroed: dkv_fresh), and given fp32 buffers
    receive the sum added. ``sms``: the SM count the backend is told, so that a small batch makes
    a grid as deep as deterministic mode's two query heads per CTA need (head_splits 2,
    tests/test_kernels_compile.py)."""
    if sms is not None:
        monkeypatch.setattr(cute_backend.interface, "_sms", lambda t: sms)
    splits = cute_backend.interface.head_splits(
        b, s, s, h, hk, d, causal, deterministic, sms or torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits > 1
    scale = d ** -0.5
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=s + h)
    out, lse, g64, glow = _references(q, k, v, dout, causal, scale)
    like = (q, k, v, q.float(), torch.stack((k, v)).float())  # the shares' sums: (2, b, s, hk, d) fp32
    _poison_allocator(*like)
    first = cute_backend.backward(dout, q, k, v, out, lse, causal, scale, deterministic=deterministic)
    assert len({t.untyped_storage().data_ptr() for t in first}) == 3, "dq, dk, dv must not share storage"
    for name, got, r64, rlow in zip("dq dk dv".split(), first, g64, glow):
        _assert_close(name, got, r64, rlow)
    init = [torch.randn(t.shape, device="cuda") for t in (k, v)]
    bufs = [t.clone() for t in init]
    again = cute_backend.backward(dout, q, k, v, out, lse, causal, scale, None, *bufs,
                                  deterministic=deterministic)
    for name, got, buf, i, r64, rlow in zip(("dk", "dv"), again[1:], bufs, init, g64[1:], glow[1:]):
        assert got is buf, f"{name}: the given buffer must be returned"
        _assert_close(name, buf - i, r64, rlow)
    if deterministic:
        _poison_allocator(*like)
        for name, a, c in zip("dq dk dv".split(), first, cute_backend.backward(
                dout, q, k, v, out, lse, causal, scale, deterministic=True)):
            assert torch.equal(a, c), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("deterministic", [False, True])
def test_postprocess_writes_split_shares_dk_dv_as_the_cast_of_their_sums(deterministic):
    """Split heads and new dk, dv: the dQ postprocess also writes the shares' fp32 sums in bf16
    (DqPostprocessConfig.cast_sums), over memory filled with NaN, so every element must be
    written; deterministic, the bits are those of the same sums added into given fp32 buffers
    and cast by torch."""
    b, s, h, hk, d = 1, 2000, 32, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cute_backend.interface.head_splits(b, s, s, h, hk, d, True, deterministic, sms) > 1
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=31)
    out, lse, g64, glow = _references(q, k, v, dout, True, d ** -0.5)
    _poison_allocator(q, k, v, q.float(), torch.stack((k, v)).float())
    dq, dk, dv = cute_backend.backward(dout, q, k, v, out, lse, True, None, deterministic=deterministic)
    for name, got, r64, rlow in zip("dq dk dv".split(), (dq, dk, dv), g64, glow):
        _assert_close(name, got, r64, rlow)
    if deterministic:
        sums = [torch.zeros(t.shape, device="cuda") for t in (k, v)]
        cute_backend.backward(dout, q, k, v, out, lse, True, None, None, *sums, deterministic=True)
        for name, got, summed in zip(("dk", "dv"), (dk, dv), sums):
            assert torch.equal(got, summed.to(got.dtype)), f"{name} differs from its fp32 sums cast"


@pytest.mark.parametrize("b,s,h,hk,d", [(2, 2000, 16, 8, 128), (1, 7000, 4, 2, 64), (1, 5000, 16, 8, 64)])
def test_cluster_shares_give_the_bits_of_the_ordered_fp32_sums(b, s, h, hk, d, monkeypatch):
    """Deterministic causal split heads written in dtype: the head_splits CTAs of a (K/V block,
    kv head) sum their dK/dV shares within a cluster (BwdSm90Config.cluster_shares), in the
    order the fp32 reduce-adds take, so the bits equal those of the fp32 sums cast afterwards;
    over memory filled with NaN, so every element must be written (the last block's rows past
    seqlen_k are not)."""
    splits = cute_backend.interface.head_splits(
        b, s, s, h, hk, d, True, True, torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits in cute_backend.interface.CLUSTER_SHARES
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=s + d)
    out, lse, g64, glow = _references(q, k, v, dout, True, d ** -0.5)
    _poison_allocator(q, k, v, q.float())
    clustered = cute_backend.backward(dout, q, k, v, out, lse, True, None, deterministic=True)
    monkeypatch.setattr(cute_backend.interface, "CLUSTER_SHARES", ())
    summed = cute_backend.backward(dout, q, k, v, out, lse, True, None, deterministic=True)
    for name, a, c, r64, rlow in zip("dq dk dv".split(), clustered, summed, g64, glow):
        assert torch.equal(a, c), f"{name}: the cluster's sum differs from the fp32 sums'"
        _assert_close(name, a, r64, rlow)


@pytest.mark.parametrize("staggered,dq_warp_per_part,dq_warps_meet",
                         [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
                         ids=["lockstep", "staggered", "staggered-dqwarp2", "staggered-dqwarp2-meet"])
@pytest.mark.parametrize("b,s,h,hk,d,causal,deterministic", [
    (2, 1000, 4, 2, 128, True, False), (1, 777, 4, 4, 64, True, False), (2, 555, 4, 4, 64, False, False),
    (1, 1500, 8, 2, 64, True, True), (1, 2048, 32, 8, 128, True, False), (1, 1000, 8, 2, 128, False, True)])
def test_warp_groups_in_lockstep_or_staggered_match_fp64(monkeypatch, staggered, dq_warp_per_part, dq_warps_meet,
                                                          b, s, h, hk, d, causal, deterministic):
    """The MMA warp groups meeting at every step or a dQ product apart, their dQ parts reduced by
    one dQ warp or one each, the two meeting every step or not (BwdSm90Config.staggered,
    .dq_warp_per_part, .dq_warps_meet forced), short and ragged walks, GQA, split heads,
    deterministic bits run to run."""
    defaults = cute_backend.interface.bwd_defaults
    monkeypatch.setattr(cute_backend.interface, "bwd_defaults",
                        lambda *args: replace(defaults(*args), staggered=staggered,
                                              dq_warp_per_part=dq_warp_per_part, dq_warps_meet=dq_warps_meet))
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=s + d)
    out, lse, g64, glow = _references(q, k, v, dout, causal, d ** -0.5)
    _poison_allocator(q, k, v, q.float())
    grads = cute_backend.backward(dout, q, k, v, out, lse, causal, None, deterministic=deterministic)
    for name, got, r64, rlow in zip("dq dk dv".split(), grads, g64, glow):
        _assert_close(name, got, r64, rlow)
    if deterministic:
        again = cute_backend.backward(dout, q, k, v, out, lse, causal, None, deterministic=True)
        for name, a, c in zip("dq dk dv".split(), grads, again):
            assert torch.equal(a, c), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("b,sq,sk,h,hk", [(2, 1000, 1024, 4, 2), (1, 2048, 4096, 32, 8)])
def test_keys_in_whole_blocks_skip_the_mask_with_the_same_dk_dv(monkeypatch, b, sq, sk, h, hk):
    """Not causal, with seqlen_k a whole number of K/V blocks the kernel has no key mask
    (BwdSm90Config.whole_keys): the masked variant's dK, dV bit for bit, all against fp64."""
    d = 128
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed=sq + h)
    out, lse, g64, glow = _references(q, k, v, dout, False, d ** -0.5)
    _poison_allocator(q, k, v, q.float())
    assert cute_backend.interface.bwd_defaults("bf16", d, False, False, False, False, True).whole_keys
    unmasked = cute_backend.backward(dout, q, k, v, out, lse, False, None)
    for name, got, r64, rlow in zip("dq dk dv".split(), unmasked, g64, glow):
        _assert_close(name, got, r64, rlow)
    defaults = cute_backend.interface.bwd_defaults
    monkeypatch.setattr(cute_backend.interface, "bwd_defaults",
                        lambda *args: replace(defaults(*args), whole_keys=False))
    masked = cute_backend.backward(dout, q, k, v, out, lse, False, None)
    for name, a, c in zip(("dk", "dv"), unmasked[1:], masked[1:]):
        assert torch.equal(a, c), name


@pytest.mark.parametrize("lpt", [False, True], ids=["grid_order", "longest_first"])
def test_causal_launch_orders_give_the_same_gradients(monkeypatch, lpt):
    """Both launch orders of the causal backward (interface.launches_lpt forced), with a batch of
    two and the query heads split over CTAs, against fp64."""
    b, s, h, hk, d = 2, 1000, 8, 2, 128
    assert cute_backend.interface.head_splits(b, s, s, h, hk, d, True, False, 132) > 1
    monkeypatch.setattr(cute_backend.interface, "launches_lpt", lambda *args: lpt)
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=5)
    out, lse, g64, glow = _references(q, k, v, dout, True, d ** -0.5)
    _poison_allocator(q, k, v, q.float())
    grads = cute_backend.backward(dout, q, k, v, out, lse, True, None)
    for name, got, r64, rlow in zip("dq dk dv".split(), grads, g64, glow):
        _assert_close(name, got, r64, rlow)


def test_rows_with_no_visible_key_contribute_zero():
    """lse = -inf (and out = 0) rows, as the ring produces for a query chunk that sees none of
    a KV block, give zero dq and leave dk, dv as if their dout were zero."""
    b, s, h, d = 1, 384, 2, 128
    q, k, v, dout = _inputs(b, s, s, h, h, d, torch.bfloat16, seed=7)
    dead = torch.zeros(s, dtype=torch.bool, device="cuda")
    dead[100:250] = True
    out, lse, _, _ = _references(q, k, v, dout, False, d ** -0.5)
    out[:, dead] = 0
    lse[:, :, dead] = -math.inf
    live_dout = dout.masked_fill(dead[None, :, None, None], 0)
    _, _, g64, glow = _references(q, k, v, live_dout, False, d ** -0.5)
    dq, dk, dv = cute_backend.backward(dout, q, k, v, out, lse, False, d ** -0.5)
    assert (dq[:, dead] == 0).all()
    _assert_close("dq", dq, g64[0], glow[0])
    _assert_close("dk", dk, g64[1], glow[1])
    _assert_close("dv", dv, g64[2], glow[2])


@pytest.mark.parametrize("causal,sq,sk,hk,d,groups", [
    (True, 1536, 1536, 4, 128, 0),
    (False, 1536, 1536, 2, 128, 1),  # 12 K/V blocks walk 24 query tiles from staggered starts
    (False, 1536, 1536, 4, 64, 1),   # as many K/V blocks as query tiles
    (False, 300, 2000, 2, 128, 1),   # more K/V blocks than query tiles: walks share starts
    (False, 200, 9000, 2, 128, 0),   # 71 K/V blocks, more than half an H100's or H200's SMs
    (False, 4608, 9000, 2, 64, 2),   # the same at head dim 64: groups of 36 and 35 walk 36 tiles
    (False, 300, 20000, 2, 64, 0),   # 157 K/V blocks: more than two groups, so not rotated
])
def test_deterministic_mode_is_bit_identical_run_to_run(causal, sq, sk, hk, d, groups):
    """Rotated walks (in ``groups`` groups; 0: not rotated) give gradients within bf16 of fp64
    and the same bits in two runs, each over freed memory filled with NaN: a dQ tile's first
    reduction stores into an accumulator nobody zeroed (dq_fresh)."""
    b, h = 2, 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    in_groups = bwd_defaults("bf16", d, causal, True, False).rotate_groups
    group = cute_backend.interface.rotation_group(sk, causal, True, sms, in_groups)
    blocks = -(-sk // key_tile())
    assert (-(-blocks // group) if group else 0) == groups
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed=11)
    out, lse, g64, glow = _references(q, k, v, dout, causal, d ** -0.5)
    runs = []
    for _ in range(2):
        _poison_allocator(q, k, v, q.float())
        runs.append(cute_backend.backward(dout, q, k, v, out, lse, causal, d ** -0.5, deterministic=True))
    for name, a, c, r64, rlow in zip("dq dk dv".split(), *runs, g64, glow):
        assert torch.equal(a, c), f"{name} differs between two deterministic runs"
        _assert_close(name, a, r64, rlow)


@pytest.mark.parametrize("deterministic", [False, True])
def test_fp32_buffers_receive_gradients_added(deterministic):
    b, s, h, hk, d = 1, 700, 4, 2, 64
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=5)
    out, lse, g64, glow = _references(q, k, v, dout, True, d ** -0.5)
    init = [torch.randn(t.shape, device="cuda") for t in (q, k, v)]
    bufs = [t.clone() for t in init]
    res = cute_backend.backward(dout, q, k, v, out, lse, True, d ** -0.5, *bufs,
                            deterministic=deterministic)
    for name, r, buf, i, r64, rlow in zip("dq dk dv".split(), res, bufs, init, g64, glow):
        assert r is buf, f"{name}: the given buffer must be returned"
        _assert_close(name, buf - i, r64, rlow)


def test_backward_with_merged_lse_over_two_kv_halves_equals_full_backward():
    """A ring step's backward uses the global lse: summing the per-half gradients (dq) and
    concatenating them (dk, dv) must give the gradient of attention over all keys."""
    b, sq, sk, h, d = 2, 512, 1024, 4, 128
    scale = d ** -0.5
    q, k, v, dout = _inputs(b, sq, sk, h, h, d, torch.bfloat16, seed=3)
    out, lse, g64, glow = _references(q, k, v, dout, False, scale)
    half = sk // 2
    # The global lse merged from the two halves' own lse, as the ring merges it.
    _, lse_a, _, _ = _references(q, k[:, :half], v[:, :half], dout, False, scale)
    _, lse_b, _, _ = _references(q, k[:, half:], v[:, half:], dout, False, scale)
    merged = torch.logaddexp(lse_a, lse_b)
    dq = torch.zeros(q.shape, device="cuda")
    dk = torch.zeros(k.shape, device="cuda")
    dv = torch.zeros(v.shape, device="cuda")
    for sl in (slice(0, half), slice(half, sk)):
        cute_backend.backward(dout, q, k[:, sl], v[:, sl], out, merged, False, scale,
                          dq, dk[:, sl], dv[:, sl])
    _assert_close("dq", dq, g64[0], glow[0])
    _assert_close("dk", dk, g64[1], glow[1])
    _assert_close("dv", dv, g64[2], glow[2])


@pytest.mark.parametrize("deterministic", [False, True])
def test_query_state_sums_calls_over_row_chunks_like_one_backward(deterministic):
    """The ring's use of a QueryState: calls over (query chunk, key half) pieces, with the global
    lse, add into one accumulator; its dq() and the pieces' dk, dv sums are the full gradient.
    600 rows end in a partial query tile; the poisoned allocator shows any accumulator or dq
    element left unzeroed or unwritten, in both modes."""
    b, sq, sk, h, hk, d = 2, 600, 1024, 4, 2, 128
    scale = 0.1
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed=13, offset=8)
    out, lse, g64, glow = _references(q, k, v, dout, False, scale)
    _poison_allocator(q, k, v)
    state = QueryState(dout, q, out, lse, scale)
    tile_m = state.tile_m
    dk = torch.zeros(k.shape, device="cuda")
    dv = torch.zeros(v.shape, device="cuda")
    split = 4 * tile_m
    pieces = [(slice(0, split), slice(0, sk)), (slice(split, sq), slice(0, 512)),
              (slice(split, sq), slice(512, sk))]
    for rows, keys in pieces:
        got = cute_backend.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                lse[:, :, rows], False, scale, state.rows(rows), dk[:, keys],
                                dv[:, keys], deterministic=deterministic)
        assert isinstance(got[0], QueryRows)
    dq = state.dq()
    assert dq.dtype == q.dtype and dq.shape == q.shape
    _assert_close("dq", dq, g64[0], glow[0])
    _assert_close("dk", dk, g64[1], glow[1])
    _assert_close("dv", dv, g64[2], glow[2])


@pytest.mark.parametrize("in_kernel", [True, False], ids=["preprocess", "memset"])
@pytest.mark.parametrize("b,s,h,hk,d", [(2, 1000, 4, 2, 128), (1, 300, 6, 3, 64)])
def test_preprocess_zeroes_the_accumulator_sums_and_counters_it_allocates(b, s, h, hk, d, in_kernel, monkeypatch):
    """query_rows' one allocation (lse2, delta, turn counters, dQ accumulator, dK/dV sums) taken
    from a block of NaN: the preprocess (or, past FLAT_MAX elements, a memset) leaves no element
    of the counters, the accumulator or the sums unzeroed; without zeroing (dq_fresh calls) the
    counters are zeroed and the NaN is still in the rest, so the poison did land."""
    if not in_kernel:
        monkeypatch.setattr(query_rows_module, "FLAT_MAX", 0)
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, seed=21)
    out, lse = cute_backend.forward(q, k, v, False, None)
    padded = padded_rows(s, query_tile(d))
    n_counters = 7  # not a multiple of 4: the accumulator after them stays 16-byte aligned
    flat = 2 * b * h * padded + 8 + b * h * padded * d + 2 * k.numel()
    for zeroed in (False, True):
        poison = torch.full((flat,), math.nan, device="cuda")
        del poison
        rows, sums, counters = query_rows(dout, out, lse, d ** -0.5, zeroed=zeroed, sums_shape=(2, *k.shape),
                                          counters=n_counters)
        assert sums.shape == (2, *k.shape) and rows.dq_acc.shape == (b, h, padded * d)
        assert counters.dtype == torch.int32 and counters.shape == (n_counters,)
        assert rows.dq_acc.data_ptr() % 16 == 0 and sums.data_ptr() % 16 == 0
        assert torch.count_nonzero(counters) == 0
        if zeroed:
            assert torch.count_nonzero(rows.dq_acc) == 0 and torch.count_nonzero(sums) == 0
        else:
            assert rows.dq_acc.isnan().all() and sums.isnan().all(), "the NaN block was not reused"
        # delta's rows lie in the stats order within each tile, pad rows 0: compare them sorted
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2) * d ** -0.5
        delta = torch.nn.functional.pad(delta, (0, padded - s))
        assert torch.allclose(rows.delta.sort(-1).values, delta.sort(-1).values, rtol=1e-5, atol=1e-5)


def test_query_state_refuses_rows_off_its_tiles_and_another_scale():
    q, k, v, dout = _inputs(1, 300, 300, 2, 2, 128, torch.bfloat16, seed=2)
    out, lse, _, _ = _references(q, k, v, dout, False, 0.1)
    state = QueryState(dout, q, out, lse, 0.1)
    for bad in (slice(10, 300), slice(0, 100), slice(0, 300, 2), slice(64, 64)):
        with pytest.raises(ValueError, match="rows must be"):
            state.rows(bad)
    with pytest.raises(ValueError, match="softmax_scale"):
        cute_backend.backward(dout, q, k, v, out, lse, False, 0.2, state.rows(slice(0, 300)))


def test_inputs_the_kernels_cannot_take_are_refused_with_the_argument_named():
    """ringfa4.attention checks once per call (the backend then trusts its arguments)."""
    q, k, v, _ = _inputs(1, 128, 128, 2, 2, 128, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="head_dim"):
        ringfa4.attention(q[..., :96], k[..., :96], v[..., :96], backend="cute")
    with pytest.raises(ValueError, match="causal"):
        ringfa4.attention(q, k[:, :64], v[:, :64], causal=True, backend="cute")
    with pytest.raises(TypeError, match="k.dtype"):
        ringfa4.attention(q, k.float(), v, backend="cute")


# ---------------------------------------------------------------- packed documents (doc_ids)
def _ids(lengths):
    """Document ids of rows made of documents of these lengths, on the GPU."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths)).cuda()


def _tiny_documents(total, seed):
    """Documents of 1 to 8 rows filling ``total``."""
    gen, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, 9, (), generator=gen)), total - sum(lengths)))
    return lengths


def _lowp_documents(q, k, v, causal, scale, q_ids, k_ids):
    """_lowp_attention with documents; rows that see no key give out = 0 and no gradient."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    hidden = (q_ids[:, :, None] != k_ids[:, None, :])[:, None]
    if causal:
        hidden = hidden | torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    empty = hidden.all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(hidden & ~empty, -math.inf), dim=-1) * ~empty
    return torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), v)


def _document_references(q, k, v, dout, causal, scale, doc_ids):
    """(out, lse, fp64 grads from the exact torch reference, low-precision PyTorch grads)."""
    import ringfa4.backends.torch_ref as torch_ref

    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    out64, lse64 = torch_ref.forward(q64, k64, v64, causal, scale, doc_ids=doc_ids)
    g64 = torch_ref.backward(do64, q64, k64, v64, out64, lse64, causal, scale, doc_ids=doc_ids)
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    glow = torch.autograd.grad(_lowp_documents(*low, causal, scale, *doc_ids), low, dout)
    return out64.to(q.dtype), lse64.float(), g64, glow


# Documents of one sequence, per batch row (lengths sum to s). Backward tiles: 128 keys, 128
# (d64) or 64 (d128) queries; the edge cases put boundaries on both.
DOCUMENTS = {
    "length_1": lambda s: [[1, 1, 1, s - 5, 1, 1], [1] * 3 + [s - 3]],
    "on_tile_edges": lambda s: [[64, 64, 128, 256, 192, 384, s - 1088], [320, 128, s - 448]],
    "tiny": lambda s: [_tiny_documents(s, 1), _tiny_documents(s, 2)],
    "mixed": lambda s: [[700, 1, 35, 300, s - 1036], [s // 2, s - s // 2]],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("docs", list(DOCUMENTS))
def test_gradients_with_documents_match_fp64_reference(docs, causal, d, dtype):
    s, scale = 1500, 0.7 / math.sqrt(d)
    q, k, v, dout = _inputs(2, s, s, 4, 2, d, dtype, seed=len(docs) * 7 + d, offset=5)
    ids = torch.stack([_ids(row) for row in DOCUMENTS[docs](s)])
    out, lse, g64, glow = _document_references(q, k, v, dout, causal, scale, (ids, ids))
    _poison_allocator(q, k, v, q.float())
    grads = cute_backend.backward(dout, q, k, v, out, lse, causal, scale, doc_ids=(ids, ids))
    for name, got, r64, rlow, like in zip("dq dk dv".split(), grads, g64, glow, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        _assert_close(name, got, r64, rlow)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_documents_on_a_ring_step_give_zero_where_nothing_is_seen(d, deterministic):
    """A non-causal ring step: queries of documents 0, 1, 4 against keys of documents 1..4.
    Query rows of document 0 get dq = 0; keys 100..699 (documents 2, 3) no query sees get
    dk = dv = 0, so fp32 buffers given for them keep their values exactly."""
    scale = d ** -0.5
    q, k, v, dout = _inputs(1, 900, 1300, 4, 2, d, torch.bfloat16, seed=d + deterministic)
    doc_ids = (_ids([200, 300, 0, 0, 400])[None], _ids([0, 100, 300, 300, 600])[None])
    out, lse, g64, glow = _document_references(q, k, v, dout, False, scale, doc_ids)
    assert (lse[:, :, :200] == -math.inf).all()
    init = [torch.randn(t.shape, device="cuda") for t in (k, v)]
    bufs = [t.clone() for t in init]
    dq, dk, dv = cute_backend.backward(dout, q, k, v, out, lse, False, scale, None, *bufs,
                                       deterministic=deterministic, doc_ids=doc_ids)
    assert (dq[:, :200] == 0).all()
    for name, got, i, r64, rlow in (("dk", dk, init[0], g64[1], glow[1]),
                                    ("dv", dv, init[1], g64[2], glow[2])):
        assert torch.equal(got[:, 100:700], i[:, 100:700]), f"{name} of keys no query sees"
        _assert_close(name, got - i, r64, rlow)
    _assert_close("dq", dq, g64[0], glow[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_with_one_document_are_dense_bit_for_bit(d, causal):
    """Deterministic mode (a fixed order of the dQ reductions) so that bits can be compared."""
    q, k, v, dout = _inputs(2, 1111, 1111, 4, 2, d, torch.bfloat16, seed=3)
    out, lse, _, _ = _references(q, k, v, dout, causal, d ** -0.5)
    ids = torch.zeros((2, 1111), dtype=torch.int32, device="cuda")
    dense = cute_backend.backward(dout, q, k, v, out, lse, causal, None, deterministic=True)
    one = cute_backend.backward(dout, q, k, v, out, lse, causal, None, deterministic=True,
                                doc_ids=(ids, ids))
    for name, a, b in zip("dq dk dv".split(), dense, one):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_with_documents_is_bit_identical_run_to_run(causal):
    b, s, h, d = 2, 1536, 4, 128
    q, k, v, dout = _inputs(b, s, s, h, 2, d, torch.bfloat16, seed=13)
    ids = torch.stack([_ids([1, 127, 300, 500, 608]), _ids(_tiny_documents(s, 3))])
    out, lse, g64, glow = _document_references(q, k, v, dout, causal, d ** -0.5, (ids, ids))
    runs = [cute_backend.backward(dout, q, k, v, out, lse, causal, d ** -0.5, deterministic=True,
                                  doc_ids=(ids, ids)) for _ in range(2)]
    for name, a, c, r64, rlow in zip("dq dk dv".split(), *runs, g64, glow):
        assert torch.equal(a, c), f"{name} differs between two deterministic runs"
        _assert_close(name, a, r64, rlow)
