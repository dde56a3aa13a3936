"""Attention backward for Hopper (sm_90a) in CuTe DSL, from a given lse.

One CTA owns a (tile_n x head_dim) block of K and V for one kv head and walks over every
query tile that sees it (of every query head sharing that kv head, so GQA needs no dK/dV
reduction; or, with head_splits > 1, of its share of those heads, the shares' dK/dV summed by
fp32 reduce-adds, in a fixed order when deterministic), recomputing P from the lse it is given:

    S^T = K Q^T          P^T = exp2(S^T * scale * log2(e) - lse * log2(e))
    dP^T = V dO^T        dS^T = P^T * (dP^T * scale - delta),  delta = scale * rowsum(dO * O)
    dV += P^T dO         dK += dS^T Q          dQ += dS K  (fp32, bulk reduce-add into global)

(dS carries the softmax scale, so dQ and dK need no multiply of their own.)

Warp roles (384 threads): warp 0 loads Q, dO, lse, delta through a two-stage TMA pipeline; warp 1
reduces each dQ tile into global memory (cp.reduce.async.bulk add; or warps 1 and 2 a half each,
see below); warp groups 1 and 2 each own 64 rows of the K/V block for S, dP, dV and dK, and half
of the dQ tile. S and dP are computed transposed so that P^T and dS^T stay in registers as the A
operand of the dV and dK products; only dS goes through shared memory (for dQ). dK and dV stay in
registers until the CTA is done; then they are staged in the idle Q/dO/K/V tiles and written (or
added, into fp32 buffers) by two TMA bulk copies, whole 128-byte lines instead of scattered
per-thread stores. Only the head_splits CTAs of one (K/V block, kv head) touch them. delta and
the lse in log2 units come from bwd_preprocess.py, permuted within groups of 16 rows so that a
thread loads its rows' values 16 bytes at a time (stats_layout.py).

Each group's half of dQ = dS K needs both groups' dS. Met at a barrier every step, the two groups
run in phase: both wait on the exp2s and dS while the tensor cores idle, then both queue their
products. Staggered (the default), group 0 multiplies a step's dS into dQ one step late, behind
its next dS, and group 1 at once: each then waits only for a dS the other stored a while ago (a
named barrier per group and dS buffer), so the groups drift apart and one's exp2s run under the
other's products (on an H100 4% faster over 15 shapes, geometric mean, up to 8%;
bench/RESULTS.md). Group 0's late half then holds up group 1's in a shared dQ warp; with a dQ
warp per half (dq_warp_per_part: warps 1 and 2) neither waits for the other. That is 1.03-1.07x
at head_dim 128 without causal mask, but 0.97-0.99x causal and 0.91-1.00x at head_dim 64, where
one warp stays the default (bench/RESULTS.md).

dQ is accumulated in "fragment order": each warp group's half of a dQ tile is one contiguous
block of (tile_m * head_dim / 2) floats in the order its threads hold them, four registers of
a thread side by side and threads interleaved, so that every 16-byte shared store of a warp is
one conflict-free 512-byte line and the reduction into global memory is one linear bulk copy.
(Row-major tiles, as a tensor TMA needs, cost 3-4x the shared-store wavefronts: the swizzle
cannot separate the row pairs a wgmma accumulator writes together.) dq_layout.py holds that
layout; bwd_postprocess.py puts dQ back in (b, s, h, d).

Deterministic mode orders the dQ reductions: the reduction of KV block j into a dQ tile waits on a
per-tile counter until the blocks before it in a fixed order have landed (ascending, or descending
for causal so that no CTA waits for the long-running low blocks). CTAs are launched with the KV
block as the fastest grid index, in that same order, so a CTA only ever waits on CTAs launched
before it. Into an accumulator of the call's own (dq_fresh), a tile's first reduction stores
instead of adding, so that it needs no zeroing; likewise the first of the head_splits shares of a
(K/V block, kv head) stores its dK and dV into fp32 sums of the call's own (dkv_fresh). Causal,
with two shares written in dtype (cluster_shares), the pair is one cluster instead: each stages
its fp32 dK/dV in shared memory and each sums half the rows of both, in share order, from the
pair's shared memory (the same bits, no fp32 sums to cast; 1.02-1.10x on an H200, where clusters
of four ran slower: SMs wait until four of one GPC are free). Non-causal,
in that order all N blocks of a head reach its first dQ tile together and block n waits n steps
before it starts, and every tile's blocks then arrive one step apart, so each step's jitter adds up
along the chain. Where the host knows the N CTAs fit on the GPU at once (``rotate`` = N), block n
instead walks the query blocks from n * M / N on, wrapping around, and each tile's order is the
order the blocks reach it in: in lockstep no CTA waits. Where they do not (``rotate_groups``), the
blocks rotate in groups of ``rotate`` that do: a batch row's CTAs launch group by group (every kv
head's group j before any group j + 1), block n of a group of G walks from n * M / G on, and a tile
takes every block of group j before those of group j + 1, which ran earlier. With documents, rows
that are one document walk rotated, when the N CTAs fit (the same bits as without).
With a dQ warp per part (above; bwd_defaults' choice in deterministic mode), each warp group's
half of a dQ tile has a counter of its own: staggered, group 0's half arrives a step late, and
its order then runs a step behind group 1's instead of holding both up (on an H100 1.04x at
head_dim 64, 1.09x at 128, bench/RESULTS.md). The two warps may also meet every step
(dq_warps_meet): warp 2 takes group 1's part only once warp 1 has taken group 0's part of the
same step, which keeps group 1 from running ahead as one warp for both parts would, while each
warp waits for its own turns and landings (one warp for both parts, its waits queued, ran
0.79-0.84x of two). configs.MEET_KEYS says where that is faster. Meeting leaves a warp no step
of slack for its reduction's landing, so there it hands its buffer back once the reduction has
read it, before the landing and the turn pass (1.01-1.05x at the meeting shapes on an H200;
where the warps keep apart, and at head_dim 128, that was level or slower: bench/RESULTS.md).

Packed documents (has_docs, one variant for every boundary set): a CTA walks only the query
tiles its keys' documents reach (from the host, with per query tile the run of K/V blocks that
reach it, which orders deterministic mode's reductions); a CTA no query reaches walks none and
writes dK = dV = 0. A tile whose queries every key of the K/V block sees (one document holding both,
and, causal, below the diagonal) runs unmasked; the others are masked by each key's visible
query range, read once per CTA.

Which steps mask: a step decides at run time, between the S^T product and its exp2s, whether its
tile needs the mask; at hdim 64 causal (default mode) the step is instead compiled twice, with the
mask and without, and the walk picks the copy per step (split_steps), so that the steps off the
diagonal, all but the first of each query head's walk, run no mask code and read the lse early.

Launch order (not deterministic): the kernel lasts until its last long walk ends, and the grid's
order (a batch row's KV blocks fastest, then its kv heads) reaches the longest causal walks of its
last kv heads (block 0) at its end. With many CTAs that tail is short against the whole, and the
grid's order keeps the concurrent CTAs on few kv heads, sharing L2. With few (a causal ring step
of one sequence), ``lpt`` launches a batch row longest walk first: block 0 of every kv slot, then
every block 1, ... With documents (doc_order) walks differ with the documents; an order by walk
length alone starts the CTAs of many documents at once, whose Q/dO then miss L2, so the host
orders the CTAs document by document, the longest walk's first, every kv head of a document
before the next.

Per MMA thread (wgmma m64nNk16 accumulators, each warp group 64 rows of the K/V block):
  S^T, dP^T  ((2, 2, tile_m / 8), 1, 1) fp32      P^T, dS^T: the same shape in 16 bits
  dK, dV     ((2, 2, head_dim / 8), 1, 1) fp32    kept until the epilogue
  dQ part    64 x 64 fp32 (dq_layout.py), handed to the dQ warp through shared memory
"""
from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ringfa4.kernels import wgmma
from ringfa4.kernels.barriers import BwdBarrier
from ringfa4.kernels.dq_layout import (NUM_MMA_WG, QUERY_TILE, REGS_PER_STORE, WG_THREADS, parts_split_rows,
                                       turn_counters)
from ringfa4.kernels.layout import acc_rows_view, carve, rows_major, seq_major, transpose
from ringfa4.kernels.mask import AttentionMask
from ringfa4.kernels.ptx import bulk_reduce_add_f32, bulk_store, convert_to
from ringfa4.kernels.softmax import LOG2_E
from ringfa4.kernels.stats_layout import ROW_GROUP, THREAD_ROWS, stats_position, thread_stats
from ringfa4.kernels.tile_scheduler import BwdStepScheduler

# Staggered warp groups: dS buffers in turn. Group 1's dS of step j is read by group 0's dQ
# product at group 0's step j + 1, which group 1 may already have passed into step j + 2: its
# dS of step j + 2 must not land in the same buffer.
DS_BUFFERS = 3


@cute.jit
def wait_turn(sem_ptr: cute.Pointer, turn: Int32):
    """Lane 0 spins until the counter at sem_ptr reaches turn (acquire: the reductions of the
    CTAs that passed it before are visible)."""
    if cute.arch.lane_idx() == 0:
        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
        while seen != turn:
            seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")


@cute.jit
def pass_turn(sem_ptr: cute.Pointer):
    """Once this warp's bulk copies (issued by lane 0) have landed in global memory, lane 0
    advances the counter at sem_ptr: the next CTA in the order may add."""
    if cute.arch.lane_idx() == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.red(sem_ptr, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
    cute.arch.sync_warp()


class AttentionBackwardSm90:
    """Compile-time configuration of the backward kernel; call it under ``cute.compile``.

    dtype: Float16 or BFloat16 (q, k, v, dout). head_dim: 64 or 128. tile_m: query rows per
    step, dq_layout.QUERY_TILE[head_dim]. dkv_dtype: dtype of dk/dv; Float32 means "add into",
    the input dtype means "overwrite". dq is always an fp32 buffer that the kernel adds into.
    """

    num_threads = (NUM_MMA_WG + 1) * WG_THREADS

    def __init__(self, dtype, head_dim: int, tile_m: int, causal: bool, deterministic: bool,
                 dkv_dtype, has_docs: bool = False, doc_order: bool = False, staggered: bool = False,
                 dq_warp_per_part: bool = False, whole_keys: bool = False, dq_warps_meet: bool = False,
                 rotate_groups: bool = False, cluster_shares: int = 1):
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise ValueError(f"dtype must be Float16 or BFloat16, got {dtype}")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if tile_m != QUERY_TILE[head_dim]:
            raise ValueError(f"tile_m must be {QUERY_TILE[head_dim]} at head_dim {head_dim}, got {tile_m}")
        if dkv_dtype not in (dtype, Float32):
            raise ValueError(f"dkv_dtype must be {dtype} or Float32, got {dkv_dtype}")
        if doc_order and (deterministic or not has_docs):
            raise ValueError("doc_order needs has_docs and not deterministic (whose waits rely on the grid's order)")
        if whole_keys and has_docs:
            raise ValueError("whole_keys is for calls without documents, whose masks come from the documents")
        if rotate_groups and (causal or not deterministic or has_docs):
            raise ValueError("rotate_groups needs deterministic, not causal, without documents")
        if cluster_shares not in (1, 2, 4):
            raise ValueError(f"cluster_shares must be 1, 2 or 4, got {cluster_shares}")
        if cluster_shares > 1 and not (deterministic and causal and not has_docs and dkv_dtype == dtype):
            raise ValueError("cluster_shares needs deterministic, causal, without documents, and dk/dv "
                             "in dtype (the cluster writes the shares' sum)")
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.deterministic = deterministic
        self.dkv_dtype = dkv_dtype
        self.has_docs = has_docs
        # The first share stores into fp32 dK/dV of the call's own (dkv_fresh): deterministic,
        # whose shares add in a fixed order, and without documents, like dq_fresh.
        self.first_share_stores = deterministic and dkv_dtype == Float32 and not has_docs
        # Deterministic causal split heads writing dK/dV in dtype: the head_splits CTAs of one
        # (K/V block, kv head) are one cluster of this many and sum their shares in shared
        # memory (_epilogue_shares), instead of in fp32 global sums cast afterwards.
        self.cluster_shares = cluster_shares
        self.stage_dtype = Float32 if cluster_shares > 1 else dkv_dtype
        self.doc_order = doc_order
        # The caller's promise that seqlen_k is a whole number of K/V blocks: not causal, the
        # kernel then has no mask code, whose selects ptxas issues at every step, needed or not
        # (it if-converts the branch; 1-2% at head dim 128, bench/RESULTS.md).
        self.whole_keys = whole_keys
        # Rotated walks (see the module docstring) replace the non-causal reduction order.
        self.rotates = deterministic and not causal
        # Rotated in groups where a row's K/V blocks do not fit at once: the CTAs' coordinates then
        # come from a remapped launch order instead of the grid, which costs the MMA warp groups
        # two registers held through the loop (ptxas spills at head dim 128).
        self.rotate_groups = rotate_groups
        self.tile_n = 64 * NUM_MMA_WG
        # Register budget per MMA thread: S^T, dP^T (tile_m / 2 each) + dK, dV (head_dim / 2 each).
        self.tile_m = tile_m
        self.stages = 2
        # Staggered (module docstring): the dS tiles take three buffers instead of one per
        # pipeline stage.
        self.staggered = staggered
        self.ds_stages = DS_BUFFERS if staggered else self.stages
        # Staggered, group 0's dQ part of a step is ready a step after group 1's. With a dQ warp
        # per part, deterministic, each part (disjoint memory) takes its turns on its own
        # counter, so that neither waits for the other's landing and no CTA for another's late
        # part.
        self.dq_turns = turn_counters(dq_warp_per_part) if deterministic else 1
        self.dq_warp_parts = (tuple((wg,) for wg in range(NUM_MMA_WG)) if dq_warp_per_part
                              else (tuple(range(NUM_MMA_WG)),))
        if dq_warps_meet and not dq_warp_per_part:
            raise ValueError("dq_warps_meet needs dq_warp_per_part")
        self.dq_warps_meet = dq_warps_meet
        # A stage of the lse / delta rows starts on 128 bytes, where TMA writes shared memory.
        self.stats_stride = -(-tile_m // 32) * 32
        # dQ = dS K is split over the two MMA warp groups along rows when tile_m = 128, else
        # along head_dim; each warp group reduces its own part (dq_layout.py).
        self.dq_split_rows = parts_split_rows(tile_m)
        self.dq_cols = head_dim if self.dq_split_rows else head_dim // NUM_MMA_WG
        self.dq_part = self.tile_m * head_dim // NUM_MMA_WG
        self.mma_regs = 240
        self.attention_mask = AttentionMask(self.tile_m, self.tile_n, causal, key_first=True)
        self.load_regs = 24
        # hdim 128 (64-row tiles): the lse goes into registers while S^T is computed (loaded
        # after S^T's wait, the first exp2 stalls on the shared-memory load: ~10% of the
        # kernel's stall samples), and dS^T is computed with every instruction that reads dP^T
        # also reading P^T (_score_grads), which ptxas schedules better there (3-6% in an A/B).
        # Documents take the second only (the first cost them 4-6%; both kept, one document
        # gives the dense bits). hdim 64 takes the first without causal mask (1.02-1.06x), and
        # causal in the steps without mask once those are a copy of their own (split_steps: the
        # steps in two copies, with the mask and without, _walk_step; 1.01-1.04x, where the one
        # body with the lse read early measured 0.96-0.97x and the split alone 0.93-0.98x; at
        # hdim 128 causal the split cost 3-4%, deterministic 3%); not the second (0.92-1.00x;
        # RESULTS).
        self.ds_from_p = head_dim == 128
        self.split_steps = head_dim == 64 and causal and not (deterministic or has_docs)
        self.early_stats = not has_docs and (head_dim == 128 or not causal or self.split_steps)
        # Whether any step can need a mask (_needs_mask).
        self.has_mask = has_docs or causal or not whole_keys

    # ---------------------------------------------------------------- host side (traced once)
    def _layouts(self):
        d = self.head_dim
        self.sQ_layout = wgmma.smem_layout(self.dtype, self.tile_m, d, self.stages)
        self.sdO_layout = wgmma.smem_layout(self.dtype, self.tile_m, d, self.stages)
        self.sK_layout = wgmma.smem_layout(self.dtype, self.tile_n, d)
        self.sV_layout = wgmma.smem_layout(self.dtype, self.tile_n, d)
        self.sdS_layout = wgmma.smem_layout(self.dtype, self.tile_m, self.tile_n, self.ds_stages)
        self.sdKV_layout = wgmma.smem_layout(self.stage_dtype, self.tile_n, d)

    def _mmas(self):
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg_rows = (NUM_MMA_WG, 1, 1)
        # S^T = K Q^T and dP^T = V dO^T: each warp group owns 64 key rows.
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, wg_rows, (64, self.tile_m))
        # dV += P^T dO and dK += dS^T Q with P^T / dS^T straight from registers.
        self.mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, wg_rows, (64, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K from shared memory.
        self.mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32,
            wg_rows if self.dq_split_rows else (1, NUM_MMA_WG, 1), (64, self.dq_cols))

    def _storage(self):
        d_q, d_k, d_s = (cute.cosize(l) for l in (self.sQ_layout, self.sK_layout, self.sdS_layout))
        stats = self.stats_stride * self.stages
        # Q, dO, K, V back to back, in elements of dtype; the dK/dV epilogue reuses the region.
        self.tile_offsets = (0, d_q, 2 * d_q, 2 * d_q + d_k)
        tile_elems = 2 * d_q + 2 * d_k
        cluster = self.cluster_shares > 1
        self.sdKV_elems = cute.cosize(self.sdKV_layout) * self.stage_dtype.width // self.dtype.width
        assert 2 * self.sdKV_elems <= tile_elems, "dK and dV staging must fit in the Q/dO/K/V tiles"

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            # In the padding before lse: head_dim 64 has no shared memory to spare.
            if cluster:  # every share staged, every share read (_epilogue_shares)
                mbar_shares: cute.struct.MemRange[cutlass.Int64, 2]
            lse: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            delta: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            tiles: cute.struct.Align[cute.struct.MemRange[self.dtype, tile_elems], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[self.dtype, d_s], 1024]
            dq: cute.struct.Align[cute.struct.MemRange[Float32, self.dq_part * NUM_MMA_WG], 1024]

        return Storage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mSem: Optional[cute.Tensor],
                 mQueryLo: Optional[cute.Tensor], mQueryHi: Optional[cute.Tensor],
                 mQueryBlocks: Optional[cute.Tensor], mKeyBlocks: Optional[cute.Tensor],
                 mOrder: Optional[cute.Tensor], mSemKV: Optional[cute.Tensor],
                 softmax_scale: Float32, head_splits: Int32, rotate: Int32, lpt: Int32,
                 dq_fresh: Int32, dkv_fresh: Int32, stream):
        """q, dout (b, sq, h, d); k, v (b, sk, hk, d); lse2, delta (b, h, sq rounded up to
        tile_m) fp32, lse2 in log2 units with +inf on rows that see no key; dq_acc (b, h,
        sq tiles * tile_m * head_dim) fp32 in fragment order (dq_layout.py; added into); dk, dv
        (b, sk, hk, d) of dkv_dtype; sem (b, h, sq tiles * dq_turns) and sem_kv (b, hk, kv blocks)
        int32 zeros when deterministic (the orders of dQ's and dK/dV's reductions; sem_kv not with
        cluster_shares, whose shares meet in the cluster), else None. With
        has_docs (else None), int32: query_lo, query_hi (b, sk) the queries each key is visible
        to (its document's, from the key on when causal); query_blocks (b, kv blocks, 2) the
        query tiles [first, end) each KV block visits; key_blocks (b, query tiles, 2) the first
        and last KV block visiting each query tile (deterministic order), all from the host's
        visible_blocks; with doc_order, order (b, kv blocks * kv heads * head_splits) the CTAs'
        launch order, each kv_slot * kv blocks + block (launch_order). head_splits:
        CTAs per (K/V block, kv head), each taking an equal share of its query heads; more than
        1 needs Float32 dk/dv, into which the shares reduce-add, or cluster_shares equal to it,
        whose cluster writes their sum.
        rotate: nonzero for rotated walks (deterministic, not causal; see the module docstring),
        the K/V blocks per rotated group (the kv blocks; fewer only with rotate_groups): the
        caller's promise that that many CTAs fit on the GPU at once.
        lpt: nonzero to launch each batch row's CTAs longest walk first (causal, not
        deterministic, without doc_order; see the module docstring).
        dq_fresh: nonzero when dq_acc holds nothing yet and every dQ tile has a first turn
        (deterministic, without documents): each tile's first reduction then stores, so the
        caller need not zero dq_acc.
        dkv_fresh: the same for fp32 dk, dv (deterministic, without documents): the first share
        of each (K/V block, kv head) stores, so the caller need not zero them."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype
                      or mV.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("q, k, v, dout must all have the kernel's dtype")
        if const_expr(mdQ.element_type != Float32):
            raise TypeError("dq must be Float32")
        if const_expr(mdK.element_type != self.dkv_dtype or mdV.element_type != self.dkv_dtype):
            raise TypeError("dk, dv must have dkv_dtype")
        if const_expr(self.deterministic != (mSem is not None)):
            raise TypeError("sem is required exactly in deterministic mode")
        if const_expr((self.deterministic and self.cluster_shares == 1) != (mSemKV is not None)):
            raise TypeError("sem_kv is required exactly in deterministic mode without cluster_shares")
        if const_expr(self.has_docs != (mKeyBlocks is not None)):
            raise TypeError("the document ranges are required exactly when has_docs")
        if const_expr(self.doc_order != (mOrder is not None)):
            raise TypeError("order is required exactly with doc_order")
        self._layouts()
        self._mmas()
        Storage = self._storage()

        mQ, mK, mV, mdO, mdK, mdV = (seq_major(t) for t in (mQ, mK, mV, mdO, mdK, mdV))
        mLSE, mDelta, mdQ = (rows_major(t) for t in (mLSE, mDelta, mdQ))
        if const_expr(self.deterministic):
            mSem = rows_major(mSem)
        if const_expr(mSemKV is not None):
            mSemKV = rows_major(mSemKV)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        d = self.head_dim
        tma_q, tQ = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.select(self.sQ_layout, mode=[0, 1]), (self.tile_m, d))
        tma_do, tdO = cpasync.make_tiled_tma_atom(
            g2s, mdO, cute.select(self.sdO_layout, mode=[0, 1]), (self.tile_m, d))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, self.sK_layout, (self.tile_n, d))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, self.sV_layout, (self.tile_n, d))
        stat_layout = cute.make_layout(self.tile_m)
        tma_lse, tLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, stat_layout, (self.tile_m,))
        tma_delta, tDelta = cpasync.make_tiled_tma_atom(g2s, mDelta, stat_layout, (self.tile_m,))
        # dK, dV: "add into" fp32 buffers is a reduce-add, which also sums the head_splits shares.
        # With cluster_shares each CTA writes its rows of the sum itself.
        tma_dk, tma_dv, tdK, tdV = None, None, mdK, mdV
        if const_expr(self.cluster_shares == 1):
            s2g = (cpasync.CopyBulkTensorTileS2GOp() if const_expr(self.dkv_dtype == self.dtype)
                   else cpasync.CopyReduceBulkTensorTileS2GOp())
            tma_dk, tdK = cpasync.make_tiled_tma_atom(s2g, mdK, self.sdKV_layout, (self.tile_n, d))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(s2g, mdV, self.sdKV_layout, (self.tile_n, d))
        tma_dk_store, tma_dv_store = None, None
        if const_expr(self.first_share_stores):
            store = cpasync.CopyBulkTensorTileS2GOp()
            tma_dk_store, _ = cpasync.make_tiled_tma_atom(store, mdK, self.sdKV_layout, (self.tile_n, d))
            tma_dv_store, _ = cpasync.make_tiled_tma_atom(store, mdV, self.sdKV_layout, (self.tile_n, d))

        tile_bytes = self.dtype.width // 8 * d
        self.bytes_q = self.tile_m * tile_bytes + self.tile_m * 4
        self.bytes_kv = 2 * self.tile_n * tile_bytes

        num_kv_heads = cute.size(mK.shape[2])
        grid = (cute.ceil_div(cute.size(mK.shape[0]), self.tile_n), num_kv_heads * head_splits,
                cute.size(mK.shape[3]))
        if const_expr(self.doc_order):
            grid = (grid[0] * grid[1], 1, grid[2])
        self.kernel(
            tQ, tK, tV, tdO, tLSE, tDelta, mdQ, tdK, tdV, mSem,
            tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dk, tma_dv,
            Float32(softmax_scale), Float32(softmax_scale * LOG2_E), Int32(head_splits), Int32(rotate),
            Int32(lpt), Int32(dq_fresh), Int32(dkv_fresh),
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sdS_layout,
            self.sdKV_layout, self.mma_sdp, self.mma_dkv, self.mma_dq, Storage,
            mQueryLo, mQueryHi, mQueryBlocks, mKeyBlocks, mOrder, mSemKV, tma_dk_store, tma_dv_store,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 **({"cluster": [1, self.cluster_shares, 1]} if const_expr(self.cluster_shares > 1) else {}))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tQ: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor, tdO: cute.Tensor,
               tLSE: cute.Tensor, tDelta: cute.Tensor, mdQ: cute.Tensor, tdK: cute.Tensor,
               tdV: cute.Tensor, mSem: Optional[cute.Tensor],
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               tma_do: cute.CopyAtom, tma_lse: cute.CopyAtom, tma_delta: cute.CopyAtom,
               tma_dk: Optional[cute.CopyAtom], tma_dv: Optional[cute.CopyAtom],
               softmax_scale: Float32, scale_log2: Float32, head_splits: Int32, rotate: Int32,
               lpt: Int32, dq_fresh: Int32, dkv_fresh: Int32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdKV_layout: cute.ComposedLayout,
               mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
               Storage: cutlass.Constexpr,
               # Last: the kernel's symbol names its leading arguments, and without documents
               # it stays the one it had before they existed.
               mQueryLo: Optional[cute.Tensor], mQueryHi: Optional[cute.Tensor],
               mQueryBlocks: Optional[cute.Tensor], mKeyBlocks: Optional[cute.Tensor],
               mOrder: Optional[cute.Tensor], mSemKV: Optional[cute.Tensor],
               tma_dk_store: Optional[cute.CopyAtom], tma_dv_store: Optional[cute.CopyAtom]):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_slot, batch = cute.arch.block_idx()
        num_n_blocks = cute.ceil_div(tK.shape[0], self.tile_n)
        if const_expr(self.doc_order):
            code = mOrder[batch, n_block]
            kv_slot = code // num_n_blocks
            n_block = code - kv_slot * num_n_blocks
        elif const_expr(self.causal and not self.deterministic):
            if lpt != 0:
                kv_slots = cute.arch.grid_dim()[1]
                i = kv_slot * num_n_blocks + n_block
                n_block = i // kv_slots
                kv_slot = i - n_block * kv_slots
        elif const_expr(self.rotate_groups):
            if (rotate != 0) & (rotate < num_n_blocks):
                # Rotated in groups of `rotate` K/V blocks: a batch row's CTAs launch group by
                # group, every kv slot's group j before any group j + 1 (the last group may be
                # smaller), so that a group's CTAs run together and after the groups before them.
                kv_slots = cute.arch.grid_dim()[1]
                i = kv_slot * num_n_blocks + n_block
                group = cutlass.min(i // (kv_slots * rotate), (num_n_blocks - 1) // rotate)
                size = cutlass.min(rotate, num_n_blocks - group * rotate)
                i = i - group * kv_slots * rotate
                kv_slot = i // size
                n_block = group * rotate + i - kv_slot * size
        kv_head = kv_slot // head_splits
        if const_expr(self.causal and self.deterministic):
            # Shortest KV blocks first: with the reversed reduction order of _store_dq, the
            # block a CTA waits for was launched before it and is one step ahead of it.
            n_block = num_n_blocks - 1 - n_block

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dk, tma_dv,
                         tma_dk_store, tma_dv_store):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        mbar_kv, pipe_q, pipe_do = self._pipelines(st, warp_idx)
        if const_expr(self.cluster_shares > 1):
            # The peers arrive on these barriers remotely: initialized before any CTA of the
            # cluster runs on.
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(st.mbar_shares.data_ptr() + i, self.cluster_shares)
                cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

        tiles = st.tiles.data_ptr()
        sQ, sdO, sK, sV = (
            carve(tiles + offset, layout, self.dtype)
            for offset, layout in zip(self.tile_offsets, (sQ_layout, sdO_layout, sK_layout, sV_layout)))
        sdS = st.ds.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        stats_layout = cute.make_layout((self.tile_m, self.stages), stride=(1, self.stats_stride))
        sLSE, sDelta = st.lse.get_tensor(stats_layout), st.delta.get_tensor(stats_layout)
        sdQ = st.dq.get_tensor(cute.make_layout((self.dq_part, NUM_MMA_WG)))

        seqlen_q = tQ.shape[0]
        seqlen_k = tK.shape[0]
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        if const_expr(self.has_docs):
            # The query tiles of the documents of this block's keys (none: dK = dV = 0).
            m_block_min = mQueryBlocks[batch, n_block, 0]
            steps_per_head = mQueryBlocks[batch, n_block, 1] - m_block_min
        else:
            # Causal (sq == sk): query tile m sees key block n iff its last row >= the block's
            # first.
            m_block_min = 0
            if const_expr(self.causal):
                m_block_min = n_block * self.tile_n // self.tile_m
            steps_per_head = num_m_blocks - m_block_min
        # Every query head of this CTA's share of the kv head's group (GQA) adds into the same
        # dK, dV registers; the shares of one kv head are consecutive slots, so the CTA's first
        # query head is kv_slot * heads.
        heads = tQ.shape[2] // tK.shape[2] // head_splits
        num_steps = steps_per_head * heads
        rotated = Int32(0)
        rotation = Int32(0)
        if const_expr(self.rotates):
            rotated = rotate
            if const_expr(self.has_docs):
                # Only a row that is one document (its first and last keys see every query)
                # walks rotated, exactly as without documents, so that it gives the same bits.
                last = seqlen_k - 1
                if ((mQueryLo[batch, 0] != 0) | (mQueryLo[batch, last] != 0) | (mQueryHi[batch, 0] != seqlen_q)
                        | (mQueryHi[batch, last] != seqlen_q)):
                    rotated = Int32(0)
            if rotated != 0:
                first, size = self._rotation_group(n_block, num_n_blocks, rotated)
                rotation = (n_block - first) * num_m_blocks // size
        # Each role below builds its own BwdStepScheduler, so the first head's multiply stays in
        # the branch that uses it instead of on every warp's path.

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                self._load(tQ, tK, tV, tdO, tLSE, tDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                           tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, pipe_q, pipe_do,
                           mbar_kv, n_block, kv_head, batch,
                           BwdStepScheduler(kv_slot * heads, m_block_min, steps_per_head, rotation), num_steps)
            for w in cutlass.range_constexpr(len(self.dq_warp_parts)):
                if warp_idx == 1 + w:
                    self._store_dq(mdQ, sdQ, mSem, mKeyBlocks, n_block, num_n_blocks, batch, rotated,
                                   dq_fresh, self.dq_warp_parts[w],
                                   BwdStepScheduler(kv_slot * heads, m_block_min, steps_per_head, rotation),
                                   num_steps)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            acc_dK, acc_dV = self._mma(
                sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, pipe_q, pipe_do, mbar_kv, mma_sdp,
                mma_dkv, mma_dq, tidx - WG_THREADS, softmax_scale, scale_log2,
                seqlen_q, seqlen_k, n_block, batch, mQueryLo, mQueryHi,
                BwdStepScheduler(kv_slot * heads, m_block_min, steps_per_head, rotation),
                num_steps)
            if const_expr(self.cluster_shares > 1):
                self._epilogue_shares(acc_dK, acc_dV, tiles, sdKV_layout, tdK, tdV, mma_dkv,
                                      tidx - WG_THREADS, n_block, kv_head, batch,
                                      kv_slot - kv_head * head_splits, st.mbar_shares.data_ptr())
            else:
                self._epilogue_dkv(acc_dK, acc_dV, tiles, sdKV_layout, tdK, tdV, tma_dk, tma_dv,
                                   tma_dk_store, tma_dv_store, mma_dkv, tidx - WG_THREADS, n_block,
                                   kv_head, batch, mSemKV, kv_slot - kv_head * head_splits, head_splits,
                                   dkv_fresh)

    @cute.jit
    def _pipelines(self, st, warp_idx):
        """The K/V barrier (one load per CTA) and the two-stage Q (+ lse) and dO (+ delta)
        pipelines between the load warp and the MMA warp groups."""
        mbar_kv = st.mbar_kv.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_kv, 1)
        producer = cutlass.pipeline.CooperativeGroup(cutlass.pipeline.Agent.Thread)
        consumer = cutlass.pipeline.CooperativeGroup(
            cutlass.pipeline.Agent.Thread, NUM_MMA_WG * WG_THREADS // 32)
        pipe_q = cutlass.pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar_q.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumer, tx_count=self.bytes_q,
            defer_sync=True)
        pipe_do = cutlass.pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar_do.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumer, tx_count=self.bytes_q,
            defer_sync=False)
        return mbar_kv, pipe_q, pipe_do

    @cute.jit
    def _load(self, tQ, tK, tV, tdO, tLSE, tDelta, sQ, sK, sV, sdO, sLSE, sDelta,
              tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, pipe_q, pipe_do, mbar_kv,
              n_block, kv_head, batch, steps: BwdStepScheduler, num_steps):
        one = cute.make_layout(1)
        d = self.head_dim
        gK = cute.local_tile(tK[None, None, kv_head, batch], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(tV[None, None, kv_head, batch], (self.tile_n, d), (n_block, 0))
        sK_t, gK_t = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        sV_t, gV_t = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.bytes_kv)
        cute.copy(tma_k, gK_t, sK_t, tma_bar_ptr=mbar_kv)
        cute.copy(tma_v, gV_t, sV_t, tma_bar_ptr=mbar_kv)

        state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Producer, self.stages)
        g, pos = steps.start()
        for _ in cutlass.range(num_steps, unroll=1):
            head, m_block = steps.coords(g, pos)
            gQ = cute.local_tile(tQ[None, None, head, batch], (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(tdO[None, None, head, batch], (self.tile_m, d), (None, 0))
            gLSE = cute.local_tile(tLSE[None, head, batch], (self.tile_m,), (None,))
            gDelta = cute.local_tile(tDelta[None, head, batch], (self.tile_m,), (None,))
            sQ_t, gQ_t = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            sdO_t, gdO_t = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2),
                                                 cute.group_modes(gdO, 0, 2))
            sL_t, gL_t = cpasync.tma_partition(tma_lse, 0, one, cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            sD_t, gD_t = cpasync.tma_partition(tma_delta, 0, one,
                                               cute.group_modes(sDelta, 0, 1),
                                               cute.group_modes(gDelta, 0, 1))
            pipe_q.producer_acquire(state)
            bar_q = pipe_q.producer_get_barrier(state)
            cute.copy(tma_q, gQ_t[None, m_block], sQ_t[None, state.index], tma_bar_ptr=bar_q)
            cute.copy(tma_lse, gL_t[None, m_block], sL_t[None, state.index], tma_bar_ptr=bar_q)
            pipe_do.producer_acquire(state)
            bar_do = pipe_do.producer_get_barrier(state)
            cute.copy(tma_do, gdO_t[None, m_block], sdO_t[None, state.index], tma_bar_ptr=bar_do)
            cute.copy(tma_delta, gD_t[None, m_block], sD_t[None, state.index],
                      tma_bar_ptr=bar_do)
            state.advance()
            g, pos = steps.advance(g, pos)

    @cute.jit
    def _store_dq(self, mdQ, sdQ, mSem, mKeyBlocks, n_block, num_n_blocks, batch, rotated,
                  dq_fresh, parts: cutlass.Constexpr, steps: BwdStepScheduler, num_steps):
        """Lane 0 reduces the dQ ``parts`` (warp groups) of every step into their fragment-order
        blocks of mdQ (bulk copies are tracked per issuing thread, so one lane issues and
        waits). Deterministic with ``dq_fresh``, a tile's first turn stores its part instead,
        so that the caller skips zeroing the whole accumulator, a pass over as many bytes as
        the fp32 dQ."""
        lane = cute.arch.lane_idx()
        part_bytes = self.dq_part * Float32.width // 8
        if const_expr(self.rotates):
            if rotated != 0:
                # Rotated, a tile's order counts this block's group alone after the groups before
                # it (_dq_turn): held in num_n_blocks, since the warp runs in load_regs registers.
                num_n_blocks = self._rotation_group(n_block, num_n_blocks, rotated)[1]
        g, pos = steps.start()
        for step in cutlass.range(num_steps, unroll=1):
            head, m_block = steps.coords(g, pos)
            if const_expr(not self.deterministic):
                for i in cutlass.range_constexpr(len(parts)):
                    if lane == 0:
                        # The previous reduction out of this buffer must have read it.
                        cute.arch.cp_async_bulk_wait_group(len(parts) - 1 - i, read=True)
                    cute.arch.sync_warp()
                    self._hand_back_dq(parts[i])
            elif const_expr(not self.dq_warps_meet):
                for i in cutlass.range_constexpr(len(parts)):
                    self._hand_back_dq(parts[i])  # the last reductions landed (pass_turn)
            else:
                if step == 0:
                    self._hand_back_dq(parts[0])
            if const_expr(self.dq_warps_meet and parts[0] == 1):
                cute.arch.barrier(barrier_id=BwdBarrier.DQ_MEET, number_of_threads=64)
            store = Int32(0)
            if const_expr(self.deterministic):
                # Wait for the KV blocks that add into this dQ tile (or part) before this one.
                turn = self._dq_turn(mKeyBlocks, n_block, num_n_blocks, batch, m_block, rotated, steps)
                sem_ptr = mSem[None, head, batch].iterator + m_block * self.dq_turns
                if const_expr(self.dq_turns > 1):
                    sem_ptr = sem_ptr + parts[0]
                wait_turn(sem_ptr, turn)
                if const_expr(not self.has_docs):  # with documents a tile may have no turn at all
                    if (dq_fresh != 0) & (turn == 0):
                        store = Int32(1)
            gdQ = mdQ[None, head, batch].iterator + m_block * NUM_MMA_WG * self.dq_part
            for i in cutlass.range_constexpr(len(parts)):
                wg = parts[i]
                cute.arch.barrier(barrier_id=BwdBarrier.DQ_FULL + wg, number_of_threads=WG_THREADS + 32)
                if const_expr(self.dq_warps_meet and wg == 0):
                    cute.arch.barrier(barrier_id=BwdBarrier.DQ_MEET, number_of_threads=64)
                if lane == 0:
                    if store != 0:
                        bulk_store(gdQ + wg * self.dq_part, sdQ[None, wg].iterator, part_bytes)
                    else:
                        bulk_reduce_add_f32(gdQ + wg * self.dq_part, sdQ[None, wg].iterator,
                                             part_bytes)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if const_expr(self.dq_warps_meet):
                    # Meeting, a warp has no step of slack left for the landing: its buffer goes
                    # back once read, and its warp group writes the next part while the
                    # reduction lands and the turn passes.
                    if step + 1 < num_steps:
                        if lane == 0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.sync_warp()
                        self._hand_back_dq(parts[0])
                pass_turn(sem_ptr)  # landed before the next KV block may add
            g, pos = steps.advance(g, pos)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _hand_back_dq(self, wg: cutlass.Constexpr):
        """Warp group wg may write its next dQ part into its buffer."""
        cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_EMPTY + wg, number_of_threads=WG_THREADS + 32)

    @cute.jit
    def _dq_turn(self, mKeyBlocks, n_block, num_n_blocks, batch, m_block, rotated,
                 steps: BwdStepScheduler):
        """Deterministic: how many KV blocks add into dQ tile m_block before this one: blocks
        0 .. n_block-1, or for causal the blocks after this one (descending order); with
        documents counted within the contiguous run of blocks that visits the tile; rotated
        (num_n_blocks then the blocks of this one's group), every block of the groups before
        this block's, then the blocks of its group in the order their walks reach the tile."""
        turn = n_block
        if const_expr(self.has_docs):
            turn = (mKeyBlocks[batch, m_block, 1] - n_block if const_expr(self.causal)
                    else n_block - mKeyBlocks[batch, m_block, 0])
        elif const_expr(self.causal):
            n_visible = cutlass.min(((m_block + 1) * self.tile_m - 1) // self.tile_n + 1,
                                    num_n_blocks)
            turn = n_visible - 1 - n_block
        if const_expr(self.rotates):
            if rotated != 0:
                turn = self._rotated_turn(n_block, m_block, num_n_blocks, steps.steps_per_head,
                                          steps.rotation)
        return turn

    @cute.jit
    def _rotation_group(self, n_block, num_n_blocks, rotate):
        """The first K/V block of n_block's rotated group and the group's size (groups of
        ``rotate`` blocks, the last one smaller where they do not divide num_n_blocks)."""
        first = n_block // rotate * rotate
        return first, cutlass.min(rotate, num_n_blocks - first)

    @cute.jit
    def _rotated_turn(self, n_block, m_block, num_n_blocks, num_m_blocks, rotation):
        """This K/V block's place among the N blocks of its group that reduce into dQ tile m_block,
        when the group's block n walks from query block n * M // N (``rotation``): the order in
        which they reach the tile, the earlier start first on a tie, after the blocks of the groups
        before (n_block counts them: groups are N blocks each but the last)."""
        n, m = num_n_blocks, num_m_blocks
        step = m_block - rotation  # the step at which this block reaches the tile
        if step < 0:
            step = step + m
        # Blocks whose walk starts in (m_block - step, m_block], cyclically, reach it sooner;
        # ceil((x + 1) N / M) walks start at query blocks <= x.
        lo = m_block - step
        sooner = ((m_block + 1) * n + m - 1) // m
        if lo >= 0:
            sooner = sooner - ((lo + 1) * n + m - 1) // m
        else:
            sooner = sooner + n - ((lo + m + 1) * n + m - 1) // m
        return sooner + n_block - (rotation * n + m - 1) // m

    @cute.jit
    def _mma(self, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ,
             pipe_q, pipe_do, mbar_kv, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma,
             mma_dq: cute.TiledMma, tidx, softmax_scale, scale_log2,
             seqlen_q, seqlen_k, n_block, batch, mQueryLo, mQueryHi, steps: BwdStepScheduler,
             num_steps):
        """The main loop of the MMA warp groups; returns this thread's dK, dV accumulators.
        Per query tile: S^T, dP^T; P^T (mask, exp2); dS^T; dS to shared memory; dV += P^T dO;
        dQ = dS K; dK += dS^T Q; the dQ part handed to the dQ warp.
        Staggered, group 0 multiplies each step's dS into dQ one step late (none at its first
        step, the last after its walk), so that each group waits only for a dS the other stored
        a while ago; the two walks are separate code, since a branch around a wgmma in flight
        makes ptxas serialize every wgmma of the kernel.
        The loop touches ops only through calls on self: the DSL carries any object whose
        methods a loop body calls as loop state, compile-time shapes included."""
        ops = self._mma_operands(sQ, sK, sV, sdO, sdS, sdQ, mma_sdp, mma_dkv, mma_dq, tidx)
        if const_expr(self.has_docs):
            self._key_ranges(ops, mQueryLo[batch, None], mQueryHi[batch, None], n_block, seqlen_k)
        args = (ops, sLSE, sDelta, pipe_q, pipe_do, mma_sdp, mma_dkv, mma_dq, softmax_scale, scale_log2,
                seqlen_q, seqlen_k, n_block)

        cute.arch.mbarrier_wait(mbar_kv, 0)
        state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Consumer, self.stages)
        g, pos = steps.start()
        if const_expr(self.staggered):
            if ops.wg == 0:
                if num_steps > 0:  # (a K/V block no query of its documents sees walks none)
                    self._walk_step(args, state, Int32(0), steps.coords(g, pos)[1], dq_lag=None)
                    state.advance()
                    g, pos = steps.advance(g, pos)
                    for step in cutlass.range(1, num_steps, unroll=1):
                        self._walk_step(args, state, step, steps.coords(g, pos)[1], dq_lag=1)
                        state.advance()
                        g, pos = steps.advance(g, pos)
                    acc_dq = cute.make_rmem_tensor(ops.acc_shape_dq, Float32)
                    last = (num_steps - 1) % DS_BUFFERS
                    self._wait_ds(ops, last)
                    self._dq_product(ops, mma_dq, acc_dq, last, wait=0)
                    self._hand_dq(ops, acc_dq)
            else:
                for step in cutlass.range(num_steps, unroll=1):
                    self._walk_step(args, state, step, steps.coords(g, pos)[1], dq_lag=0)
                    state.advance()
                    g, pos = steps.advance(g, pos)
        else:
            for step in cutlass.range(num_steps, unroll=1):
                self._walk_step(args, state, step, steps.coords(g, pos)[1], dq_lag=0)
                state.advance()
                g, pos = steps.advance(g, pos)
        return ops.acc_dK, ops.acc_dV

    @cute.jit
    def _walk_step(self, args, state, step, m_block, dq_lag: cutlass.Constexpr):
        """_step; with split_steps, in two copies, with and without the mask, chosen per step (the
        copy without runs no branch between the S^T product and the exp2s), else in one that
        decides inside."""
        ops, *_, seqlen_q, seqlen_k, n_block = args
        if const_expr(self.split_steps):
            if self._needs_mask(ops, m_block, n_block, seqlen_q, seqlen_k):
                self._step(*args, state, step, m_block, dq_lag=dq_lag, masked=True)
            else:
                self._step(*args, state, step, m_block, dq_lag=dq_lag, masked=False)
        else:
            self._step(*args, state, step, m_block, dq_lag=dq_lag, masked=None)

    @cute.jit
    def _step(self, ops, sLSE, sDelta, pipe_q, pipe_do, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma,
              mma_dq: cute.TiledMma, softmax_scale, scale_log2, seqlen_q, seqlen_k, n_block,
              state, step, m_block, dq_lag: cutlass.Constexpr, masked: cutlass.Constexpr):
        """Query tile m_block, the walk's step ``step``, ``state`` its pipeline stage (released
        here, advanced by the caller); the dQ product of step ``step - dq_lag`` (None: no dQ
        product); ``masked``: whether the scores go through the mask (None: decided in the step)."""
        stage = state.index

        pipe_q.consumer_wait(state)
        acc_s = cute.make_rmem_tensor(ops.acc_shape_s, Float32)
        wgmma.gemm(mma_sdp, acc_s, ops.tSrK, ops.tSrQ[None, None, None, stage], zero_init=True, wait=-1)
        # (split_steps: the masked copy reads the lse late, as the one body did where an early read
        # measured slower; early in both copies was not timed)
        lse2 = self._row_stats(ops, sLSE, stage) if const_expr(self.early_stats and not masked) else None
        pipe_do.consumer_wait(state)
        acc_dp = cute.make_rmem_tensor(ops.acc_shape_s, Float32)
        wgmma.gemm(mma_sdp, acc_dp, ops.tdPrV, ops.tdPrdO[None, None, None, stage], zero_init=True, wait=1)

        p = self._probabilities(ops, acc_s, lse2, sLSE, stage, scale_log2, m_block, n_block, seqlen_q,
                                seqlen_k, masked)
        warpgroup.wait_group(0)
        ds = self._score_grads(ops, acc_s, acc_dp, sDelta, stage, softmax_scale)
        ds_buf = step % DS_BUFFERS if const_expr(self.staggered) else stage
        self._store_ds(ops, ds, ds_buf)

        wgmma.gemm(mma_dkv, ops.acc_dV, wgmma.acc_as_operand_a(p), ops.tdVrdO[None, None, None, stage],
                   zero_init=False, wait=-1)
        cute.arch.fence_view_async_shared()
        acc_dq = cute.make_rmem_tensor(ops.acc_shape_dq, Float32)
        if const_expr(self.staggered):
            cute.arch.barrier_arrive(barrier_id=BwdBarrier.DS_READY + DS_BUFFERS * ops.wg + ds_buf,
                                     number_of_threads=NUM_MMA_WG * WG_THREADS)
            if const_expr(dq_lag is None):
                warpgroup.wait_group(0)
            else:
                dq_buf = (step - dq_lag) % DS_BUFFERS
                self._wait_ds(ops, dq_buf)
                self._dq_product(ops, mma_dq, acc_dq, dq_buf, wait=1)
        else:
            cute.arch.barrier(barrier_id=BwdBarrier.PDS, number_of_threads=NUM_MMA_WG * WG_THREADS)
            self._dq_product(ops, mma_dq, acc_dq, stage, wait=1)
        pipe_do.consumer_release(state)  # the dV product has read dO
        wgmma.gemm(mma_dkv, ops.acc_dK, wgmma.acc_as_operand_a(ds), ops.tdKrQ[None, None, None, stage],
                   zero_init=False, wait=1)
        if const_expr(dq_lag is not None):
            self._hand_dq(ops, acc_dq)

        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)

    @cute.jit
    def _dq_product(self, ops, mma_dq, acc_dq, buf, wait: cutlass.Constexpr):
        """This group's dQ part = dS K from dS buffer ``buf`` (issued; ``wait`` wgmma groups
        left in flight)."""
        wgmma.gemm(mma_dq, acc_dq, ops.tdQrdS[None, None, None, buf], ops.tdQrK, zero_init=True, wait=wait)

    @cute.jit
    def _wait_ds(self, ops, buf):
        """Staggered: until the other group's dS is in dS buffer ``buf``."""
        cute.arch.barrier(barrier_id=BwdBarrier.DS_READY + DS_BUFFERS * (1 - ops.wg) + buf,
                          number_of_threads=NUM_MMA_WG * WG_THREADS)

    def _mma_operands(self, sQ, sK, sV, sdO, sdS, sdQ, mma_sdp, mma_dkv, mma_dq, tidx):
        """This thread's operands of the five products, its dK/dV accumulators (zeroed) and the
        copies of dS and dQ out of its registers; built once per CTA."""
        d = self.head_dim
        ops = SimpleNamespace(wg=cute.arch.make_warp_uniform(tidx // WG_THREADS))
        wg_sdp = mma_sdp.get_slice(ops.wg * WG_THREADS)
        wg_dkv = mma_dkv.get_slice(ops.wg * WG_THREADS)
        wg_dq = mma_dq.get_slice(ops.wg * WG_THREADS)
        thr_sdp = mma_sdp.get_slice(tidx)

        # Operand fragments (shared memory descriptors; last mode = pipeline stage).
        ops.tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        ops.tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        ops.tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        ops.tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        ops.tdVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose(sdO)))
        ops.tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose(sQ)))
        ops.tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        ops.tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transpose(sK)))
        ops.acc_shape_dq = mma_dq.partition_shape_C((self.tile_m, d))

        ops.acc_shape_s = mma_sdp.partition_shape_C((self.tile_n, self.tile_m))
        ops.acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        ops.acc_dV = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        ops.acc_dK.fill(0.0)
        ops.acc_dV.fill(0.0)

        # dS^T registers -> dS in shared memory (transposing 8x8 stores).
        ops.r2s_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                self.dtype), mma_sdp)
        ops.thr_r2s_ds = ops.r2s_ds.get_slice(tidx)
        ops.tdSs = ops.thr_r2s_ds.partition_D(transpose(sdS))
        # dQ registers -> this warp group's fp32 buffer in fragment order: register group i of
        # thread t at (i * WG threads + t) * 4, one 512-byte line per warp and store.
        dq_regs = self.dq_part // WG_THREADS
        ops.dq_store = (REGS_PER_STORE, dq_regs // REGS_PER_STORE)
        ops.tdQs = cute.make_tensor(
            sdQ[None, ops.wg].iterator + (tidx % WG_THREADS) * REGS_PER_STORE,
            cute.make_layout(ops.dq_store, stride=(1, REGS_PER_STORE * WG_THREADS)))

        # (key, query) coordinates of the S^T elements this thread (runtime) and thread 0
        # (compile-time) hold, in the (query, key) rows x cols view.
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        ops.cS = acc_rows_view(thr_sdp.partition_C(cS), transpose=True)
        ops.cS0 = acc_rows_view(mma_sdp.get_slice(0).partition_C(cS), transpose=True)
        for r in range(cute.size(ops.cS0, mode=[0])):  # stats_layout's contract, on thread 0's rows
            assert stats_position(ops.cS0[r, 0][1]) == r % THREAD_ROWS + ROW_GROUP * (r // THREAD_ROWS)
        return ops

    @cute.jit
    def _row_stats(self, ops, sStat, stage):
        """This thread's query rows' values of a per-row statistic (lse2, delta) of the stage, in
        the order of its accumulator rows (stats_layout.py)."""
        return thread_stats(sStat[None, stage], ops.cS[0, 0][1], cute.size(ops.cS, mode=[0]))

    @cute.jit
    def _key_ranges(self, ops, query_lo, query_hi, n_block, seqlen_k):
        """With documents, read once per CTA: per key column of this thread the queries that key
        is visible to (ops.query_lo / query_hi; empty past seqlen_k), and [block_lo, block_hi),
        the queries every key of the block sees: both ends are nondecreasing along the keys
        (visible_blocks), so the last key's lo and the first key's hi."""
        n_base = n_block * self.tile_n
        cols = cute.size(ops.cS, mode=[1])
        ops.query_lo = cute.make_rmem_tensor(cols, Int32)
        ops.query_hi = cute.make_rmem_tensor(cols, Int32)
        for c in cutlass.range_constexpr(cols):
            key = n_base + ops.cS[0, c][0]
            at = cutlass.min(key, seqlen_k - 1)
            lo = query_lo[at]
            ops.query_lo[c] = lo
            ops.query_hi[c] = query_hi[at] if key < seqlen_k else lo
        ops.block_lo = query_lo[cutlass.min(n_base + self.tile_n, seqlen_k) - 1]
        ops.block_hi = query_hi[n_base]

    @cute.jit
    def _needs_mask(self, ops, m_block, n_block, seqlen_q, seqlen_k):
        """Whether query tile m_block's scores against this K/V block need the mask: only a key
        block past seqlen_k, crossing the causal diagonal or (has_docs) with a query outside the
        range that every key of the block sees (_key_ranges) does."""
        n_base = n_block * self.tile_n
        needs_mask = n_base + self.tile_n > seqlen_k
        if const_expr(self.has_docs):
            # (The key ranges hold the causal diagonal.)
            first = m_block * self.tile_m
            last = cutlass.min(first + self.tile_m, seqlen_q) - 1
            needs_mask = needs_mask | (first < ops.block_lo) | (last >= ops.block_hi)
        elif const_expr(self.causal):
            needs_mask = needs_mask or (n_base + self.tile_n - 1 > m_block * self.tile_m)
        return needs_mask

    @cute.jit
    def _probabilities(self, ops, acc_s, lse2, sLSE, stage, scale_log2, m_block, n_block, seqlen_q,
                       seqlen_k, masked: cutlass.Constexpr):
        """P^T = exp2(S^T * scale * log2(e) - lse2) in place in acc_s (masked entries give
        exp2(-inf) = 0), and P^T in 16 bits. ``masked``: whether the step needs the mask (None:
        decided here, _needs_mask)."""
        s_mn = acc_rows_view(acc_s, transpose=True)  # (query, key)
        if const_expr(masked is None):
            if const_expr(self.has_mask):
                if self._needs_mask(ops, m_block, n_block, seqlen_q, seqlen_k):
                    self._mask(ops, s_mn, m_block, n_block, seqlen_k)
        elif const_expr(masked):
            self._mask(ops, s_mn, m_block, n_block, seqlen_k)
        if const_expr(lse2 is None):
            lse2 = self._row_stats(ops, sLSE, stage)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r], fastmath=True)
        p = cute.make_rmem_tensor(ops.acc_shape_s, self.dtype)
        p.store(acc_s.load().to(self.dtype))
        return p

    @cute.jit
    def _mask(self, ops, s_mn, m_block, n_block, seqlen_k):
        """-inf where a query does not see a key: outside the key's document range (has_docs), else
        past seqlen_k or (causal) after the query."""
        if const_expr(self.has_docs):
            self.attention_mask.apply_key_ranges(s_mn, ops.cS, ops.cS0, m_block, ops.query_lo, ops.query_hi)
        else:
            self.attention_mask.apply(s_mn, ops.cS, ops.cS0, m_block, n_block, seqlen_k)

    @cute.jit
    def _score_grads(self, ops, acc_p, acc_dp, sDelta, stage, softmax_scale):
        """dS^T = P^T * (dP^T * scale - delta) in place in acc_dp (delta is already scaled), and
        dS^T in 16 bits. With ds_from_p computed as dP^T * (P^T * scale) - P^T * delta, one
        instruction more per element, so that no instruction reading dP^T can run before its
        element's exp2 (ptxas still waits for dP^T before the first exp2: the wait sits before
        the first load of delta; RESULTS, 4af03c1)."""
        s_mn = acc_rows_view(acc_p, transpose=True)
        dp_mn = acc_rows_view(acc_dp, transpose=True)
        delta = self._row_stats(ops, sDelta, stage)
        for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                if const_expr(self.ds_from_p):
                    dp_mn[r, c] = dp_mn[r, c] * (s_mn[r, c] * softmax_scale) - s_mn[r, c] * delta[r]
                else:
                    dp_mn[r, c] = s_mn[r, c] * (dp_mn[r, c] * softmax_scale - delta[r])
        ds = cute.make_rmem_tensor(ops.acc_shape_s, self.dtype)
        convert_to(acc_dp, ds)  # once: dS has two readers, its shared-memory store and dK
        return ds

    @cute.jit
    def _store_ds(self, ops, ds, buf):
        """dS^T registers -> dS in shared memory buffer ``buf``, the dQ product's A operand. In
        lockstep dS is double buffered by pipeline stage: the buffer written here was last read by
        the dQ product two steps ago, which both warp groups finished before the PDS barrier of
        the previous step. Staggered, the buffers go by step (DS_BUFFERS says why three)."""
        cute.copy(ops.r2s_ds, ops.thr_r2s_ds.retile(ds), ops.tdSs[None, None, None, buf])

    @cute.jit
    def _hand_dq(self, ops, acc_dq):
        """This warp group's dQ part -> shared memory -> the dQ warp, which adds it into global
        memory."""
        cute.arch.barrier(barrier_id=BwdBarrier.DQ_EMPTY + ops.wg, number_of_threads=WG_THREADS + 32)
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout(ops.dq_store)), ops.tdQs)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_FULL + ops.wg,
                                 number_of_threads=WG_THREADS + 32)

    @cute.jit
    def _epilogue_dkv(self, acc_dK, acc_dV, tiles, sdKV_layout: cute.ComposedLayout, tdK, tdV,
                      tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom,
                      tma_dk_store: Optional[cute.CopyAtom], tma_dv_store: Optional[cute.CopyAtom],
                      mma_dkv: cute.TiledMma, tidx, n_block, kv_head, batch,
                      mSemKV: Optional[cute.Tensor], share, head_splits, dkv_fresh):
        """Stage dK and dV in the Q/dO/K/V tiles and store (or add, for fp32 buffers) them with
        TMA; the tensor map clips rows past seqlen_k. Deterministic, the head_splits shares of
        one (K/V block, kv head) add in the order of their query heads, so that the sums' bits do
        not depend on which share finishes first; with dkv_fresh the first of them stores
        (tma_dk_store, tma_dv_store), into sums nobody zeroed."""
        sdV, sdK = self._stage_dkv(acc_dK, acc_dV, tiles, sdKV_layout, mma_dkv, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BwdBarrier.EPILOGUE, number_of_threads=NUM_MMA_WG * WG_THREADS)
        if cute.arch.make_warp_uniform(tidx // 32) == 0:
            if const_expr(self.deterministic):
                if head_splits > 1:
                    wait_turn(mSemKV[None, kv_head, batch].iterator + n_block, share)
                    cute.arch.sync_warp()
            one = cute.make_layout(1)
            first = Int32(0)
            if const_expr(self.first_share_stores):
                if (dkv_fresh != 0) & (share == 0):
                    first = Int32(1)
            for tma, tma_store, gOut, sOut in ((tma_dv, tma_dv_store, tdV, sdV),
                                               (tma_dk, tma_dk_store, tdK, sdK)):
                g = cute.local_tile(gOut[None, None, kv_head, batch], (self.tile_n, self.head_dim),
                                    (n_block, 0))
                s_t, g_t = cpasync.tma_partition(tma, 0, one, cute.group_modes(sOut, 0, 2),
                                                 cute.group_modes(g, 0, 2))
                if const_expr(self.first_share_stores):
                    if first != 0:
                        cute.copy(tma_store, s_t, g_t)
                    else:
                        cute.copy(tma, s_t, g_t)
                else:
                    cute.copy(tma, s_t, g_t)
            cute.arch.cp_async_bulk_commit_group()
            # Shared memory must outlive the reads of the copies (and, ordered, the next share
            # adds only once they have landed).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(self.deterministic):
                if head_splits > 1:
                    pass_turn(mSemKV[None, kv_head, batch].iterator + n_block)

    @cute.jit
    def _stage_dkv(self, acc_dK, acc_dV, tiles, sdKV_layout: cute.ComposedLayout, mma_dkv: cute.TiledMma,
                   tidx):
        """dV and dK in stage_dtype in the Q/dO/K/V tiles, once both warp groups are past their
        last product (each dQ product reads all of K); returns the two tiles."""
        cute.arch.barrier(barrier_id=BwdBarrier.EPILOGUE, number_of_threads=NUM_MMA_WG * WG_THREADS)
        sdV = carve(tiles, sdKV_layout, self.stage_dtype)
        sdK = carve(tiles + self.sdKV_elems, sdKV_layout, self.stage_dtype)
        if const_expr(self.stage_dtype.width == 16):
            r2s = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                      self.stage_dtype)
        else:
            r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        thr_r2s = cute.make_tiled_copy_C(r2s, mma_dkv).get_slice(tidx)
        for acc, sOut in ((acc_dV, sdV), (acc_dK, sdK)):
            frag = cute.make_rmem_tensor(acc.shape, self.stage_dtype)
            frag.store(acc.load().to(self.stage_dtype))
            cute.copy(thr_r2s, thr_r2s.retile(frag), thr_r2s.partition_D(sOut))
        return sdV, sdK

    @cute.jit
    def _epilogue_shares(self, acc_dK, acc_dV, tiles, sdKV_layout: cute.ComposedLayout, mdK, mdV,
                         mma_dkv: cute.TiledMma, tidx, n_block, kv_head, batch, share, mbar_shares):
        """cluster_shares: each CTA of the cluster (one share of a (K/V block, kv head), its rank
        the share) stages its fp32 dK, dV; once all have, CTA r sums rows r * tile_n / S ..
        (r + 1) * tile_n / S - 1 of every share in share order, the order of the fp32 reduce-adds
        without a cluster (so the same bits), and writes them in dtype. A CTA leaves only after
        every peer has read its tiles."""
        shares = self.cluster_shares
        mma_threads = NUM_MMA_WG * WG_THREADS
        staged, read = mbar_shares, mbar_shares + 1
        self._stage_dkv(acc_dK, acc_dV, tiles, sdKV_layout, mma_dkv, tidx)
        cute.arch.barrier(barrier_id=BwdBarrier.EPILOGUE, number_of_threads=mma_threads)
        if tidx == 0:
            cute.arch.fence_acq_rel_cluster()  # the staged tiles before the peers' reads
            for r in cutlass.range_constexpr(shares):
                cute.arch.mbarrier_arrive(staged, r)
        cute.arch.mbarrier_wait(staged, 0)
        cute.arch.fence_acq_rel_cluster()
        rows = self.tile_n // shares
        quads = self.head_dim // 4  # 16-byte pieces of a staged row
        seqlen_k = mdK.shape[0]
        for t, mOut in ((0, mdV), (1, mdK)):
            base = cute.recast_ptr(tiles + t * self.sdKV_elems, dtype=Float32)
            peers = [cute.arch.map_dsmem_ptr(base, r) for r in range(shares)]
            for i in cutlass.range_constexpr(rows * quads // mma_threads):
                piece = i * mma_threads + tidx
                row = share * rows + piece // quads
                col = piece % quads * 4
                offset = _staged_offset(row, col, self.tile_n)
                total = cute.make_rmem_tensor((4,), Float32)
                part = cute.make_rmem_tensor((4,), Float32)
                for r in cutlass.range_constexpr(shares):
                    src = cute.make_tensor(peers[r] + offset, cute.make_layout(4))
                    if const_expr(r == 0):
                        cute.autovec_copy(src, total)
                    else:
                        cute.autovec_copy(src, part)
                        total.store(total.load() + part.load())
                out = cute.make_rmem_tensor((4,), self.dtype)
                out.store(total.load().to(self.dtype))
                key = n_block * self.tile_n + row
                if key < seqlen_k:
                    cute.autovec_copy(out, cute.local_tile(mOut[key, None, kv_head, batch], (4,), (col // 4,)))
        cute.arch.barrier(barrier_id=BwdBarrier.EPILOGUE, number_of_threads=mma_threads)
        if tidx == 0:
            for r in cutlass.range_constexpr(shares):
                cute.arch.mbarrier_arrive(read, r)
        cute.arch.mbarrier_wait(read, 0)


@cute.jit
def _staged_offset(row, col, tile_n: cutlass.Constexpr):
    """Element offset of (row, col), col a multiple of 4, in an fp32 tile of wgmma.smem_layout:
    128-byte swizzle atoms of 8 rows x 32 columns, stacked along the rows first; the swizzle
    XORs a row's 16-byte piece index with row % 8, so four columns from a multiple of 4 stay
    together."""
    r8 = row % 8
    return (r8 * 32 + row // 8 * 256 + ((col % 32 // 4) ^ r8) * 4 + col // 32 * (tile_n * 32))
