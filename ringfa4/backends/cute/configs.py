"""Compile-time configurations of our CuTe kernels, and the shipped variants.

A configuration holds every compile-time value of one kernel (the compile cache is keyed on
it) and names it; ringfa4.backends.cute.compile turns it into a kernel. Plain data: importing
this module needs no nvidia-cutlass-dsl.
"""
import functools
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class FwdSm90Config:
    """The forward kernel (ringfa4.kernels.fwd_sm90): tiles, pipeline depth and the technique
    switches its docstring describes."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    tile_m: int
    tile_n: int
    num_stages: int = 2
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # Log2 units the running max may grow by before O is rescaled (FA4's threshold: a factor
    # 256 of headroom, harmless in fp32 and for bf16 P); None rescales on every growth.
    rescale_threshold: Optional[float] = 8.0
    ex2_fma_per16: int = 0
    # The wait for the in-flight P V product inside the O rescale's branches, after the softmax
    # (the kernel's docstring). 1.00-1.015x at head dim 64 without causal mask or packing, where
    # ptxas otherwise waits before the first exp2; 0.95-0.97x at the other defaults, where it
    # leaves 2-28 exp2s before the wait (H200, sustained turns; identical kernels in the same
    # runs read 0.98-1.00x: bench/RESULTS.md, "The forward's wait for P V after the softmax").
    late_pv_wait: bool = False
    lpt: bool = False
    persistent: bool = False
    # Pack-GQA (FA4's pack_gqa): the query heads of a kv head, this many, share each tile's rows
    # (tile_m / pack_gqa positions x pack_gqa heads), so a K/V block loaded once serves all of
    # them and short sequences make fewer, fuller tiles. 1: a tile is one head's rows.
    pack_gqa: int = 1
    # Packed documents: the kernel takes each query's visible key range (from the document ids)
    # at run time, skips key blocks outside the query block's documents and masks the blocks on
    # a document boundary. One variant serves every boundary set.
    has_docs: bool = False
    # The tiles' order from the host (an int32 tile id per position, interface.tile_order)
    # instead of the kernel's own (lpt or the plain raster), dealt so that persistent CTAs get
    # even work: with documents a tile's key blocks depend on its documents, not its position.
    tile_order: bool = False

    @property
    def name(self) -> str:
        flags = [
            "ovl" if self.intra_wg_overlap else "noovl",
            "pp" if self.pingpong else "nopp",
            f"rs{self.rescale_threshold:g}" if self.rescale_threshold is not None else "rsalways",
            f"ex{self.ex2_fma_per16}",
        ] + (["latepv"] if self.late_pv_wait else []) + (["lpt"] if self.lpt else []) + (
            ["persist"] if self.persistent else []) + (
            [f"gqa{self.pack_gqa}"] if self.pack_gqa > 1 else []) + (["docs"] if self.has_docs else []) + (
            ["order"] if self.tile_order else [])
        return (
            f"fwd_sm90_{self.dtype}_d{self.head_dim}_{'causal' if self.causal else 'full'}"
            f"_{self.tile_m}x{self.tile_n}s{self.num_stages}_" + "_".join(flags)
        )


@dataclass(frozen=True)
class BwdSm90Config:
    """The backward kernel (ringfa4.kernels.bwd_sm90)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int  # query rows per step (query_tile)
    causal: bool
    deterministic: bool
    dkv_fp32: bool  # dk, dv are fp32 buffers the kernel adds into (else written in dtype)
    # Packed documents: per KV block, the query tiles its documents reach (from the ids at run
    # time); tiles on a boundary are masked. One variant serves every boundary set.
    has_docs: bool = False
    # With documents: CTAs launched in a host-given order, document by document, the document
    # with the longest walk first (not deterministic: its waits rely on the grid's order).
    doc_order: bool = False
    # The MMA warp groups a dQ product apart instead of meeting at every step (the kernel's
    # docstring): each waits only for a dS the other stored a while ago.
    staggered: bool = False
    # Each warp group's half of a dQ tile reduced by a dQ warp of its own (warps 1 and 2) instead
    # of one warp for both; deterministic, each half then also has its own turn counter.
    dq_warp_per_part: bool = False
    # With a dQ warp per part: warp 2 takes group 1's part of a step only after warp 1 took
    # group 0's, as one warp for both would, while each keeps its own turns and landing waits.
    dq_warps_meet: bool = False
    # seqlen_k is a whole number of K/V blocks (the host checks): no key mask unless causal.
    whole_keys: bool = False
    # Deterministic, not causal: a row whose K/V blocks outnumber half the SMs rotates its walks
    # in groups (interface.rotation_group), launched group by group.
    rotate_groups: bool = False
    # Deterministic causal split heads written in dtype: the head_splits CTAs of one (K/V block,
    # kv head), this many, are a cluster that sums their dK/dV shares in shared memory.
    # 1: the shares add into fp32 sums in global memory, in a fixed order.
    cluster_shares: int = 1

    @property
    def name(self) -> str:
        return (f"bwd_sm90_{self.dtype}_d{self.head_dim}_m{self.tile_m}"
                f"_{'causal' if self.causal else 'full'}"
                f"_{'det' if self.deterministic else 'atomic'}"
                f"_{'dkvadd32' if self.dkv_fp32 else 'dkvstore'}" + ("_docs" if self.has_docs else "")
                + ("_docorder" if self.doc_order else "") + ("_wholekeys" if self.whole_keys else "")
                + ("_stagger" if self.staggered else "") + ("_dqwarp2" if self.dq_warp_per_part else "")
                + ("_meet" if self.dq_warps_meet else "") + ("_groups" if self.rotate_groups else "")
                + (f"_cluster{self.cluster_shares}" if self.cluster_shares > 1 else ""))


@dataclass(frozen=True)
class BwdPreprocessConfig:
    """The backward's preprocess (ringfa4.kernels.bwd_preprocess)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    zero: bool = False  # also zero a flat fp32 buffer (the dQ accumulator and the dK/dV sums)

    @property
    def name(self) -> str:
        return f"bwd_preprocess_{self.dtype}_d{self.head_dim}" + ("_zero" if self.zero else "")


@dataclass(frozen=True)
class DqPostprocessConfig:
    """The backward's dQ postprocess (ringfa4.kernels.bwd_postprocess)."""

    dtype: str  # of dq: "bf16" | "fp16" | "fp32"
    head_dim: int
    tile_m: int  # the backward kernel's, which sets the accumulator's layout
    add: bool  # add into dq (else overwrite it)
    cast_sums: bool = False  # also write the split shares' fp32 dK/dV sums in dtype

    @property
    def name(self) -> str:
        return (f"bwd_dq_postprocess_{self.dtype}_d{self.head_dim}_m{self.tile_m}"
                f"_{'add' if self.add else 'store'}" + ("_castsums" if self.cast_sums else ""))


@dataclass(frozen=True)
class MergeConfig:
    """The ring's merge (ringfa4.kernels.merge)."""

    out_dtype: str  # "bf16" | "fp16" | "fp32": the running sum's dtype
    part_dtype: str  # the step's partial output's dtype
    head_dim: int

    @property
    def name(self) -> str:
        return f"merge_{self.out_dtype}_{self.part_dtype}_d{self.head_dim}"


# Key blocks of the non-causal forward at head dim 128 where it runs persistent CTAs, as (up to
# this many keys, key block); longer calls launch 176-key tiles (bench/RESULTS.md, "Short forward
# tiles", "160-key blocks for short non-causal forwards"). With few key blocks per tile, a CTA's
# Q load and first K wait are what a persistent producer hides behind the last tile's softmax.
# 160 keys (the most whose persistent Q, O and two K/V stages fit shared memory) ran 1.014-1.038x
# 128 at 2k-4k keys and 0.967x at 1k (H200, sustained turns); past 4k the 176-key tiles launched
# in order are level or ahead.
SHORT_TILE_N = {128: ((1024, 128), (4096, 160))}
# The longest causal walk (the longest document, or where that is not known the key length), by
# head dim, up to which the causal forward runs persistent CTAs in the host's balanced tile order
# (interface.tile_order): short walks are where a persistent producer hides the next tile's
# loads, and the host's deal evens the unequal causal tiles that a static share of the kernel's
# LPT order left uneven (a ring step of one sequence ran 0.89-0.96x the launch-order grid that
# way). H100, one process (bench/RESULTS.md, sessions of 2026-11-27 II and III), over the
# launch-order LPT grid: dense causal 1.02-1.06x at 4k-16k keys (hdim 128) and 1.02-1.08x at 4k-8k
# (hdim 64), ring-step squares of 2k / 4k 1.10 / 1.14x, 32k keys 1.00x; documents of 4k tokens
# 1.03-1.08x. Past the bound the CTAs drift apart over long walks and lose L2 (documents of 64k+:
# 0.975x); at head dim 64 (192-row tiles) the gain ends sooner (16k-32k keys: 0.98-1.00x).
ORDER_KEYS = {64: 8192, 128: 32768}
# Head dims at which the deterministic backward's two dQ warps meet every step
# (BwdSm90Config.dq_warps_meet), as one warp for both parts would, and the causal key lengths from
# which they do; without causal mask at every length. H200, the meeting warps handing their
# buffers back once read (bench/RESULTS.md, "With the hand-back, the warps meet at head dim 64"):
# causal 1.05-1.10x at 16k-32k keys, 1.01-1.06x at 8k, 0.99-1.01x at 4k, 0.97-0.99x at 1k-2k;
# not causal 1.00-1.06x but at b 1 x 32k 32/8 (0.98x); at head dim 128 meeting ran 0.87-0.91x.
MEET_KEYS = {64: 8192}


# Cached: asked at every call (a ring: every step). It reads its arguments and this module's
# constants only; a test that replaces one of those must call fwd_defaults.cache_clear().
@functools.lru_cache(maxsize=1024)
def fwd_defaults(dtype: str, head_dim: int, causal: bool, has_docs: bool = False,
                 seqlen_k: Optional[int] = None, heads_per_kv: int = 1,
                 longest_document: Optional[int] = None) -> FwdSm90Config:
    """The configuration `forward` uses for these inputs, chosen from side-by-side runs on H100
    and H200 (bench/RESULTS.md, kernel section): three consumer warpgroups (192-row tiles) at
    head dim 64, persistent when not causal; 128-row tiles at 128, with 176-key blocks when not
    causal (fewer, longer softmax/rescale steps); LPT order when causal. Not causal, up to
    SHORT_TILE_N's keys (``seqlen_k``; None: longer), persistent with its blocks; causal, with
    walks of up to ORDER_KEYS (the longest document, ``longest_document``, else ``seqlen_k``),
    persistent in the host's tile order. At head dim 64 with GQA (``heads_per_kv`` query heads per kv head), the heads
    of a kv head share each tile's rows where they divide it (pack_gqa: 1.01-1.16x; at head dim
    128 0.98-1.03x, so not there). With documents (``has_docs``) the same tiles, so that one
    document gives the dense result bit for bit. At head dim 64 without causal mask, packing or
    documents, the wait for P V after the softmax (late_pv_wait)."""
    if head_dim <= 64:
        cfg = FwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, tile_m=192,
                            tile_n=128, lpt=causal, persistent=not causal, has_docs=has_docs)
    else:
        cfg = FwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, tile_m=128,
                            tile_n=128 if causal else 176, lpt=causal, has_docs=has_docs)
    if not causal and seqlen_k is not None:
        tile_n = next((n for keys, n in SHORT_TILE_N.get(head_dim, ()) if seqlen_k <= keys), None)
        if tile_n is not None:
            cfg = replace(cfg, tile_n=tile_n, persistent=True)
    walk = longest_document if longest_document is not None else seqlen_k
    if causal and walk is not None and walk <= ORDER_KEYS[head_dim]:
        cfg = replace(cfg, persistent=True, tile_order=True)
    if head_dim <= 64 and heads_per_kv > 1 and cfg.tile_m % heads_per_kv == 0:
        cfg = replace(cfg, pack_gqa=heads_per_kv)
    if head_dim <= 64 and not (causal or has_docs) and cfg.pack_gqa == 1:
        cfg = replace(cfg, late_pv_wait=True)
    return cfg


def query_tile(head_dim: int) -> int:
    """The backward's query tile (rows per step), in both modes: 128 at head_dim 64, 64 at 128.
    (80-row tiles at head_dim 128, FA3's and FA4's choice without causal, were the deterministic
    mode's until its warp groups were staggered: 64 rows staggered measured 1.00-1.11x them at
    16 shapes, bench/RESULTS.md.)"""
    return 128 if head_dim == 64 else 64


# The head_splits whose shares sum their dK/dV in a cluster in the deterministic causal
# backward (BwdSm90Config.cluster_shares); other splits add into fp32 sums. Pairs ran 1.03-1.04x
# the fp32 sums at b 16 x 2k and b 8 x 4k, hdim 128, 32/8 heads; clusters of 4 level at 1 x 2k and
# 0.93x / 0.84x at 1 x 4k / 1 x 32k, where SMs idle until four of one GPC are free (H200,
# bench/RESULTS.md, "dK/dV shares summed in a cluster"). Four shares as two cluster pairs, the
# first pair's fp32 sum handed to the second, ran level with the fp32 sums (0.99-1.01x at 1 x 2k /
# 4k hdim 128 and 1 x 32k / 2 x 16k hdim 64; RESULTS 2026-11-29 VIII) and were taken out again.
CLUSTER_SHARES = (2,)


def bwd_defaults(dtype: str, head_dim: int, causal: bool, deterministic: bool, dkv_fp32: bool,
                 has_docs: bool = False, whole_key_blocks: bool = False,
                 seqlen_k: Optional[int] = None) -> BwdSm90Config:
    """The backward kernel `backward` uses: with documents and a free launch order (not
    deterministic), document by document, longest walk first (bench/RESULTS.md, "The
    backward's launch order with documents"); staggered warp groups, deterministic too, each
    group's dQ part then ordered on its own (bench/RESULTS.md, "Staggered warp groups in the
    backward", "... in the deterministic backward"). A dQ warp per part where measured faster:
    deterministic (a turn counter per part; the two warps meeting every step, where causal from
    MEET_KEYS keys on), and head dim 128 not causal (1.03-1.07x; 0.91-0.99x
    elsewhere: bench/RESULTS.md, "A dQ warp per warp group's half"). Keys that fill whole K/V
    blocks (``whole_key_blocks``) take the variant without key mask at head dim 128 in the default
    mode, not causal (1.003-1.021x; none at head dim 64: bench/RESULTS.md, "The non-causal
    backward without mask code"). Deterministic walks rotate in groups at head dim 64 (bench/RESULTS.md,
    "Rotation in groups"); at head dim 128 the remapped launch spills and ran 0.93-0.95x."""
    return BwdSm90Config(dtype, head_dim, query_tile(head_dim), causal, deterministic, dkv_fp32, has_docs,
                         doc_order=has_docs and not deterministic,
                         staggered=True,
                         dq_warp_per_part=deterministic or (head_dim == 128 and not causal),
                         dq_warps_meet=deterministic and not has_docs and head_dim in MEET_KEYS
                         and (not causal or seqlen_k is not None and seqlen_k >= MEET_KEYS[head_dim]),
                         whole_keys=whole_key_blocks and head_dim == 128
                         and not (causal or deterministic or has_docs),
                         rotate_groups=deterministic and not (causal or has_docs) and head_dim == 64)


def fwd_variant(dtype: str, head_dim: int, causal: bool, **overrides) -> FwdSm90Config:
    """The default configuration with some fields replaced (benchmarks, technique tests)."""
    return replace(fwd_defaults(dtype, head_dim, causal), **overrides)


def _fwd_key_lengths(head_dim, causal):
    """Key lengths (None: long) that pick each of the forward's configurations of these inputs."""
    if causal:
        return (None, 1)
    return (None, *(keys for keys, _ in SHORT_TILE_N.get(head_dim, ())))


# The shipped variants (`python -m ringfa4.kernels --dump` compiles each): the forward's
# defaults, long and short, without and with documents, and at head dim 64 packed by 4 query heads
# per kv head (Llama 3's GQA; other groups compile on first use); the backward's preprocess, main kernel (every causal /
# deterministic / dK-dV mode and query tile, without and with documents) and dQ postprocess (dq fresh or given in the input dtype, or an fp32 dq to add into); and the
# ring's merge (two ranks sum in the input dtype, more in fp32: ringfa4.ring.attention._sum_dtype).
_DTYPES = ("bf16", "fp16")
_HEAD_DIMS = (64, 128)
VARIANTS = (
    [fwd_defaults(dt, d, c, docs, seqlen_k, heads_per_kv)
     for docs in (False, True) for dt in _DTYPES for d in _HEAD_DIMS for c in (False, True)
     for seqlen_k in _fwd_key_lengths(d, c)
     for heads_per_kv in ((1, 4) if d == 64 else (1,))]
    + [BwdPreprocessConfig(dt, d, zero) for dt in _DTYPES for d in _HEAD_DIMS for zero in (False, True)]
    + [DqPostprocessConfig(dt, d, query_tile(d), add)
       for d in _HEAD_DIMS
       for dt, add in (("bf16", False), ("bf16", True), ("fp16", False), ("fp16", True), ("fp32", True))]
    + [DqPostprocessConfig(dt, d, query_tile(d), False, cast_sums=True) for dt in _DTYPES for d in _HEAD_DIMS]
    + list(dict.fromkeys(
        replace(bwd_defaults(dt, d, c, det, f32, docs, whole, seqlen_k), cluster_shares=shares)
        for docs in (False, True) for dt in _DTYPES for d in _HEAD_DIMS for c in (False, True)
        for det in (False, True) for f32 in (False, True)
        for whole in (False, True) for seqlen_k in (None, MEET_KEYS[64])
        for shares in ((1, *CLUSTER_SHARES) if det and c and not (f32 or docs) else (1,))))
    + [MergeConfig(out, part, d) for part in _DTYPES for out in (part, "fp32") for d in _HEAD_DIMS]
)
