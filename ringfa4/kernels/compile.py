"""Compile cache for the CuTe DSL kernels.

Kernels are compiled once per configuration (every compile-time value, plus the target arch)
against fake tensors whose batch, sequence and head counts are symbolic, so a new sequence
length, batch or head count reuses the compiled kernel. Compiled callables go through TVM-FFI:
they take torch tensors directly and launch on torch's current CUDA stream.

VARIANTS is the list of shipped kernel configurations (`python -m ringfa4.kernels --dump`
compiles each). An entry is any object with a ``name`` and a ``compile_args()`` returning
(kernel object, fake arguments); other kernels (the backward) append their own.
"""
import os
import time
from dataclasses import replace

import cutlass.cute as cute

from ringfa4.kernels import bwd_postprocess, bwd_preprocess, bwd_sm90, merge
from ringfa4.kernels.fwd_sm90 import FwdSm90Config

ARCH = os.environ["CUTE_DSL_ARCH"]  # pinned by ringfa4.kernels
_ALIGN_ELEMS = 8  # 16 bytes of bf16/fp16: TMA needs 16-byte aligned strides and base


def fake_bshd(dtype, b, s, h, d):
    """A (b, s, h, d) tensor with symbolic shape/strides, the head dim contiguous."""
    stride = tuple(cute.sym_int64(divisibility=_ALIGN_ELEMS) for _ in range(3)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, (b, s, h, d), stride=stride, assumed_align=16)


def fwd_defaults(dtype: str, head_dim: int, causal: bool) -> FwdSm90Config:
    """The configuration `forward` uses for these inputs, chosen from side-by-side runs on H100
    (bench/RESULTS.md, kernel section): three consumer warpgroups (192-row tiles) at head dim
    64, persistent when not causal; 128-row tiles at 128, with 176-key blocks when not causal
    (fewer, longer softmax/rescale steps) and LPT order when causal."""
    if head_dim <= 64:
        return FwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, tile_m=192,
                             tile_n=128, lpt=causal, persistent=not causal)
    return FwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, tile_m=128,
                         tile_n=128 if causal else 176, lpt=causal)


# Shipped forward variants: the defaults for every supported (dtype, head_dim, causal).
VARIANTS = [
    fwd_defaults(dt, d, c) for dt in ("bf16", "fp16") for d in (64, 128) for c in (False, True)
]
# ... the backward's: its pre- and postprocess and the main kernel; and the ring's merge.
VARIANTS += bwd_preprocess.VARIANTS + bwd_postprocess.VARIANTS + bwd_sm90.VARIANTS + merge.VARIANTS

_cache = {}
compile_seconds = {}


def compile_variant(cfg, options: str = ""):
    """The compiled callable for cfg (cached on cfg, the arch and the options)."""
    key = (cfg, ARCH, options)
    fn = _cache.get(key)
    if fn is None:
        kernel, args = cfg.compile_args()
        t0 = time.perf_counter()
        fn = cute.compile(kernel, *args, options=("--enable-tvm-ffi " + options).strip())
        compile_seconds[key] = time.perf_counter() - t0
        _cache[key] = fn
    return fn


def fwd_variant(dtype: str, head_dim: int, causal: bool, **overrides) -> FwdSm90Config:
    return replace(fwd_defaults(dtype, head_dim, causal), **overrides)
