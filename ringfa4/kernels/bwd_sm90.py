"""Attention backward for Hopper (sm_90a) in CuTe DSL, from a given lse.

One CTA owns a (tile_n x head_dim) block of K and V for one kv head and walks over every
query tile that sees it (of every query head sharing that kv head, so GQA needs no dK/dV
reduction), recomputing P from the lse it is given:

    S^T = K Q^T          P^T = exp2(S^T * scale * log2(e) - lse * log2(e))
    dP^T = V dO^T        dS^T = P^T * (dP^T * scale - delta),  delta = scale * rowsum(dO * O)
    dV += P^T dO         dK += dS^T Q          dQ += dS K  (fp32, bulk reduce-add into global)

(dS carries the softmax scale, so dQ and dK need no multiply of their own.)

Warp roles (384 threads): warp 0 loads Q, dO, lse, delta through a two-stage TMA pipeline;
warp 1 reduces each dQ tile into global memory (cp.reduce.async.bulk add); warp groups
1 and 2 each own 64 rows of the K/V block for S, dP, dV and dK, and half of the dQ tile. S and
dP are computed transposed so that P^T and dS^T stay in registers as the A operand of the dV
and dK products; only dS goes through shared memory (for dQ). dK and dV stay in registers
until the CTA is done; then they are staged in the idle Q/dO/K/V tiles and written (or added,
into fp32 buffers) by two TMA bulk copies, whole 128-byte lines instead of scattered per-thread
stores. No other CTA touches them. delta and the lse in log2 units come from bwd_preprocess.py.

dQ is accumulated in "fragment order": each warp group's half of a dQ tile is one contiguous
block of (tile_m * head_dim / 2) floats in the order its threads hold them, four registers of
a thread side by side and threads interleaved, so that every 16-byte shared store of a warp is
one conflict-free 512-byte line and the reduction into global memory is one linear bulk copy.
(Row-major tiles, as a tensor TMA needs, cost 3-4x the shared-store wavefronts: the swizzle
cannot separate the row pairs a wgmma accumulator writes together.) dq_layout.py holds that
layout; bwd_postprocess.py puts dQ back in (b, s, h, d).

Deterministic mode orders the dQ reductions: the reduction of KV block j into a dQ tile waits
on a per-tile counter until the blocks before it in a fixed order have landed (ascending, or
descending for causal so that no CTA waits for the long-running low blocks). CTAs are launched
with the KV block as the fastest grid index, in that same order, so a CTA only ever waits on
CTAs launched before it.
"""
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ringfa4.backends.cute import DTYPE_NAMES, tma_compatible, tma_ready
from ringfa4.kernels import wgmma
from ringfa4.kernels.bwd_postprocess import DqPostprocessConfig
from ringfa4.kernels.dq_layout import (NUM_MMA_WG, REGS_PER_STORE, WG_THREADS, parts_split_rows,
                                       query_tile)
from ringfa4.kernels.softmax import LOG2_E, convert_to

# Named barriers (id 0 is __syncthreads).
_BAR_PDS = 1  # dS tile of both MMA warp groups is in shared memory
_BAR_DQ_FULL = 2  # + warp group: its dQ part is in shared memory (MMA WG -> dQ warp)
_BAR_DQ_EMPTY = 4  # + warp group: its dQ buffer may be overwritten (dQ warp -> MMA WG)
_BAR_EPILOGUE = 6  # MMA warp groups: the tiles are free for / hold the staged dK, dV


def _seq_major(t: cute.Tensor) -> cute.Tensor:
    """(b, s, h, d) -> (s, d, h, b): the two tiled modes first, as TMA and local_tile want."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


@dsl_user_op
def _bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *,
                         loc=None, ip=None):
    """global[0:n] += shared[0:n] (fp32) as one asynchronous bulk copy of the issuing thread;
    completes with cp.async.bulk.commit_group / wait_group."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _carve(ptr, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """The swizzled shared-memory tile ``layout`` of ``dtype`` elements at ``ptr``."""
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)


def _transpose(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a shared memory tensor (a view, no data movement)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def _acc_mn(acc: cute.Tensor, transpose: bool) -> cute.Tensor:
    """View a wgmma accumulator ((2, 2, V), M, N) as (rows, cols) of the product
    ((rows, cols) of its transpose when ``transpose``)."""
    lay = cute.make_layout(acc.layout.shape)
    shape = ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[0][2], lay.shape[2]))
    stride = (
        (lay.stride[0][1], lay.stride[1]),
        (lay.stride[0][0], lay.stride[0][2], lay.stride[2]),
    )
    if const_expr(transpose):
        shape, stride = (shape[1], shape[0]), (stride[1], stride[0])
    return cute.make_tensor(
        acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride))
    )


class AttentionBackwardSm90:
    """Compile-time configuration of the backward kernel; call it under ``cute.compile``.

    dtype: Float16 or BFloat16 (q, k, v, dout). head_dim: 64 or 128. dkv_dtype: dtype of
    dk/dv; Float32 means "add into", the input dtype means "overwrite". dq is always an fp32
    buffer that the kernel adds into.
    """

    num_threads = (NUM_MMA_WG + 1) * WG_THREADS

    def __init__(self, dtype, head_dim: int, causal: bool, deterministic: bool, dkv_dtype):
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise ValueError(f"dtype must be Float16 or BFloat16, got {dtype}")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if dkv_dtype not in (dtype, Float32):
            raise ValueError(f"dkv_dtype must be {dtype} or Float32, got {dkv_dtype}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.deterministic = deterministic
        self.dkv_dtype = dkv_dtype
        self.tile_n = 64 * NUM_MMA_WG
        # Register budget per MMA thread: S^T, dP^T (tile_m / 2 each) + dK, dV (head_dim / 2 each).
        self.tile_m = query_tile(head_dim)
        self.stages = 2
        # dQ = dS K is split over the two MMA warp groups along rows when tile_m = 128, else
        # along head_dim; each warp group reduces its own 64 x 64 part.
        self.dq_split_rows = parts_split_rows(head_dim)
        self.dq_cols = head_dim if self.dq_split_rows else head_dim // NUM_MMA_WG
        self.dq_part = self.tile_m * head_dim // NUM_MMA_WG
        self.mma_regs = 240
        self.load_regs = 24

    # ---------------------------------------------------------------- host side (traced once)
    def _layouts(self):
        d = self.head_dim
        self.sQ_layout = wgmma.smem_layout(self.dtype, self.tile_m, d, self.stages)
        self.sdO_layout = wgmma.smem_layout(self.dtype, self.tile_m, d, self.stages)
        self.sK_layout = wgmma.smem_layout(self.dtype, self.tile_n, d)
        self.sV_layout = wgmma.smem_layout(self.dtype, self.tile_n, d)
        self.sdS_layout = wgmma.smem_layout(self.dtype, self.tile_m, self.tile_n, self.stages)
        self.sdKV_layout = wgmma.smem_layout(self.dkv_dtype, self.tile_n, d)

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
        stats = self.tile_m * self.stages
        # Q, dO, K, V back to back, in elements of dtype; the dK/dV epilogue reuses the region.
        self.tile_offsets = (0, d_q, 2 * d_q, 2 * d_q + d_k)
        tile_elems = 2 * d_q + 2 * d_k
        self.sdKV_elems = cute.cosize(self.sdKV_layout) * self.dkv_dtype.width // self.dtype.width
        assert 2 * self.sdKV_elems <= tile_elems, "dK and dV staging must fit in the Q/dO/K/V tiles"

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            lse: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            delta: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            tiles: cute.struct.Align[cute.struct.MemRange[self.dtype, tile_elems], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[self.dtype, d_s], 1024]
            dq: cute.struct.Align[cute.struct.MemRange[Float32, self.dq_part * NUM_MMA_WG], 1024]

        return Storage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mSem: Optional[cute.Tensor], softmax_scale: Float32,
                 stream):
        """q, dout (b, sq, h, d); k, v (b, sk, hk, d); lse2, delta (b, h, sq rounded up to
        tile_m) fp32, lse2 in log2 units with +inf on rows that see no key; dq_acc (b, h,
        sq tiles * tile_m * head_dim) fp32 in fragment order (dq_layout.py; added into); dk, dv
        (b, sk, hk, d) of dkv_dtype; sem (b, h, sq tiles) int32 zeros when deterministic, else
        None."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype
                      or mV.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("q, k, v, dout must all have the kernel's dtype")
        if const_expr(mdQ.element_type != Float32):
            raise TypeError("dq must be Float32")
        if const_expr(mdK.element_type != self.dkv_dtype or mdV.element_type != self.dkv_dtype):
            raise TypeError("dk, dv must have dkv_dtype")
        if const_expr(self.deterministic != (mSem is not None)):
            raise TypeError("sem is required exactly in deterministic mode")
        self._layouts()
        self._mmas()
        Storage = self._storage()

        mQ, mK, mV, mdO, mdK, mdV = (_seq_major(t) for t in (mQ, mK, mV, mdO, mdK, mdV))
        # (b, h, s) -> (s, h, b)
        mLSE, mDelta, mdQ = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                             for t in (mLSE, mDelta, mdQ))
        if const_expr(mSem is not None):
            mSem = cute.make_tensor(mSem.iterator, cute.select(mSem.layout, mode=[2, 1, 0]))

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
        # dK, dV: one owner CTA per block, so "add into" fp32 buffers is a plain reduce-add.
        s2g = (cpasync.CopyBulkTensorTileS2GOp() if const_expr(self.dkv_dtype == self.dtype)
               else cpasync.CopyReduceBulkTensorTileS2GOp())
        tma_dk, tdK = cpasync.make_tiled_tma_atom(s2g, mdK, self.sdKV_layout, (self.tile_n, d))
        tma_dv, tdV = cpasync.make_tiled_tma_atom(s2g, mdV, self.sdKV_layout, (self.tile_n, d))

        tile_bytes = self.dtype.width // 8 * d
        self.bytes_q = self.tile_m * tile_bytes + self.tile_m * 4
        self.bytes_kv = 2 * self.tile_n * tile_bytes

        num_kv_heads = cute.size(mK.shape[2])
        grid = (cute.ceil_div(cute.size(mK.shape[0]), self.tile_n), num_kv_heads,
                cute.size(mK.shape[3]))
        self.kernel(
            tQ, tK, tV, tdO, tLSE, tDelta, mdQ, tdK, tdV, mSem,
            tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dk, tma_dv,
            Float32(softmax_scale), Float32(softmax_scale * LOG2_E),
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sdS_layout,
            self.sdKV_layout, self.mma_sdp, self.mma_dkv, self.mma_dq, Storage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tQ: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor, tdO: cute.Tensor,
               tLSE: cute.Tensor, tDelta: cute.Tensor, mdQ: cute.Tensor, tdK: cute.Tensor,
               tdV: cute.Tensor, mSem: Optional[cute.Tensor],
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               tma_do: cute.CopyAtom, tma_lse: cute.CopyAtom, tma_delta: cute.CopyAtom,
               tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom,
               softmax_scale: Float32, scale_log2: Float32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdKV_layout: cute.ComposedLayout,
               mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
               Storage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        num_n_blocks = cute.ceil_div(tK.shape[0], self.tile_n)
        if const_expr(self.causal and self.deterministic):
            # Shortest KV blocks first: with the reversed reduction order of _store_dq, the
            # block a CTA waits for was launched before it and is one step ahead of it.
            n_block = num_n_blocks - 1 - n_block

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
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

        tiles = st.tiles.data_ptr()
        sQ, sdO, sK, sV = (
            _carve(tiles + offset, layout, self.dtype)
            for offset, layout in zip(self.tile_offsets, (sQ_layout, sdO_layout, sK_layout, sV_layout)))
        sdS = st.ds.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = st.lse.get_tensor(cute.make_layout((self.tile_m, self.stages)))
        sDelta = st.delta.get_tensor(cute.make_layout((self.tile_m, self.stages)))
        sdQ = st.dq.get_tensor(cute.make_layout((self.dq_part, NUM_MMA_WG)))

        seqlen_q = tQ.shape[0]
        seqlen_k = tK.shape[0]
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        # Causal (sq == sk): query tile m sees key block n iff its last row >= the block's first.
        m_block_min = 0
        if const_expr(self.causal):
            m_block_min = n_block * self.tile_n // self.tile_m
        steps_per_head = num_m_blocks - m_block_min
        # Every query head of this kv head's group (GQA) adds into the same dK, dV registers.
        group = tQ.shape[2] // tK.shape[2]
        num_steps = steps_per_head * group

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                self._load(tQ, tK, tV, tdO, tLSE, tDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                           tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, pipe_q, pipe_do,
                           mbar_kv, n_block, kv_head, kv_head * group, batch, m_block_min,
                           steps_per_head, num_steps)
            if warp_idx == 1:
                self._store_dq(mdQ, sdQ, mSem, n_block, num_n_blocks,
                               kv_head * group, batch, m_block_min, steps_per_head, num_steps)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            acc_dK, acc_dV = self._mma(
                sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, pipe_q, pipe_do, mbar_kv, mma_sdp,
                mma_dkv, mma_dq, tidx - WG_THREADS, softmax_scale, scale_log2,
                seqlen_k, n_block, m_block_min, steps_per_head, num_steps)
            self._epilogue_dkv(acc_dK, acc_dV, tiles, sdKV_layout, tdK, tdV, tma_dk, tma_dv,
                               mma_dkv, tidx - WG_THREADS, n_block, kv_head, batch)

    @cute.jit
    def _load(self, tQ, tK, tV, tdO, tLSE, tDelta, sQ, sK, sV, sdO, sLSE, sDelta,
              tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, pipe_q, pipe_do, mbar_kv,
              n_block, kv_head, head0, batch, m_block_min, steps_per_head, num_steps):
        """head0: first query head of kv_head's group."""
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
        for step in cutlass.range(num_steps, unroll=1):
            g = step // steps_per_head
            m_block = m_block_min + step - g * steps_per_head
            head = head0 + g
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

    @cute.jit
    def _store_dq(self, mdQ, sdQ, mSem, n_block, num_n_blocks, head0, batch, m_block_min,
                  steps_per_head, num_steps):
        """Lane 0 reduces each warp group's dQ part into its fragment-order block of mdQ
        (bulk copies are tracked per issuing thread, so one lane issues and waits)."""
        lane = cute.arch.lane_idx()
        part_bytes = self.dq_part * Float32.width // 8
        for step in cutlass.range(num_steps, unroll=1):
            g = step // steps_per_head
            m_block = m_block_min + step - g * steps_per_head
            head = head0 + g
            for wg in cutlass.range_constexpr(NUM_MMA_WG):
                if const_expr(not self.deterministic):
                    if lane == 0:
                        # The previous reduction out of this buffer must have read it.
                        cute.arch.cp_async_bulk_wait_group(NUM_MMA_WG - 1 - wg, read=True)
                    cute.arch.sync_warp()
                cute.arch.barrier_arrive(barrier_id=_BAR_DQ_EMPTY + wg,
                                         number_of_threads=WG_THREADS + 32)
            if const_expr(self.deterministic):
                # Wait for the KV blocks that add into this dQ tile before this one: blocks
                # 0 .. n_block-1, or for causal the blocks after this one (descending order).
                turn = n_block
                if const_expr(self.causal):
                    n_visible = cutlass.min(((m_block + 1) * self.tile_m - 1) // self.tile_n + 1,
                                            num_n_blocks)
                    turn = n_visible - 1 - n_block
                sem_ptr = (mSem[None, head, batch].iterator + m_block)
                if lane == 0:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                    while seen != turn:
                        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            gdQ = mdQ[None, head, batch].iterator + m_block * NUM_MMA_WG * self.dq_part
            for wg in cutlass.range_constexpr(NUM_MMA_WG):
                cute.arch.barrier(barrier_id=_BAR_DQ_FULL + wg, number_of_threads=WG_THREADS + 32)
                if lane == 0:
                    _bulk_reduce_add_f32(gdQ + wg * self.dq_part, sdQ[None, wg].iterator,
                                         part_bytes)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if lane == 0:
                    # Both parts have landed in global memory before the next KV block may add.
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.red(sem_ptr, Int32(1), op="add", dtype="s32", sem="release",
                                  scope="gpu")
                cute.arch.sync_warp()
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _mma(self, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ,
             pipe_q, pipe_do, mbar_kv, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma,
             mma_dq: cute.TiledMma, tidx, softmax_scale, scale_log2,
             seqlen_k, n_block, m_block_min, steps_per_head, num_steps):
        """The main loop of the MMA warp groups; returns this thread's dK, dV accumulators."""
        d = self.head_dim
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_sdp = mma_sdp.get_slice(wg * WG_THREADS)
        wg_dkv = mma_dkv.get_slice(wg * WG_THREADS)
        wg_dq = mma_dq.get_slice(wg * WG_THREADS)
        thr_sdp = mma_sdp.get_slice(tidx)

        # Operand fragments (shared memory descriptors; last mode = pipeline stage).
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(_transpose(sdO)))
        tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(_transpose(sQ)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(_transpose(sK)))

        acc_shape_s = mma_sdp.partition_shape_C((self.tile_n, self.tile_m))
        acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # dS^T registers -> dS in shared memory (transposing 8x8 stores).
        r2s_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                self.dtype), mma_sdp)
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        tdSs = thr_r2s_ds.partition_D(_transpose(sdS))
        # dQ registers -> this warp group's fp32 buffer in fragment order: register group i of
        # thread t at (i * WG threads + t) * 4, one 512-byte line per warp and store.
        dq_regs = self.dq_part // WG_THREADS
        dq_store = (REGS_PER_STORE, dq_regs // REGS_PER_STORE)
        tdQs = cute.make_tensor(
            sdQ[None, wg].iterator + (tidx % WG_THREADS) * REGS_PER_STORE,
            cute.make_layout(dq_store, stride=(1, REGS_PER_STORE * WG_THREADS)))

        # (key, query) coordinates of each S^T element this thread holds.
        cS = _acc_mn(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m))),
                     transpose=True)
        n_base = n_block * self.tile_n

        cute.arch.mbarrier_wait(mbar_kv, 0)
        state = cutlass.pipeline.make_pipeline_state(
            cutlass.pipeline.PipelineUserType.Consumer, self.stages)
        for step in cutlass.range(num_steps, unroll=1):
            g = step // steps_per_head
            m_block = m_block_min + step - g * steps_per_head
            stage = state.index
            m_base = m_block * self.tile_m

            pipe_q.consumer_wait(state)
            acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
            wgmma.gemm(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, stage], zero_init=True, wait=-1)
            pipe_do.consumer_wait(state)
            acc_dp = cute.make_rmem_tensor(acc_shape_s, Float32)
            wgmma.gemm(mma_sdp, acc_dp, tdPrV, tdPrdO[None, None, None, stage], zero_init=True, wait=1)

            # P^T = exp2(S^T * scale * log2(e) - lse2); masked entries give exp2(-inf) = 0.
            s_mn = _acc_mn(acc_s, transpose=True)  # (query, key)
            needs_mask = n_base + self.tile_n > seqlen_k
            if const_expr(self.causal):
                needs_mask = needs_mask or (n_base + self.tile_n - 1 > m_base)
            if needs_mask:
                for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                        key, query = cS[r, c]
                        dead = n_base + key >= seqlen_k
                        if const_expr(self.causal):
                            dead = dead or (n_base + key > m_base + query)
                        s_mn[r, c] = -Float32.inf if dead else s_mn[r, c]
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                lse2 = sLSE[cS[r, 0][1], stage]
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)
            p = cute.make_rmem_tensor(acc_shape_s, self.dtype)
            p.store(acc_s.load().to(self.dtype))

            # dS^T = P^T * (dP^T * scale - delta), delta already scaled
            warpgroup.wait_group(0)
            dp_mn = _acc_mn(acc_dp, transpose=True)
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                delta = sDelta[cS[r, 0][1], stage]
                for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                    dp_mn[r, c] = s_mn[r, c] * (dp_mn[r, c] * softmax_scale - delta)
            # One opaque conversion per pair: with .to() the compiler repeated the 16 bf16
            # conversions for dS's second reader (the dK product) after the wgmma fence.
            ds = cute.make_rmem_tensor(acc_shape_s, self.dtype)
            convert_to(acc_dp, ds)
            # dS is double buffered by pipeline stage: the buffer written here was last read
            # by the dQ product two steps ago, which both warp groups finished before the
            # _BAR_PDS of the previous step.
            cute.copy(r2s_ds, thr_r2s_ds.retile(ds), tdSs[None, None, None, stage])

            wgmma.gemm(mma_dkv, acc_dV, wgmma.acc_as_operand_a(p), tdVrdO[None, None, None, stage],
                  zero_init=False, wait=-1)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=_BAR_PDS, number_of_threads=NUM_MMA_WG * WG_THREADS)

            acc_dq = cute.make_rmem_tensor(mma_dq.partition_shape_C((self.tile_m, d)), Float32)
            wgmma.gemm(mma_dq, acc_dq, tdQrdS[None, None, None, stage], tdQrK, zero_init=True,
                  wait=1)
            pipe_do.consumer_release(state)  # the dV product has read dO
            wgmma.gemm(mma_dkv, acc_dK, wgmma.acc_as_operand_a(ds), tdKrQ[None, None, None, stage],
                  zero_init=False, wait=1)

            # dQ part -> shared memory -> dQ warp, which adds it into global memory.
            cute.arch.barrier(barrier_id=_BAR_DQ_EMPTY + wg, number_of_threads=WG_THREADS + 32)
            cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout(dq_store)), tdQs)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=_BAR_DQ_FULL + wg,
                                     number_of_threads=WG_THREADS + 32)

            warpgroup.wait_group(0)
            pipe_q.consumer_release(state)
            state.advance()

        return acc_dK, acc_dV

    @cute.jit
    def _epilogue_dkv(self, acc_dK, acc_dV, tiles, sdKV_layout: cute.ComposedLayout, tdK, tdV,
                      tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, mma_dkv: cute.TiledMma,
                      tidx, n_block, kv_head, batch):
        """Stage dK and dV in the Q/dO/K/V tiles and store (or add, for fp32 buffers) them with
        TMA; the tensor map clips rows past seqlen_k."""
        # Both warp groups are past their last product (each dQ product reads all of K).
        mma_threads = NUM_MMA_WG * WG_THREADS
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=mma_threads)
        sdV = _carve(tiles, sdKV_layout, self.dkv_dtype)
        sdK = _carve(tiles + self.sdKV_elems, sdKV_layout, self.dkv_dtype)
        if const_expr(self.dkv_dtype.width == 16):
            r2s = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                      self.dkv_dtype)
        else:
            r2s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        thr_r2s = cute.make_tiled_copy_C(r2s, mma_dkv).get_slice(tidx)
        for acc, sOut in ((acc_dV, sdV), (acc_dK, sdK)):
            frag = cute.make_rmem_tensor(acc.shape, self.dkv_dtype)
            frag.store(acc.load().to(self.dkv_dtype))
            cute.copy(thr_r2s, thr_r2s.retile(frag), thr_r2s.partition_D(sOut))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=mma_threads)
        if cute.arch.make_warp_uniform(tidx // 32) == 0:
            one = cute.make_layout(1)
            for tma, gOut, sOut in ((tma_dv, tdV, sdV), (tma_dk, tdK, sdK)):
                g = cute.local_tile(gOut[None, None, kv_head, batch], (self.tile_n, self.head_dim),
                                    (n_block, 0))
                s_t, g_t = cpasync.tma_partition(tma, 0, one, cute.group_modes(sOut, 0, 2),
                                                 cute.group_modes(g, 0, 2))
                cute.copy(tma, s_t, g_t)
            cute.arch.cp_async_bulk_commit_group()
            # Shared memory must outlive the reads of the copies.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


# ---------------------------------------------------------------- compilation
@dataclass(frozen=True)
class BwdSm90Config:
    """Every compile-time value of the backward kernel; the compile cache is keyed on it."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    deterministic: bool
    dkv_fp32: bool  # dk, dv are fp32 buffers the kernel adds into (else written in dtype)

    @property
    def name(self) -> str:
        return (f"bwd_sm90_{self.dtype}_d{self.head_dim}_{'causal' if self.causal else 'full'}"
                f"_{'det' if self.deterministic else 'atomic'}"
                f"_{'dkvadd32' if self.dkv_fp32 else 'dkvstore'}")

    def compile_args(self):
        from ringfa4.kernels.compile import fake_bshd

        dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[self.dtype]
        kernel = AttentionBackwardSm90(dt, self.head_dim, self.causal, self.deterministic,
                                       Float32 if self.dkv_fp32 else dt)
        b, sq, sk, h, hk, sq_pad, n_m, dq_len = (cute.sym_int() for _ in range(8))

        def stats():  # (b, h, sq_pad) fp32, rows of whole tiles
            return cute.runtime.make_fake_tensor(
                Float32, (b, h, sq_pad),
                stride=(cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1),
                assumed_align=16)

        def fp32_bshd(s, n):
            stride = tuple(cute.sym_int64(divisibility=4) for _ in range(3)) + (1,)
            return cute.runtime.make_fake_tensor(Float32, (b, s, n, self.head_dim),
                                                 stride=stride, assumed_align=16)

        d = self.head_dim
        dq_acc = cute.runtime.make_fake_tensor(  # (b, h, sq tiles * tile_m * d), fragment order
            Float32, (b, h, dq_len), stride=(cute.sym_int64(divisibility=4),
                                            cute.sym_int64(divisibility=4), 1), assumed_align=16)
        dkv = ((lambda: fp32_bshd(sk, hk)) if self.dkv_fp32
               else (lambda: fake_bshd(dt, b, sk, hk, d)))
        sem = (cute.runtime.make_fake_tensor(Int32, (b, h, n_m), stride=(cute.sym_int64(), n_m, 1),
                                             assumed_align=4) if self.deterministic else None)
        return kernel, (
            fake_bshd(dt, b, sq, h, d), fake_bshd(dt, b, sk, hk, d), fake_bshd(dt, b, sk, hk, d),
            fake_bshd(dt, b, sq, h, d), stats(), stats(), dq_acc, dkv(), dkv(), sem,
            Float32(1.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )


# Shipped backward variants: every (dtype, head_dim, causal, deterministic, dk/dv mode).
VARIANTS = [
    BwdSm90Config(dt, d, c, det, f32)
    for dt in ("bf16", "fp16") for d in (64, 128) for c in (False, True)
    for det in (False, True) for f32 in (False, True)
]


# ---------------------------------------------------------------- torch entry point
# dq may also be an fp32 accumulator
_DQ_DTYPE_NAMES = {**DTYPE_NAMES, torch.float32: "fp32"}


def _check(name, t, shape, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


@dataclass(frozen=True)
class QueryRows:
    """Whole query tiles of a QueryState, as views at their first tile: what a backward call
    over those rows reads (lse2, delta) and adds its dQ into."""

    dq_acc: torch.Tensor  # (b, h, tiles * tile_m * head_dim) fp32, fragment order
    lse2: torch.Tensor  # (b, h, tiles * tile_m) fp32, lse in log2 units
    delta: torch.Tensor  # (b, h, tiles * tile_m) fp32, softmax_scale * rowsum(dO * O)
    softmax_scale: float  # the one folded into delta


def _padded_rows(s, head_dim):
    """s query rows rounded up to whole query tiles."""
    tile_m = query_tile(head_dim)
    return (s + tile_m - 1) // tile_m * tile_m


def _query_rows(dout, out, lse, softmax_scale):
    """Preprocessed rows of (dout, out, lse) with a zeroed dQ accumulator."""
    b, s, h, d = out.shape
    padded = _padded_rows(s, d)
    dev = out.device
    rows = QueryRows(torch.zeros((b, h, padded * d), dtype=torch.float32, device=dev),
                     torch.empty((b, h, padded), dtype=torch.float32, device=dev),
                     torch.empty((b, h, padded), dtype=torch.float32, device=dev),
                     float(softmax_scale))
    from ringfa4.kernels.bwd_preprocess import BwdPreprocessConfig
    from ringfa4.kernels.compile import compile_variant

    compile_variant(BwdPreprocessConfig(DTYPE_NAMES[out.dtype], d))(
        tma_ready(out), tma_ready(dout),
        lse if lse.stride(-1) == 1 else lse.contiguous(), rows.lse2, rows.delta, rows.softmax_scale)
    return rows


def _postprocess(dq_acc, dq, add):
    from ringfa4.kernels.compile import compile_variant

    compile_variant(DqPostprocessConfig(_DQ_DTYPE_NAMES[dq.dtype], dq.shape[-1], add))(dq_acc, dq)


class QueryState:
    """What the backward calls over one set of queries share when they differ only in the keys
    (the steps of a ring): lse2 and delta from one preprocess pass, and one fragment-order dQ
    accumulator that every call adds into and `dq()` puts back in (b, s, h, d) once. Per call
    that saves a preprocess pass, zeroing an accumulator and a postprocess pass adding it into
    an fp32 dq; and the fp32 dq itself.

    ``rows(sl)`` is what a call over the query rows ``sl`` takes as its ``dq``: sl must start
    on a query tile (a multiple of query_tile(head_dim)) and end on one or at the end."""

    def __init__(self, dout, q, out, lse, softmax_scale):
        b, s, h, d = q.shape
        _check("out", out, (b, s, h, d), (q.dtype,))
        _check("dout", dout, (b, s, h, d), (q.dtype,))
        _check("lse", lse, (b, h, s), (torch.float32,))
        self.shape, self.dtype, self.tile_m = (b, s, h, d), q.dtype, query_tile(d)
        self._all = _query_rows(dout, out, lse.detach(), softmax_scale)

    def rows(self, sl: slice) -> QueryRows:
        s, d, tile_m = self.shape[1], self.shape[3], self.tile_m
        start, stop, step = sl.indices(s)
        if step != 1 or start % tile_m or (stop % tile_m and stop != s) or start >= stop:
            raise ValueError(f"rows must be a non-empty slice of step 1 from a multiple of {tile_m} "
                             f"to a multiple of {tile_m} or the end ({s}), got {sl}")
        first, end = start // tile_m, (stop + tile_m - 1) // tile_m
        stats = slice(first * tile_m, end * tile_m)
        acc = slice(first * tile_m * d, end * tile_m * d)
        return QueryRows(self._all.dq_acc[:, :, acc], self._all.lse2[:, :, stats],
                         self._all.delta[:, :, stats], self._all.softmax_scale)

    def dq(self) -> torch.Tensor:
        """The summed dQ of every call so far, in the queries' dtype."""
        dq = torch.empty(self.shape, dtype=self.dtype, device=self._all.dq_acc.device)
        _postprocess(self._all.dq_acc, dq, add=False)
        return dq


def backward(dout, q, k, v, out, lse, causal, softmax_scale, dq=None, dk=None, dv=None,
             deterministic=False):
    """Gradients of attention with the softmax normalised by the given lse (natural log,
    (b, h, sq) fp32). Given dq/dk/dv receive the gradients added to what they hold (fp32 dk/dv
    by the kernel itself; dq by the postprocess that reads the kernel's accumulator). dq may
    also be the QueryRows of these queries: the kernel then adds into its accumulator and uses
    its lse2 and delta (lse and out are not read again) and returns it as dq."""
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, seq, heads, head_dim), got shape {tuple(q.shape)}")
    b, sq, h, d = q.shape
    if k.dim() != 4:
        raise ValueError(f"k must be (batch, seq, kv_heads, head_dim), got shape {tuple(k.shape)}")
    sk, hk = k.shape[1], k.shape[2]
    dtypes = (torch.float16, torch.bfloat16)
    _check("q", q, (b, sq, h, d), dtypes)
    _check("k", k, (b, sk, hk, d), (q.dtype,))
    _check("v", v, (b, sk, hk, d), (q.dtype,))
    _check("out", out, (b, sq, h, d), (q.dtype,))
    _check("dout", dout, (b, sq, h, d), (q.dtype,))
    _check("lse", lse, (b, h, sq), (torch.float32,))
    if d not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 for the sm90 backward kernel, got {d}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({hk})")
    if causal and sq != sk:
        raise ValueError(f"causal attention needs seq_q == seq_k, got {sq} and {sk}")
    if min(b, sq, sk) == 0:
        raise ValueError(f"empty input: batch {b}, seq_q {sq}, seq_k {sk}")
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    dout = tma_ready(dout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_compatible(t):
            raise ValueError(f"{name} needs a contiguous head dim and 16-byte aligned strides, "
                             f"got strides {t.stride()}")
    for name, buf, like in (("dk", dk, k), ("dv", dv, v)):
        if buf is not None:
            _check(name, buf, like.shape, (torch.float16, torch.bfloat16, torch.float32))

    padded = _padded_rows(sq, d)
    if isinstance(dq, QueryRows):
        _check("dq.lse2", dq.lse2, (b, h, padded), (torch.float32,))
        _check("dq.dq_acc", dq.dq_acc, (b, h, padded * d), (torch.float32,))
        if dq.softmax_scale != float(softmax_scale):
            raise ValueError(f"softmax_scale ({softmax_scale}) must be the one of dq's QueryState "
                             f"({dq.softmax_scale})")
        rows = dq
    else:
        if dq is not None:
            _check("dq", dq, q.shape, (torch.float16, torch.bfloat16, torch.float32))
        rows = _query_rows(dout, out, lse, softmax_scale)

    dev = q.device
    dkv_fp32 = all(t is not None and t.dtype == torch.float32 and tma_compatible(t) for t in (dk, dv))
    if dkv_fp32:
        dk_out, dv_out = dk, dv
    else:
        dk_out = torch.empty((b, sk, hk, d), dtype=q.dtype, device=dev)
        dv_out = torch.empty((b, sk, hk, d), dtype=q.dtype, device=dev)
    sem = (torch.zeros((b, h, padded // query_tile(d)), dtype=torch.int32, device=dev)
           if deterministic else None)

    from ringfa4.kernels.compile import compile_variant

    cfg = BwdSm90Config(DTYPE_NAMES[q.dtype], d, bool(causal), bool(deterministic), dkv_fp32)
    compile_variant(cfg)(q, k, v, dout, rows.lse2, rows.delta, rows.dq_acc, dk_out, dv_out, sem,
                         float(softmax_scale))

    if rows is not dq:  # dq <- (or +=) the accumulator; a dq it cannot address gets a fresh one added
        add = dq is not None and tma_compatible(dq)
        dq_out = dq if add else torch.empty_like(q, memory_format=torch.contiguous_format)
        _postprocess(rows.dq_acc, dq_out, add)
        if dq is None:
            dq = dq_out
        elif not add:
            dq.add_(dq_out)
    if not dkv_fp32:
        if dk is None:
            dk = dk_out
        else:
            dk.add_(dk_out)
        if dv is None:
            dv = dv_out
        else:
            dv.add_(dv_out)
    return dq, dk, dv
