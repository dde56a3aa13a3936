"""Compile cache of our CuTe kernels.

A kernel is compiled once per configuration (ringfa4.backends.cute.configs), target arch and
compiler options, against fake tensors whose batch, sequence and head counts (and strides) are
symbolic, so a new sequence length, batch or head count reuses it. Compiled callables go
through TVM-FFI: they take torch tensors directly and launch on torch's current CUDA stream.
"""
# First: the DSL reads its target arch when cutlass is imported, and ringfa4.kernels pins it.
import ringfa4.kernels  # noqa: F401, I001

import os
import time

import cutlass.cute as cute
from cutlass import Float32, Int32

from ringfa4.backends.cute.configs import (BwdPreprocessConfig, BwdSm90Config, DqPostprocessConfig,
                                           FwdSm90Config, MergeConfig)
from ringfa4.kernels.bwd_postprocess import DqPostprocess
from ringfa4.kernels.bwd_preprocess import BwdPreprocess
from ringfa4.kernels.bwd_sm90 import AttentionBackwardSm90
from ringfa4.kernels.dtypes import CUTLASS_DTYPES
from ringfa4.kernels.fwd_sm90 import FwdSm90
from ringfa4.kernels.merge import Merge

ARCH = os.environ["CUTE_DSL_ARCH"]
_ALIGN_BYTES = 16  # TMA and vector accesses need 16-byte aligned strides and base


def _fake(dtype, shape, align_elems=1, assumed_align=16):
    """A tensor of ``shape`` (last mode contiguous) with symbolic strides, each a multiple of
    ``align_elems``."""
    stride = tuple(cute.sym_int64(divisibility=align_elems) if align_elems > 1 else cute.sym_int64()
                   for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=assumed_align)


def _bshd(dtype, b, s, h, d):
    """(b, s, h, d) with 16-byte aligned rows: what TMA and 16-byte accesses need."""
    return _fake(dtype, (b, s, h, d), align_elems=_ALIGN_BYTES * 8 // dtype.width)


def _stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _fwd_args(cfg: FwdSm90Config):
    dt = CUTLASS_DTYPES[cfg.dtype]
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    q, o = (_bshd(dt, b, sq, h, cfg.head_dim) for _ in range(2))
    k, v = (_bshd(dt, b, sk, hk, cfg.head_dim) for _ in range(2))
    lse = _fake(Float32, (b, h, sq), assumed_align=4)
    key_lo, key_hi = ((_fake(Int32, (b, sq), assumed_align=4) for _ in range(2)) if cfg.has_docs
                      else (None, None))
    order = _fake(Int32, (cute.sym_int(),), assumed_align=4) if cfg.tile_order else None
    return FwdSm90(cfg), (q, k, v, o, lse, key_lo, key_hi, order, Float32(1.0), Int32(1), _stream())


def _bwd_args(cfg: BwdSm90Config):
    dt = CUTLASS_DTYPES[cfg.dtype]
    kernel = AttentionBackwardSm90(dt, cfg.head_dim, cfg.tile_m, cfg.causal, cfg.deterministic,
                                   Float32 if cfg.dkv_fp32 else dt, cfg.has_docs, cfg.doc_order, cfg.staggered,
                                   cfg.dq_warp_per_part, cfg.whole_keys, cfg.dq_warps_meet,
                                   cfg.rotate_groups, cfg.cluster_shares)
    b, sq, sk, h, hk, sq_pad, n_m, dq_len, n_n, n_turns = (cute.sym_int() for _ in range(10))
    d = cfg.head_dim
    dq_acc = _fake(Float32, (b, h, dq_len), align_elems=4)  # fragment order
    # sem: the dQ tiles' turn counters, one per tile or per warp group's part (dq_layout.turn_counters)
    sem, sem_kv = ((cute.runtime.make_fake_tensor(Int32, (b, heads, n), stride=(cute.sym_int64(), n, 1),
                                                  assumed_align=4) if ordered else None)
                   for heads, n, ordered in ((h, n_turns, cfg.deterministic),
                                             (hk, n_n, cfg.deterministic and cfg.cluster_shares == 1)))
    q, k, v, do = (_bshd(dt, b, s, n, d) for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    lse2, delta = (_fake(Float32, (b, h, sq_pad), align_elems=4) for _ in range(2))
    dk, dv = (_bshd(Float32 if cfg.dkv_fp32 else dt, b, sk, hk, d) for _ in range(2))
    docs = (None,) * 5
    if cfg.has_docs:
        blocks = (cute.runtime.make_fake_tensor(Int32, (b, n, 2), stride=(cute.sym_int64(), 2, 1),
                                                assumed_align=4) for n in (n_n, n_m))
        order = _fake(Int32, (b, cute.sym_int()), assumed_align=4) if cfg.doc_order else None
        docs = (*(_fake(Int32, (b, sk), assumed_align=4) for _ in range(2)), *blocks, order)
    return kernel, (q, k, v, do, lse2, delta, dq_acc, dk, dv, sem, *docs, sem_kv, Float32(1.0), Int32(1), Int32(0),
                    Int32(0), Int32(0), Int32(0), _stream())


def _preprocess_args(cfg: BwdPreprocessConfig):
    dt = CUTLASS_DTYPES[cfg.dtype]
    b, s, h, s_pad = (cute.sym_int() for _ in range(4))
    o, do = (_bshd(dt, b, s, h, cfg.head_dim) for _ in range(2))
    lse, lse2, delta = (_fake(Float32, (b, h, n), assumed_align=4) for n in (s, s_pad, s_pad))
    zero = _fake(Float32, (cute.sym_int(divisibility=4),), assumed_align=16) if cfg.zero else None
    return BwdPreprocess(dt, cfg.head_dim), (o, do, lse, lse2, delta, zero, Float32(1.0), _stream())


def _postprocess_args(cfg: DqPostprocessConfig):
    dt = CUTLASS_DTYPES[cfg.dtype]
    b, s, h, length = (cute.sym_int() for _ in range(4))
    acc = _fake(Float32, (b, h, length), align_elems=4)
    sums, dk, dv = None, None, None
    if cfg.cast_sums:
        n = cute.sym_int(divisibility=4)
        sums = _fake(Float32, (cute.sym_int(divisibility=8),), assumed_align=16)
        dk, dv = (_fake(dt, (n,), assumed_align=16) for _ in range(2))
    return DqPostprocess(dt, cfg.head_dim, cfg.tile_m, cfg.add), (
        acc, _bshd(dt, b, s, h, cfg.head_dim), sums, dk, dv, _stream())


def _merge_args(cfg: MergeConfig):
    out_dt, part_dt = CUTLASS_DTYPES[cfg.out_dtype], CUTLASS_DTYPES[cfg.part_dtype]
    b, s, h = (cute.sym_int() for _ in range(3))
    lse, lse_part = (_fake(Float32, (b, h, s), assumed_align=4) for _ in range(2))
    return Merge(out_dt, part_dt, cfg.head_dim), (
        _bshd(out_dt, b, s, h, cfg.head_dim), lse, _bshd(part_dt, b, s, h, cfg.head_dim), lse_part,
        _stream())


_COMPILE_ARGS = {
    FwdSm90Config: _fwd_args,
    BwdSm90Config: _bwd_args,
    BwdPreprocessConfig: _preprocess_args,
    DqPostprocessConfig: _postprocess_args,
    MergeConfig: _merge_args,
}
_cache = {}
compile_seconds = {}


def compile_variant(cfg, options: str = ""):
    """The compiled callable for cfg (cached on cfg, the arch and the options)."""
    key = (cfg, ARCH, options)
    fn = _cache.get(key)
    if fn is None:
        kernel, args = _COMPILE_ARGS[type(cfg)](cfg)
        t0 = time.perf_counter()
        fn = cute.compile(kernel, *args, options=("--enable-tvm-ffi " + options).strip())
        compile_seconds[key] = time.perf_counter() - t0
        _cache[key] = fn
    return fn
