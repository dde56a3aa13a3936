"""Attention forward for Hopper (sm_90a), warp-specialised, returning the log-sum-exp.

A work tile is tile_m query rows of one (batch, head) against every key they see; a CTA runs
one tile, or with `persistent` every grid-size-th tile on one resident CTA per SM
(tile_scheduler.FwdTileScheduler). GQA/MQA read the kv head h // (heads / kv_heads) in place,
or with pack_gqa a tile's rows are (position, query head) pairs of one kv head, the heads
fastest (layout.pack_heads): Q, O and lse are viewed packed, the tile scheduler counts kv heads,
and masks and key ranges take a row's position as its index // pack_gqa.

Pipeline of a work tile (warpgroup 0 produces, warpgroups 1..num_wg consume, 64 rows each):
 1. Producer (one warp of warpgroup 0, most of its registers given to the consumers by
    setmaxnreg): TMA-loads Q, then K_j and V_j for key blocks j from the last down to 0 through a
    num_stages-deep ring of shared-memory buffers, full/empty mbarriers per stage. K_{j-1} is
    requested before V_j, the order the consumers use them.
 2. Consumers, per key block j (the last first: it is the only one with keys past seqlen_k, and
    under causal the blocks crossing the diagonal follow it, so masked blocks come first):
    a. S = Q K_j^T: wgmma, both operands in shared memory, fp32 accumulator in registers;
    b. mask (mask.py): keys past seqlen_k and, under causal, keys after the query, to -inf;
    c. online softmax (softmax.OnlineSoftmax): running row max and sum, P = exp2(S * scale *
       log2(e) - max) in place, and the factor by which the running O must be rescaled;
    d. P rounded to 16 bits in registers, the A operand of
    e. O = O * factor + P V_j: wgmma with A from registers and B = V^T from shared memory.
 3. Epilogue: O /= row sum, rounded to 16 bits, staged in shared memory (stmatrix) and
    TMA-stored; lse (natural log) written by the thread holding column 0 of each row.

Techniques, each a compile-time switch of the configuration so benchmarks can show what it buys:
- intra_wg_overlap: a consumer issues S_{j+1} = Q K_{j+1}^T and O += P_j V_j back to back and
  runs the softmax of S_{j+1} while the P_j V_j product is still in the tensor cores.
- pingpong: named barriers hand the tensor cores from one consumer warpgroup to the next, so
  one warpgroup's softmax runs while the other's matmuls do.
- rescale_threshold: conditional O rescaling (softmax.OnlineSoftmax).
- ex2_fma_per16: share of exponentials computed by polynomial on the FMA pipe.
- lpt: causal tiles ordered longest-first, heads grouped so a group's K/V stays in L2.
- persistent: the producer loads the next tile's Q, K, V while consumers finish the last one
  (O then needs its own staging buffer instead of reusing Q's).
- late_pv_wait: with intra_wg_overlap, the wait for P_j V_j sits in the O rescale's branches,
  after the softmax of S_{j+1}. Placed before the rescale in one block, ptxas hoists it as far
  up as it can (at head dim 64 without causal mask above every exp2 of the step), and the
  warpgroup idles until the product ends.
Ragged tails rely on TMA: loads outside the tensor fill zeros, stores outside it are dropped.

Packed documents (has_docs, one variant for every boundary set): the kernel takes each query's
visible keys [key_lo, key_hi) (its document's, computed from the ids on the host) and a tile
runs only the key blocks its rows' documents reach (doc_blocks): blocks wholly inside the one
document of all its rows take the unmasked path, blocks on a boundary the mask, the rest are
neither loaded nor computed.

Fragment shapes per consumer thread (wgmma m64nNk16 accumulators, one MMA_M per warpgroup):
  S, P  ((2, 2, tile_n / 8), 1, 1)    fp32 / 16-bit: rows r and r + 8 of a quad, 2 columns per 8
  O     ((2, 2, head_dim / 8), 1, 1)  fp32
  row max, row sum, lse: 2 per thread (its two rows), each shared by the 4 threads of a quad.
"""
from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ringfa4.kernels import wgmma
from ringfa4.kernels.barriers import FwdBarrier
from ringfa4.kernels.dtypes import CUTLASS_DTYPES
from ringfa4.kernels.layout import (acc_rows_view, pack_heads, rows_major, select_modes, seq_major,
                                    transpose)
from ringfa4.kernels.mask import AttentionMask
from ringfa4.kernels.ptx import convert_to
from ringfa4.kernels.softmax import LOG2_E, OnlineSoftmax, scale_rows
from ringfa4.kernels.tile_scheduler import FwdTileScheduler

# Shared memory per CTA on sm_90 (227 KB) and what mbarriers + buffer alignment take of it.
_SMEM_MAX = 232448
_SMEM_RESERVED = 1024


def shifted(n_lo, j):
    """Key block j of a tile's range that starts at n_lo (None: at block 0)."""
    return j if n_lo is None else n_lo + j


class FwdSm90:
    """cfg: the compile-time values (ringfa4.backends.cute.configs.FwdSm90Config)."""

    def __init__(self, cfg):
        assert cfg.dtype in ("bf16", "fp16")
        assert cfg.head_dim in (64, 128) and cfg.tile_m % 64 == 0 and cfg.tile_n % 16 == 0
        assert cfg.tile_m % cfg.pack_gqa == 0, "a tile holds whole positions of packed heads"
        self.cfg = cfg
        self.pack = cfg.pack_gqa
        self.tile_pos = cfg.tile_m // cfg.pack_gqa  # query positions per tile
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.d = cfg.head_dim
        self.tile_m, self.tile_n, self.stages = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.num_wg = cfg.tile_m // 64
        assert self.num_wg in (2, 3), "two or three consumer warpgroups"
        self.num_mma_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        # setmaxnreg budgets: 64K registers per SM shared by one CTA's warpgroups.
        self.mma_regs, self.producer_regs = {2: (240, 24), 3: (160, 32)}[self.num_wg]
        self.scheduler = FwdTileScheduler(self.tile_m, self.d * 2 * (self.dtype.width // 8), cfg.lpt)
        self.attention_mask = AttentionMask(self.tile_m, self.tile_n, cfg.causal, key_first=False,
                                            has_docs=cfg.has_docs, rows_per_query=self.pack)
        smem = 2 * self.d * (self.tile_m * (2 if cfg.persistent else 1)
                                + 2 * self.stages * self.tile_n) + _SMEM_RESERVED
        if smem > _SMEM_MAX:
            raise ValueError(
                f"{cfg.name} needs {smem} bytes of shared memory (Q, K/V stages"
                f"{', O' if cfg.persistent else ''}), Hopper has {_SMEM_MAX} per CTA: use a "
                f"smaller tile_n or fewer stages"
            )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, d)
        mO: cute.Tensor,  # (b, sq, h, d)
        mLSE: cute.Tensor,  # (b, h, sq) fp32
        mKeyLo: Optional[cute.Tensor],  # (b, sq) int32, has_docs: first key of each query's document
        mKeyHi: Optional[cute.Tensor],  # (b, sq) int32, has_docs: one past its last key
        mOrder: Optional[cute.Tensor],  # (tiles,) int32, tile_order: the raster id of each tile
        softmax_scale: Float32,
        num_ctas: Int32,  # persistent grid size (the GPU's SM count); ignored otherwise
        stream,
    ):
        # Kernel views: (seq, d, head, batch) and lse (seq, head, batch); packed, the rows
        # (seq) of Q, O and lse are ((pack, seq)) and their heads the kv heads.
        mQ, mK, mV, mO = [seq_major(t) for t in (mQ, mK, mV, mO)]
        mLSE = rows_major(mLSE)
        if const_expr(self.pack > 1):
            mQ, mO = (pack_heads(t, self.pack, 2) for t in (mQ, mO))
            mLSE = pack_heads(mLSE, self.pack, 1)
        if const_expr(self.cfg.has_docs != (mKeyLo is not None and mKeyHi is not None)):
            raise TypeError("key_lo and key_hi are required exactly when has_docs")
        if const_expr(self.cfg.tile_order != (mOrder is not None)):
            raise TypeError("order is required exactly with tile_order")
        if const_expr(self.cfg.has_docs):
            mKeyLo, mKeyHi = select_modes(mKeyLo, [1, 0]), select_modes(mKeyHi, [1, 0])  # (sq, b)
        dt = self.dtype
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.d),
            a_source=warpgroup.OperandSource.RMEM,
        )
        sQ_layout = wgmma.smem_layout(dt, self.tile_m, self.d)
        sK_layout = wgmma.smem_layout(dt, self.tile_n, self.d, self.stages)
        sV_layout = wgmma.smem_layout(dt, self.tile_n, self.d, self.stages)
        sO_layout = sQ_layout

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (self.tile_m, self.d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            load_op, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.d), 1
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            load_op, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.d), 1
        )
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.d)
        )
        self.tx_q = cute.size_in_bytes(dt, sQ_layout)
        self.tx_kv = cute.size_in_bytes(dt, cute.select(sK_layout, mode=[0, 1]))

        o_size = cute.cosize(sO_layout) if const_expr(self.cfg.persistent) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, o_size], 1024]

        num_m_blocks = cute.ceil_div(cute.size(mQ, mode=[0]), self.tile_m)
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        grid = cutlass.min(num_tiles, num_ctas) if const_expr(self.cfg.persistent) else num_tiles
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            softmax_scale * LOG2_E, num_tiles,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage, mKeyLo, mKeyHi, mOrder,
        ).launch(
            grid=[grid, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def n_blocks(self, m_block, seqlen_k):
        """Key blocks this query block sees."""
        n = (seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.cfg.causal):
            n = cutlass.min(n, ((m_block + 1) * self.tile_pos + self.tile_n - 1) // self.tile_n)
        return n

    @cute.jit
    def doc_blocks(self, m_block, batch, rows, seqlen_k, mKeyLo, mKeyHi):
        """Key blocks of query block m_block with documents, (n_lo, n_hi, u_lo, u_hi): it sees
        blocks n_lo <= j < n_hi, and u_lo <= j < u_hi need no mask. Keys visible to any of its
        rows lie in [key_lo of its first row, key_hi of its last) (both nondecreasing in the
        row). No mask only when every row lies in one document and the block lies inside that
        document (and, causal, below the diagonal); the last block n_hi - 1 is always masked
        (mainloop). A block whose rows see no key still runs one block, fully masked: its rows
        come out with lse -inf and out 0 like any row that sees nothing. ``rows``: the query
        rows, pack_gqa of them per position."""
        first = m_block * self.tile_pos
        last = cutlass.min(first + self.tile_pos, rows // self.pack) - 1
        lo, hi = mKeyLo[first, batch], mKeyHi[last, batch]
        if const_expr(self.cfg.causal):
            hi = cutlass.min(hi, last + 1)
        n_lo = cutlass.min(lo, seqlen_k - 1) // self.tile_n
        n_hi = cutlass.max((hi + self.tile_n - 1) // self.tile_n, n_lo + 1)
        u_hi = cutlass.min(hi // self.tile_n, n_hi - 1)
        if const_expr(self.cfg.causal):
            u_hi = cutlass.min(u_hi, (first + 1) // self.tile_n)
        one_doc = (lo == mKeyLo[last, batch]) & (mKeyHi[first, batch] == mKeyHi[last, batch])
        u_hi = cutlass.max(u_hi, n_lo) if one_doc else n_lo
        u_lo = cutlass.max(cutlass.min((lo + self.tile_n - 1) // self.tile_n, u_hi), n_lo)
        return n_lo, n_hi, u_lo, u_hi

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        scale_log2: Float32,
        num_tiles: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        # Last: the kernel's symbol names its leading arguments, and without documents it stays
        # the one it had before they existed.
        mKeyLo: Optional[cute.Tensor], mKeyHi: Optional[cute.Tensor], mOrder: Optional[cute.Tensor],
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # One release per consumer warp (PipelineTmaAsync signals from lane 0 of each warp).
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_q, defer_sync=True,
        )
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_kv,
            defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_kv,
            defer_sync=True,
        )
        pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # A persistent CTA loads the next Q while this tile's O is stored: separate buffers.
        sO = (storage.sO if const_expr(self.cfg.persistent) else storage.sQ).get_tensor(
            sO_layout.outer, swizzle=sO_layout.inner
        )
        pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(
                    mQ, mK, mV, mKeyLo, mKeyHi, mOrder, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                    pipe_q, pipe_k, pipe_v, num_tiles,
                )
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(
                mQ, mK, mO, mLSE, mKeyLo, mKeyHi, mOrder, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk,
                tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, num_tiles,
            )

    @cute.jit
    def load(
        self, mQ, mK, mV, mKeyLo, mKeyHi, mOrder, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
        pipe_q, pipe_k, pipe_v, num_tiles,
    ):
        rows, seqlen_k = cute.size(mQ, mode=[0]), mK.shape[0]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        tile = Int32(cute.arch.block_idx()[0])
        while tile < num_tiles:
            m_block, head, batch = self.scheduler.coords(tile, rows, seqlen_k, mQ.shape[2], mQ.shape[3], mOrder)
            head_kv = head // (mQ.shape[2] // mK.shape[2])
            # Blocks n_lo .. n_lo + n_block_max - 1 (n_lo None: from 0).
            n_lo = None
            if const_expr(self.cfg.has_docs):
                n_lo, n_hi, _, _ = self.doc_blocks(m_block, batch, rows, seqlen_k, mKeyLo, mKeyHi)
                n_block_max = n_hi - n_lo
            else:
                n_block_max = self.n_blocks(m_block, seqlen_k)
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.d), (m_block, 0))
            gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            one = cute.make_layout(1)
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
            )
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
            )
            # Blocks run from the last (diagonal under causal) down to 0: masked blocks first.
            # K of block j+1 is requested before V of block j, the order consumers use them.
            self.load_block(pipe_k, tma_atom_K, tKgK, tKsK, shifted(n_lo, n_block_max - 1), state)
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            for i in cutlass.range(n_block_max - 1, unroll=1):
                prev = state.clone()
                state.advance()
                self.load_block(pipe_k, tma_atom_K, tKgK, tKsK, shifted(n_lo, n_block_max - 2 - i), state)
                self.load_block(pipe_v, tma_atom_V, tVgV, tVsV, shifted(n_lo, n_block_max - 1 - i), prev)
            self.load_block(pipe_v, tma_atom_V, tVgV, tVsV, shifted(n_lo, 0), state)
            state.advance()
            tile += cute.arch.grid_dim()[0]

    @cute.jit
    def load_block(self, pipe, atom, tXgX, tXsX, n_block, state):
        pipe.producer_acquire(state)
        cute.copy(atom, tXgX[None, n_block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))

    # ------------------------------------------------------------------ consumers
    def sched_sync(self):
        """Wait for this warpgroup's turn on the tensor cores."""
        if const_expr(self.cfg.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128)
            cute.arch.barrier(barrier_id=FwdBarrier.SCHED0 - 1 + wg, number_of_threads=256)

    def sched_pass(self):
        """Hand the tensor cores to the next consumer warpgroup."""
        if const_expr(self.cfg.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128)
            nxt = wg % self.num_wg  # consumer warpgroups are 1..num_wg; 0-based next
            cute.arch.barrier_arrive(barrier_id=FwdBarrier.SCHED0 + nxt, number_of_threads=256)

    @cute.jit
    def sched_init(self):
        # The first consumer warpgroup may start at once: pre-arrive on its own barrier.
        if const_expr(self.cfg.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128)
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=FwdBarrier.SCHED0, number_of_threads=256)

    @cute.jit
    def consume(
        self, mQ, mK, mO, mLSE, mKeyLo, mKeyHi, mOrder, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk,
        tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, num_tiles,
    ):
        rows, seqlen_k = cute.size(mQ, mode=[0]), mK.shape[0]
        tidx = cute.arch.thread_idx()[0] - 128
        ops = self.consumer_operands(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tidx)
        ops.pipe_k, ops.pipe_v, ops.seqlen_k = pipe_k, pipe_v, seqlen_k
        ops.key_lo, ops.key_hi = mKeyLo, mKeyHi
        # Loops here touch ops only through calls on self: the DSL carries any object whose
        # methods a loop body calls as loop state, compile-time shapes included.
        acc_O = ops.acc_O

        self.sched_init()
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile = Int32(cute.arch.block_idx()[0])
        while tile < num_tiles:
            m_block, head, batch = self.scheduler.coords(tile, rows, seqlen_k, mQ.shape[2], mQ.shape[3], mOrder)
            if const_expr(self.cfg.has_docs):
                blocks = self.doc_blocks(m_block, batch, rows, seqlen_k, mKeyLo, mKeyHi)
            else:
                blocks = self.n_blocks(m_block, seqlen_k)
            softmax = OnlineSoftmax(
                scale_log2, cute.size(ops.tScS, mode=[0]), self.cfg.rescale_threshold,
                self.cfg.ex2_fma_per16,
            )
            acc_O.fill(0.0)
            pipe_q.consumer_wait(q_state)
            state = self.mainloop(ops, softmax, state, m_block, batch, blocks)
            # Every S of this tile is computed: the producer may load the next tile's Q.
            pipe_q.consumer_release(q_state)
            q_state.advance()
            if const_expr(self.cfg.intra_wg_overlap):
                pipe_v.consumer_wait(state)
                self.pv(ops, state.index, 0)
                pipe_v.consumer_release(state)
                state.advance()
            else:
                self.sched_pass()

            self.epilogue(
                acc_O, softmax, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, ops.thr_pv, tidx,
                m_block, head, batch, rows,
            )
            tile += cute.arch.grid_dim()[0]

    def consumer_operands(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tidx):
        """This thread's MMA operands, built once per CTA and used by every tile."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_wg, stride=128)
        wg_qk = tiled_mma_qk.get_slice(wg_first_thread(wg))
        wg_pv = tiled_mma_pv.get_slice(wg_first_thread(wg))
        thr_qk = tiled_mma_qk.get_slice(tidx)
        ops = SimpleNamespace(tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv)
        ops.thr_pv = tiled_mma_pv.get_slice(tidx)
        # Shared-memory descriptors, last mode the pipeline stage: Q (MMA, MMA_M, MMA_K),
        # K (MMA, MMA_N, MMA_K, stage), and V^T (d, tile_n, stage), the MN-major B of O = P V.
        ops.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        ops.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        ops.tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(transpose(sV)))
        # Registers: O accumulator, P (16-bit A operand), and the shape of an S accumulator.
        ops.acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.d)), Float32)
        ops.tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        ops.s_shape = wg_qk.partition_shape_C((self.tile_m, self.tile_n))
        # (query, key) coordinates of this thread's scores (runtime) and thread 0's (compile-time).
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        ops.tScS = acc_rows_view(thr_qk.partition_C(cS))
        ops.t0ScS = acc_rows_view(tiled_mma_qk.get_slice(0).partition_C(cS))
        return ops

    @cute.jit
    def mainloop(self, ops, softmax, state, m_block, batch, blocks):
        """Every key block of one tile, from the last (the only one that can hold keys past
        seqlen_k) down to the first; blocks crossing the causal diagonal or a document boundary
        need the mask, the rest none. ``blocks``: n_blocks' count, or doc_blocks' ranges. With
        intra_wg_overlap the last block's P V is left for the caller to issue."""
        if const_expr(self.cfg.has_docs):
            n_lo, n_hi, u_lo, u_hi = blocks
            n_first = n_hi - 1
        else:
            n_first = blocks - 1
        if const_expr(self.cfg.intra_wg_overlap):
            ops.pipe_k.consumer_wait(state)
            acc_S = self.qk(ops, state.index)
            warpgroup.wait_group(0)
            self.softmax_step(ops, softmax, acc_S, state, m_block, batch, n_first, masked=True,
                              is_first=True)
            convert_to(wgmma.acc_as_operand_a(acc_S), ops.tOrP)
        else:
            self.sched_sync()
            state = self.step_serial(ops, softmax, state, m_block, batch, n_first, masked=True,
                                     is_first=True)
        if const_expr(self.cfg.has_docs):
            # Masked blocks above the unmasked range, the unmasked range, masked blocks below.
            for i in cutlass.range(n_first - u_hi, unroll=1):
                state = self.step(ops, softmax, state, m_block, batch, n_first - 1 - i, masked=True)
            for i in cutlass.range(u_hi - u_lo, unroll=1):
                state = self.step(ops, softmax, state, m_block, batch, u_hi - 1 - i, masked=False)
            for i in cutlass.range(u_lo - n_lo, unroll=1):
                state = self.step(ops, softmax, state, m_block, batch, u_lo - 1 - i, masked=True)
        else:
            n_unmasked = n_first
            if const_expr(self.cfg.causal):
                n_unmasked = cutlass.min(n_first, (m_block * self.tile_pos + 1) // self.tile_n)
                for i in cutlass.range(n_first - n_unmasked, unroll=1):
                    state = self.step(ops, softmax, state, m_block, batch, n_first - 1 - i,
                                      masked=True)
            for i in cutlass.range(n_unmasked, unroll=1):
                state = self.step(ops, softmax, state, m_block, batch, n_unmasked - 1 - i,
                                  masked=False)
        return state

    @cute.jit
    def step(self, ops, softmax, state, m_block, batch, n_block, masked: cutlass.Constexpr[bool]):
        """Key block n_block after the first."""
        if const_expr(self.cfg.intra_wg_overlap):
            state = self.step_overlap(ops, softmax, state, m_block, batch, n_block, masked=masked)
        else:
            state = self.step_serial(ops, softmax, state, m_block, batch, n_block, masked=masked,
                                     is_first=False)
        return state

    @cute.jit
    def step_overlap(self, ops, softmax, state, m_block, batch, n_block,
                     masked: cutlass.Constexpr[bool]):
        """S_{j+1} and P_j V_j are issued together; softmax(S_{j+1}) overlaps P_j V_j."""
        v_state = state.clone()
        state.advance()
        ops.pipe_k.consumer_wait(state)
        self.sched_sync()
        acc_S = self.qk(ops, state.index)
        ops.pipe_v.consumer_wait(v_state)
        self.pv(ops, v_state.index, -1)
        self.sched_pass()
        warpgroup.wait_group(1)
        row_scale = self.softmax_step(ops, softmax, acc_S, state, m_block, batch, n_block,
                                      masked=masked, is_first=False)
        if const_expr(self.cfg.late_pv_wait):
            self.rescale_o(ops, softmax, row_scale, wait_pv=True)
        else:
            warpgroup.wait_group(0)
        ops.pipe_v.consumer_release(v_state)
        convert_to(wgmma.acc_as_operand_a(acc_S), ops.tOrP)
        if const_expr(not self.cfg.late_pv_wait):
            self.rescale_o(ops, softmax, row_scale)
        return state

    @cute.jit
    def step_serial(self, ops, softmax, state, m_block, batch, n_block,
                    masked: cutlass.Constexpr[bool], is_first: cutlass.Constexpr[bool]):
        """No overlap inside the warpgroup: S_j, softmax, then P_j V_j. The turn on the tensor
        cores spans P_{j-1} V_{j-1} (previous call) and S_j."""
        ops.pipe_k.consumer_wait(state)
        acc_S = self.qk(ops, state.index)
        self.sched_pass()
        warpgroup.wait_group(0)
        row_scale = self.softmax_step(ops, softmax, acc_S, state, m_block, batch, n_block,
                                      masked=masked, is_first=is_first)
        convert_to(wgmma.acc_as_operand_a(acc_S), ops.tOrP)
        if const_expr(not is_first):
            self.rescale_o(ops, softmax, row_scale)
        ops.pipe_v.consumer_wait(state)
        self.sched_sync()
        self.pv(ops, state.index, 0)
        ops.pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def softmax_step(self, ops, softmax, acc_S, k_state, m_block, batch, n_block,
                     masked: cutlass.Constexpr[bool], is_first: cutlass.Constexpr[bool]):
        """S of key block n_block is in registers: release its K stage, mask it, and turn it into
        P in place; returns the factor the running O must be rescaled by."""
        ops.pipe_k.consumer_release(k_state)
        if const_expr(masked):
            self.mask(ops, acc_S, m_block, batch, n_block)
        return softmax.step(acc_S, is_first=is_first)

    @cute.jit
    def qk(self, ops, stage):
        acc_S = cute.make_rmem_tensor(ops.s_shape, Float32)
        wgmma.gemm(ops.tiled_mma_qk, acc_S, ops.tSrQ, ops.tSrK[None, None, None, stage], True, -1)
        return acc_S

    @cute.jit
    def pv(self, ops, stage, wait: cutlass.Constexpr[int]):
        wgmma.gemm(ops.tiled_mma_pv, ops.acc_O, ops.tOrP, ops.tOrVt[None, None, None, stage], False, wait)

    @cute.jit
    def rescale_o(self, ops, softmax, row_scale, wait_pv: cutlass.Constexpr[bool] = False):
        """O *= row_scale where a row needs it. ``wait_pv``: P V is still in flight; wait for it
        on each path of the rescale's branch, which ptxas cannot hoist above the exp2s."""
        if const_expr(self.cfg.rescale_threshold is not None):
            if softmax.needs_rescale(row_scale):
                if const_expr(wait_pv):
                    warpgroup.wait_group(0)
                scale_rows(ops.acc_O, row_scale)
            elif const_expr(wait_pv):
                warpgroup.wait_group(0)
        else:
            if const_expr(wait_pv):
                warpgroup.wait_group(0)
            scale_rows(ops.acc_O, row_scale)

    @cute.jit
    def mask(self, ops, acc_S, m_block, batch, n_block):
        if const_expr(self.cfg.has_docs):
            self.attention_mask.apply(acc_rows_view(acc_S), ops.tScS, ops.t0ScS, m_block, n_block,
                                      ops.seqlen_k, ops.key_lo[None, batch], ops.key_hi[None, batch])
        else:
            self.attention_mask.apply(acc_rows_view(acc_S), ops.tScS, ops.t0ScS, m_block, n_block,
                                      ops.seqlen_k)

    @cute.jit
    def epilogue(
        self, acc_O, softmax, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, thr_pv, tidx,
        m_block, head, batch, rows,
    ):
        inv_sum = softmax.finalize()
        scale_rows(acc_O, inv_sum)
        rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
        convert_to(acc_O, rO)
        # Every consumer is done with the staging buffer: Q's (non-persistent: all S are
        # computed) or the previous tile's O (its bulk store has read it, see below).
        cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))

        # lse: the quad thread holding column 0 of each row writes it.
        cO = acc_rows_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.d))))
        if cO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(cO, mode=[0])):
                row = m_block * self.tile_m + cO[r, 0][0]
                if row < rows:
                    mLSE[row, head, batch] = softmax.row_sum[r]

        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.d), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(gO, 0, 2),
            )
            # Bulk stores are per thread (unlike the loads, which elect one lane): issue once.
            with cute.arch.elect_one():
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
