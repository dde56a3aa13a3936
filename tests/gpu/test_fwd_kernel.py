"""The sm90 CuTe forward kernel (backend "cute") against an fp64 reference, lse included.

Inputs are fresh random tensors each run (seed printed on failure). Error bound for out and for
lse: 2x the error of PyTorch doing the same computation in the input precision (fp16/bf16
matmuls, fp32 softmax) against the fp64 reference, plus 1e-4 absolute. Outputs given to the
kernel are poisoned with NaN first, so anything it does not write fails.
"""
import collections
import math
import random

import pytest
import torch

import ringfa4.backends.torch_ref as torch_ref

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
    import ringfa4.backends.cute as cute_backend
    from ringfa4.backends.cute import compile as kc
    from ringfa4.backends.cute import interface
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


@pytest.mark.parametrize("ramp", [(0.0, 6.0), (6.0, 0.0)], ids=["rising", "falling"])
@pytest.mark.parametrize("d", [64, 128])
def test_scores_with_large_spread_are_exact_under_conditional_rescale(d, ramp):
    """Keys whose scores grow or shrink along the sequence (blocks run last to first: falling
    keys raise the row max block after block) force real rescales, at head dim 64 with the wait
    for P V inside the rescale's branches; a row max that rises by less than the threshold must
    leave the result exact too."""
    seed = _fresh_seed()
    q, k, v = _inputs(1, 1000, 3000, 2, 2, d, torch.bfloat16, seed)
    k = (k.float() * torch.linspace(*ramp, 3000, device="cuda")[None, :, None, None]).to(torch.bfloat16)
    _check(q, k, v, False, None, seed)


# Every technique switch must keep results right, since the benchmark times each of them.
# 2 x 2000 x 8 heads is 256 query tiles: more than the 132 SMs, so persistent CTAs loop.
FLAG_VARIANTS = [
    dict(intra_wg_overlap=False),
    dict(pingpong=False),
    dict(intra_wg_overlap=False, pingpong=False),
    dict(rescale_threshold=None),
    dict(late_pv_wait=True),
    dict(late_pv_wait=True, rescale_threshold=None),
    dict(ex2_fma_per16=3),
    dict(ex2_fma_per16=16),
    dict(lpt=False),
    dict(lpt=True),
    dict(num_stages=3, tile_n=128),  # a third 176-key stage does not fit in shared memory
    dict(persistent=True, tile_n=128),  # nor do persistent CTAs' separate O buffer with 176 keys
    dict(persistent=True, tile_n=160),  # the short non-causal default above 1k keys: a ragged last block
    dict(tile_n=128),
    dict(tile_n=176),
    dict(tile_n=192),
    dict(persistent=False),
    dict(pack_gqa=4),
    dict(pack_gqa=4, intra_wg_overlap=False),
    dict(pack_gqa=4, persistent=True, tile_n=128),
]


@pytest.mark.parametrize("flags", FLAG_VARIANTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("causal", [False, True])
def test_technique_switches_keep_results_exact(flags, causal):
    seed = _fresh_seed()
    q, k, v = _inputs(2, 2000, 2000, 8, 2, 128, torch.bfloat16, seed)
    out, lse = _poisoned(q)
    _check(q, k, v, causal, None, seed, out=out, lse=lse,
           config=fwd_variant("bf16", 128, causal, **flags))


# (b, sq, sk, h, hk, d, causal): groups of 2 to 8 heads per kv head, 3 and 6 too (192-row tiles
# hold 64 or 32 positions of them), ragged lengths and a query block shorter than one tile.
PACKED_GQA_SHAPES = [
    (2, 1000, 1000, 8, 2, 64, True),
    (1, 4097, 4097, 16, 2, 128, True),
    (2, 17, 1000, 12, 4, 64, False),
    (1, 3000, 3000, 32, 4, 128, False),
    (3, 333, 333, 6, 1, 64, True),
    (2, 1000, 17, 4, 2, 128, False),
]


@pytest.mark.parametrize("shape", PACKED_GQA_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_hk{}_d{}_{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_packed_gqa_tiles_match_fp64_reference(shape):
    """Tiles whose rows are (position, query head) pairs of one kv head: the causal mask and
    the lse rows follow each row's position and head."""
    b, sq, sk, h, hk, d, causal = shape
    seed = _fresh_seed()
    q, k, v = _inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed)
    out, lse = _poisoned(q)
    _check(q, k, v, causal, None, seed, out=out, lse=lse,
           config=fwd_variant("bf16", d, causal, pack_gqa=h // hk))


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
    fn(q, k, v, out, lse, None, None, None, d ** -0.5, 7)  # no documents: no key ranges, no host order
    ref_out, ref_lse = torch_ref.forward(*(t.double() for t in (q, k, v)), causal, d ** -0.5)
    pt_out, pt_lse = _lowp_reference(q, k, v, causal, d ** -0.5)
    for name, got, pt, ref in (("out", out, pt_out, ref_out), ("lse", lse, pt_lse, ref_lse)):
        err = (got.double() - ref).abs().max().item()
        bound = 2 * (pt.double() - ref).abs().max().item() + ATOL
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (seed={seed})"


@pytest.mark.parametrize("d", [64, 128])
def test_persistent_ctas_in_the_hosts_tile_order_compute_every_causal_tile_once(d):
    """Causal, no documents, persistent CTAs dealt tiles in interface.tile_order (the default
    for short walks), several rounds of tiles per CTA: against fp64 and bit for bit the
    launch-order kernel's."""
    seed = _fresh_seed()
    q, k, v = _inputs(3, 1111, 1111, 8, 2, d, torch.bfloat16, seed)
    out, lse = _poisoned(q)
    config = fwd_variant("bf16", d, True, persistent=True, tile_order=True, tile_n=128)
    _check(q, k, v, True, None, seed, out=out, lse=lse, config=config)
    launch = cute_backend.forward(q, k, v, True, None, config=fwd_variant("bf16", d, True, tile_n=128))
    assert torch.equal(out, launch[0]) and torch.equal(lse, launch[1])


def test_a_causal_forward_captured_before_its_tile_order_exists_runs_the_launch_order(monkeypatch):
    """Making a shape's host tile order reads sizes back from the GPU, which CUDA graph capture
    forbids: a forward first met under capture runs the launch order instead (the same bits),
    and an eager call after it makes and keeps the order; a graph captured then runs in that
    order, which is held for the graph's sake. All give the launch-order kernel's bits."""
    from dataclasses import replace

    seed = _fresh_seed()
    q, k, v = _inputs(2, 1500, 1500, 8, 2, 128, torch.bfloat16, seed)
    config = interface.forward_config(q, k, True)
    assert config.tile_order
    launch = cute_backend.forward(q, k, v, True, None, config=replace(config, persistent=False, tile_order=False))
    cute_backend.forward(*_inputs(1, 200, 200, 8, 2, 128, torch.bfloat16, seed), True, None)  # compiled eagerly
    monkeypatch.setattr(interface, "_dense_orders", collections.OrderedDict())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cute_backend.forward(q, k, v, True, None)
    assert not interface._dense_orders
    eager = cute_backend.forward(q, k, v, True, None)
    (order,) = interface._dense_orders.values()
    graph.replay()
    ordered = torch.cuda.CUDAGraph()  # now the order exists: captured with it, and held for good
    with torch.cuda.graph(ordered):
        captured_ordered = cute_backend.forward(q, k, v, True, None)
    assert any(held is order for held in interface._graph_held)
    ordered.replay()
    torch.cuda.synchronize()
    for name, (out, lse) in (("eager", eager), ("replayed", captured), ("replayed in order", captured_ordered)):
        assert torch.equal(out, launch[0]) and torch.equal(lse, launch[1]), name


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


# ---------------------------------------------------------------- packed documents (doc_ids)
def _ids(lengths):
    """Document ids of rows made of documents of these lengths, on the GPU."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths)).cuda()


def _tiny_documents(total, seed):
    """Documents of 1 to 8 rows filling ``total``."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(1, 8), total - sum(lengths)))
    return lengths


def _lowp_documents(q, k, v, causal, scale, q_ids, k_ids):
    """_lowp_reference with documents; rows that see nothing give NaN here and are not compared."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
    hidden = (q_ids[:, :, None] != k_ids[:, None, :])[:, None]
    if causal:
        hidden = hidden | torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    s = s.masked_fill(hidden, -math.inf)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, vh).transpose(1, 2), torch.logsumexp(s, dim=-1)


def _check_documents(q, k, v, causal, q_ids, k_ids, seed, config=None):
    """cute with doc_ids (outputs poisoned with NaN) against fp64: rows that see a key within the
    bound, rows that see none exactly out = 0 and lse = -inf."""
    scale = q.shape[-1] ** -0.5
    out, lse = _poisoned(q)
    cute_backend.forward(q, k, v, causal, scale, out=out, lse=lse, config=config,
                         doc_ids=(q_ids, k_ids))
    ref_out, ref_lse = torch_ref.forward(*(t.double() for t in (q, k, v)), causal, scale,
                                         doc_ids=(q_ids, k_ids))
    pt_out, pt_lse = _lowp_documents(q, k, v, causal, scale, q_ids, k_ids)
    seen = ref_lse > -math.inf  # (b, h, sq)
    assert not out.isnan().any() and not lse.isnan().any(), f"unwritten outputs (seed={seed})"
    assert (lse[~seen] == -math.inf).all(), f"lse of rows that see nothing (seed={seed})"
    assert (out.transpose(1, 2)[~seen] == 0).all(), f"out of rows that see nothing (seed={seed})"
    seen_out = seen.transpose(1, 2)  # (b, sq, h)
    for name, got, pt, ref, rows in (("out", out, pt_out, ref_out, seen_out),
                                     ("lse", lse, pt_lse, ref_lse, seen)):
        if not rows.any():
            continue
        err = (got.double() - ref)[rows].abs().max().item()
        bound = 2 * (pt.double() - ref)[rows].abs().max().item() + ATOL
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (seed={seed})"


# Documents of one sequence, per batch row (lengths sum to s). The default tiles: d128 causal
# 128 x 128, d128 full 128 x 176, d64 192 x 128; the edge cases put boundaries on those.
DOCUMENTS = {
    "length_1": lambda s: [[1, 1, 1, s - 5, 1, 1], [1] * 3 + [s - 3]],
    "on_tile_edges": lambda s: [[128, 128, 176, 176, 192, 384, s - 1184], [352, 128, s - 480]],
    "tiny": lambda s: [_tiny_documents(s, 1), _tiny_documents(s, 2)],
    "mixed": lambda s: [[700, 1, 35, 300, s - 1036], [s // 2, s - s // 2]],
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("docs", list(DOCUMENTS))
def test_forward_with_documents_matches_fp64_reference(docs, causal, d, dtype):
    seed = _fresh_seed()
    s = 1500
    q, k, v = _inputs(2, s, s, 4, 2, d, DTYPES[dtype], seed)
    ids = torch.stack([_ids(row) for row in DOCUMENTS[docs](s)])
    _check_documents(q, k, v, causal, ids, ids, seed)


@pytest.mark.parametrize("d", [64, 128])
def test_forward_with_documents_on_a_ring_step_leaves_rows_without_keys_empty(d):
    """A non-causal ring step: queries of documents 0..5 against keys of documents 3..9 (ids
    nondecreasing on both sides); rows of documents 0..2 see nothing."""
    seed = _fresh_seed()
    q, k, v = _inputs(1, 1300, 900, 4, 4, d, torch.bfloat16, seed)
    q_ids = _ids([200, 1, 299, 250, 300, 250])[None]
    k_ids = (_ids([100, 200, 50, 150, 100, 300]) + 3)[None]
    _check_documents(q, k, v, False, q_ids, k_ids, seed)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_one_document_is_dense_bit_for_bit(d, causal):
    seed = _fresh_seed()
    q, k, v = _inputs(2, 1111, 1111, 4, 2, d, torch.bfloat16, seed)
    ids = torch.zeros((2, 1111), dtype=torch.int32, device="cuda")
    dense = cute_backend.forward(q, k, v, causal, None)
    one = cute_backend.forward(q, k, v, causal, None, doc_ids=(ids, ids))
    assert torch.equal(dense[0], one[0]) and torch.equal(dense[1], one[1]), f"seed={seed}"


@pytest.mark.parametrize("flags", [dict(intra_wg_overlap=False), dict(pingpong=False),
                                   dict(persistent=True, tile_n=128), dict(ex2_fma_per16=16)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_technique_switches_keep_documents_exact(flags):
    """The skipped and masked block ranges through the serial, single-warpgroup, persistent and
    emulated-exp2 paths (2 x 2000 x 8 heads: persistent CTAs loop)."""
    seed = _fresh_seed()
    q, k, v = _inputs(2, 2000, 2000, 8, 2, 128, torch.bfloat16, seed)
    ids = torch.stack([_ids([1, 127, 300, 1000, 572]), _ids(_tiny_documents(2000, 3))])
    for causal in (False, True):
        _check_documents(q, k, v, causal, ids, ids, seed,
                         config=fwd_variant("bf16", 128, causal, has_docs=True, **flags))
