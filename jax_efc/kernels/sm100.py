"""Warp-specialized persistent GEMM with a fused epilogue for Blackwell (sm_100a).

One CTA = six warps with one role each, walking the same persistent tile schedule
(:mod:`jax_efc.kernels.schedule`):

- the TMA warp loads A and B k-tiles into a ``stages``-deep shared-memory ring
  (``PipelineTmaUmma``: a "full" mbarrier per stage completed by the TMA transaction count, an
  "empty" one released by the MMA's commit). Inside a cluster, A tiles are multicast to the
  CTAs that share the tile's M coordinate and B tiles to those that share its N coordinate;
- the MMA warp issues the tcgen05 MMAs of each k-tile into an accumulator in tensor memory
  (TMEM). There are two accumulators (``ACC_STAGES``), taken in turn (``PipelineUmmaAsync``):
  while the epilogue reads tile i's, the MMAs of tile i+1 fill the other. With ``use_2cta``
  a pair of CTAs along M shares one MMA of ``tile_m`` rows: the even CTA of the pair issues
  it, each CTA stages its own ``tile_m / 2`` rows of A and half of B, and each CTA's TMEM
  holds its own rows of the accumulator (with ``tile_m`` 128, in two column blocks that every
  epilogue subtile spans: ``_tmem_load``);
- four epilogue warps (128 threads, one per TMEM lane quarter) read the accumulator subtile
  by subtile (``tcgen05.ld``) and run the shared epilogue driver
  (:mod:`jax_efc.kernels.gemm_base`) on it; once they have read the last subtile they hand
  the accumulator back to the MMA warp, before that subtile's stores.

Tensors arrive as (M, K, L) for A, (N, K, L) for B, (M, N, L) for outputs and (M|1, N|1, L|1)
for epilogue operands; which mode is contiguous (the "major") is a compile-time choice, and
tcgen05 reads both majors of every input type. Stream-K is not built here: every tile is
computed whole (``Sm100Policy.splits_k``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05, warp
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
from cutlass.tensor_utils import LayoutEnum

from jax_efc.kernels.epilogue_state import ConsumerEpilogue, EpilogueTensors
from jax_efc.kernels.fragment_math import opaque_zero
from jax_efc.kernels.gemm_base import FusedGemmBase
from jax_efc.kernels.problem import SMEM_ALIGN, KernelProblem
from jax_efc.kernels.schedule import TileSchedule, TileWalk, cluster_tiles
from jax_efc.kernels.sm100_int8 import mixed_int8_tiled_mma
from jax_efc.kernels.sm100_policy import ACC_STAGES, EPI_THREADS, epilogue_blocks, pipeline_stages, tmem_columns

__all__ = ["Sm100FusedGemm"]

# Warp roles. The epilogue warps come first: a warp reads TMEM lanes 32 * (warp % 4) onwards,
# so warps 0-3 reach all 128 lanes.
_EPI_WARPS = 4
_MMA_WARP = 4
_TMA_WARP = 5
_THREADS = 32 * 6
# the named barrier on which the MMA and epilogue warps wait for the TMEM allocation (0 is
# __syncthreads, 1 the epilogue warps' own: gemm_base.EPI_BARRIER_ID)
_TMEM_ALLOC_BARRIER_ID = 2
# MMA instructions per k-tile: a k-tile is 128 bytes of K (problem.tile_k) and one tcgen05 MMA
# reads 32 bytes of it (K = 16 16-bit values, 32 8-bit ones, 8 TF32 ones)
_MMAS_PER_K_TILE = 4


class TmemAccumulator(NamedTuple):
    """One tile's accumulator as the epilogue reads it: the TMEM load, this thread's part of the
    accumulator buffer per subtile, the registers it loads into, and the pipeline (and its state)
    through which the buffer goes back to the MMA warp once its last subtile is read."""

    t2r: cute.TiledCopy
    tmem: cute.Tensor  # (T2R, T2R_M, T2R_N, subtile)
    regs: cute.Tensor  # one subtile's values in the accumulator's dtype
    pipe: pipeline.PipelineUmmaAsync
    state: pipeline.PipelineState


class Sm100FusedGemm(FusedGemmBase):
    """One compiled kernel variant; call it (inside ``cute.jit``) as
    ``kernel(stream, a, b, *operands, *outputs, *partials)``; the results of reductions folded
    by atomics follow the operands, and with ``timeline`` a ``stamps`` tensor follows those
    (:meth:`~jax_efc.kernels.gemm_base.FusedGemmBase._call_arguments`)."""

    def __init__(self, problem: KernelProblem, schedule: TileSchedule, timeline: bool = False):
        """See :class:`~jax_efc.kernels.gemm_base.FusedGemmBase`."""
        if schedule.stream_k is not None:
            raise ValueError("the sm_100a kernel computes every tile whole; plan it without stream-K.")
        cfg = problem.config
        self.use_2cta = cfg.use_2cta
        super().__init__(problem, schedule, timeline, stages=pipeline_stages(problem), epi_threads=EPI_THREADS,
                         epi_groups=1, epi_blocks=epilogue_blocks(cfg))
        self.mma_tiler = (cfg.tile_m, cfg.tile_n, problem.tile_k)
        self.a_major = OperandMajorMode.K if problem.a_major == "k" else OperandMajorMode.MN
        self.b_major = OperandMajorMode.K if problem.b_major == "k" else OperandMajorMode.MN
        self.tmem_columns = tmem_columns(problem)
        # an output stored transposed takes one value per thread and store into its M-major
        # subtile, and so (one register partition for all) does every other
        self.use_stmatrix = self.use_stmatrix and not any(self.out_m_major)
        # TF32: the MMA and the TMA copies read float32 inputs as tf32
        self.mma_a_dtype = cutlass.TFloat32 if self.ab_dtype is cutlass.Float32 else self.ab_dtype
        self.mma_b_dtype = cutlass.TFloat32 if self.b_dtype is cutlass.Float32 else self.b_dtype

    # ---------------------------------------------------------------- architecture hooks
    def _place_ring_subtiles(self) -> tuple:
        """None: the CTA's last tile reads its TILE operands through the epilogue's own
        buffers like every other (the A/B ring belongs to the MMA warp, which releases its
        stages by tcgen05 commits, not to the epilogue)."""
        return None, None, None

    def _subtile_accumulators(self, epi: ConsumerEpilogue, acc: TmemAccumulator, s: int, m_idx,
                              n_idx, last_read: bool = True) -> list[tuple]:
        """Load subtile ``s`` from TMEM into ``epi.frag`` (and ``epi.frag_raw``); after the last
        one of the ``last_read``, hand the accumulator buffer back to the MMA warp."""
        cute.copy(acc.t2r, acc.tmem[(None, None, None, s)], acc.regs)
        # tcgen05.ld is asynchronous: its registers are read once it has completed
        cute.arch.fence_view_async_tmem_load()
        values = epi.r2s[0].retile(acc.regs).load()
        epi.frag.store(values.to(cutlass.Float32))
        if epi.frag_raw is not None:
            epi.frag_raw.store(values)
        if last_read and s == self.n_sub - 1:
            # the buffer's last load has completed (above): the MMA warp may overwrite it; one
            # arrival a warp
            with cute.arch.elect_one():
                acc.pipe.consumer_release(acc.state)
        return self._tile_coords(epi, s, m_idx, n_idx)

    def _walk_offset(self):
        """Each thread holds a row of a subtile (32 values at 32 columns), and the walks and
        the epilogue would share every operand address and value they compute alike, held in
        registers from the first walk to the stores: a row softmax of ``acc + bias`` spilled
        224 bytes on 128x128 tiles so. Offset by a zero the compiler cannot see through, a
        walk's coordinates are its own (none spilled)."""
        return opaque_zero()

    def _epi_smem_layout(self, dtype, stages: int, m_major: bool = False) -> cute.ComposedLayout:
        """Swizzled, row-major (M-major for an output stored transposed); a subtile of column
        blocks keeps each block whole (its rows as wide as the block), so that one TMA box
        copies each."""
        major = LayoutEnum.COL_MAJOR if m_major else LayoutEnum.ROW_MAJOR
        return sm100_utils.make_smem_layout_epi(dtype, major, self._epi_tiler(), stages)

    def _store_warp(self, group):
        """The first epilogue warp (one group)."""
        return 0

    # ---------------------------------------------------------------- host side (traced)
    def _tiled_mma(self) -> cute.TiledMma:
        cta_group = tcgen05.CtaGroup.TWO if self.use_2cta else tcgen05.CtaGroup.ONE
        if self.acc_dtype is cutlass.Int32 and self.mma_a_dtype is not self.mma_b_dtype:
            # int8 x uint8: the DSL's helper takes one integer type for both
            return mixed_int8_tiled_mma(self.mma_a_dtype, self.mma_b_dtype, self.a_major, self.b_major, cta_group,
                                        self.mma_tiler[:2])
        return sm100_utils.make_trivial_tiled_mma(self.mma_a_dtype, self.mma_b_dtype, self.a_major, self.b_major,
                                                  self.acc_dtype, cta_group, self.mma_tiler[:2])

    @cute.jit
    def __call__(self, stream, a: cute.Tensor, b: cute.Tensor, *rest):
        args = self._call_arguments(rest)
        operands, stamps, outputs, partials = args.operands, args.stamps, args.outputs, args.partials
        tiled_mma = self._tiled_mma()
        # the cluster as (pair, M, N, L): the pair's two CTAs share one MMA
        cluster_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)), (tiled_mma.thr_id.shape,))
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, self.stages)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, self.stages)
        tma_a, g_a = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_mn, tiled_mma.thr_id), a,
            cute.slice_(a_smem, (None, None, None, 0)), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=self.mma_a_dtype if self.mma_a_dtype is cutlass.TFloat32 else None)
        tma_b, g_b = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_mn, tiled_mma.thr_id), b,
            cute.slice_(b_smem, (None, None, None, 0)), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=self.mma_b_dtype if self.mma_b_dtype is cutlass.TFloat32 else None)
        d_smem, tma_d, g_d, c_smem, tma_c, g_c = self._epilogue_tma(operands, outputs)
        tiles_mnl = cluster_tiles(*outputs[0].shape, self.tile_mnk[:2], self.cluster_mn)
        clusters = cutlass.min(tiles_mnl[0] * tiles_mnl[1] * tiles_mnl[2], self.schedule.clusters)
        self.kernel(
            tiled_mma, tma_a, g_a, tma_b, g_b, tuple(tma_d), tuple(g_d), tuple(operands), tuple(tma_c),
            tuple(g_c), cluster_vmnk, a_smem, b_smem, d_smem, c_smem, tiles_mnl, stamps, tuple(partials),
        ).launch(
            grid=(*self.cluster_mn, clusters), block=[_THREADS, 1, 1], cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1, stream=stream, use_pdl=True,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_d: tuple, mD: tuple, operands: tuple, tma_c: tuple, mC: tuple,
               cluster_vmnk: cute.Layout, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               d_smem: tuple, c_smem: tuple, tiles_mnl: tuple, stamps: tuple, mP: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == _TMA_WARP:
            self._prefetch_descriptors((tma_a, tma_b, *tma_d, *tma_c))

        # ---- cluster geometry: this CTA's place in its MMA pair, and the multicast masks
        bidx, bidy, bidz = cute.arch.block_idx()
        pair_size = cute.size(tiled_mma.thr_id.shape)
        mma_v = bidx % pair_size
        is_leader = mma_v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_vmnk = cluster_vmnk.get_flat_coord(cta_rank)
        a_mcast_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, cta_vmnk, mcast_mode=2)
        b_mcast_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, cta_vmnk, mcast_mode=1)

        # ---- shared memory: barriers, the A/B ring, the epilogue's buffers
        smem = SmemAllocator()
        ab_barriers = smem.allocate_array(cutlass.Int64, 2 * self.stages, byte_alignment=8)
        acc_barriers = smem.allocate_array(cutlass.Int64, 2 * ACC_STAGES, byte_alignment=8)
        tmem_dealloc_barrier = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
        tmem_address = smem.allocate_array(cutlass.Int32, 1, byte_alignment=8)
        # every CTA that multicasts into this CTA's stage (along its cluster row and column, one
        # MMA issuer a pair) must have consumed it before the stage is loaded again
        mma_consumers = cute.size(cluster_vmnk, mode=[1]) + cute.size(cluster_vmnk, mode=[2]) - 1
        tx_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, None, 0)))
                    + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, None, 0)))) * pair_size
        mainloop = pipeline.PipelineTmaUmma.create(
            barrier_storage=ab_barriers, num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_consumers),
            tx_count=tx_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        # the epilogue warps of both CTAs of a pair release the accumulator to its issuer
        accumulators = pipeline.PipelineUmmaAsync.create(
            barrier_storage=acc_barriers, num_stages=ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _EPI_WARPS * pair_size),
            cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        tmem = TmemAllocator(
            tmem_address, barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_TMEM_ALLOC_BARRIER_ID, num_threads=32 * (_EPI_WARPS + 1)),
            allocator_warp_id=0, is_two_cta=self.use_2cta, two_cta_tmem_dealloc_mbar_ptr=tmem_dealloc_barrier)
        sA = smem.allocate_tensor(self.ab_dtype, a_smem.outer, SMEM_ALIGN, a_smem.inner)
        sB = smem.allocate_tensor(self.b_dtype, b_smem.outer, SMEM_ALIGN, b_smem.inner)
        tensors = self._epilogue_tensors(smem, warp_idx, operands, mD, d_smem, tma_d, mC, c_smem, tma_c, mP)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)

        # ---- global tiles, TMA partitions, MMA fragments
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        thr_mma = tiled_mma.get_slice(mma_v)
        a_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
        b_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(tma_a, cta_vmnk[2], a_cta, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(gA), 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, cta_vmnk[1], b_cta, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(thr_mma.partition_B(gB), 0, 3))
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(
            cute.append(tiled_mma.partition_shape_C(self.mma_tiler[:2]), ACC_STAGES)).layout
        k_tiles = cute.size(gA, mode=[3])
        walk = TileWalk(self.schedule, tiles_mnl, bidz, (bidx, bidy), cute.arch.grid_dim()[2], k_tiles)
        n_units = walk.count()
        slot = bidz * self.cluster_mn[0] * self.cluster_mn[1] + cta_rank

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_vmnk)
        # Programmatic dependent launch, as on Hopper: no global memory is touched before the
        # previous kernel on the stream has ended
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # ================================================================ TMA warp
        if warp_idx == _TMA_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            j = cutlass.Int32(0)
            while j < n_units:
                u = self._unit(walk, j)
                # the MMA tile is the pair's: its M index is the pair's first CTA tile's, halved
                tAgA_t = tAgA[(None, u.m // pair_size, None, u.l if self.a_batched else 0)]
                tBgB_t = tBgB[(None, u.n, None, u.l if self.b_batched else 0)]
                for k in range(u.k_count):
                    mainloop.producer_acquire(state)
                    bar = mainloop.producer_get_barrier(state)
                    cute.copy(tma_a, tAgA_t[(None, u.k_begin + k)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                              mcast_mask=a_mcast_mask)
                    cute.copy(tma_b, tBgB_t[(None, u.k_begin + k)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                              mcast_mask=b_mcast_mask)
                    state.advance()
                j += 1
            mainloop.producer_tail(state)

        # ================================================================ MMA warp
        if warp_idx == _MMA_WARP:
            tmem.wait_for_alloc()
            acc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
            lane = tidx % 32
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
            j = cutlass.Int32(0)
            while j < n_units:
                u = self._unit(walk, j)
                self._stamp(stamps, lane, slot, 0, j, "reached")
                if is_leader:
                    accumulators.producer_acquire(acc_state)
                    self._stamp(stamps, lane, slot, 0, j, "mainloop")
                    tile_acc = acc[(None, None, None, acc_state.index)]
                    # the tile's first MMA overwrites the accumulator, the rest add to it
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for k in range(u.k_count):
                        mainloop.consumer_wait(read)
                        for kb in cutlass.range_constexpr(_MMAS_PER_K_TILE):
                            coord = (None, None, kb, read.index)
                            cute.gemm(tiled_mma, tile_acc, tCrA[coord], tCrB[coord], tile_acc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        # the stage goes back to the TMA warps once these MMAs complete
                        mainloop.consumer_release(read)
                        read.advance()
                    # the epilogue may read the accumulator once all of them complete
                    accumulators.producer_commit(acc_state)
                    self._stamp(stamps, lane, slot, 0, j, "issued")
                acc_state.advance()
                j += 1
            accumulators.producer_tail(acc_state)

        # ================================================================ epilogue warps
        if warp_idx < _EPI_WARPS:
            tmem.allocate(self._tmem_columns(tiled_mma))
            tmem.wait_for_alloc()
            acc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
            ctid = tidx
            t2r, tmem_parts, regs = self._tmem_load(acc, ctid)
            epi = self._consumer_epilogue(t2r, regs, ctid, warp_idx, tensors)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
            subtile_count = cutlass.Int32(0)
            j = cutlass.Int32(0)
            while j < n_units:
                u = self._unit(walk, j)
                bSC = self._tile_op_partitions(epi, u.m, u.n, u.l)
                # this tile's vector slices into L1 and its first TILE-operand subtiles into the
                # buffers while its MMAs run
                self.visitor.prefetch_vectors(epi.operands, (u.m * self.tile_mnk[0], u.n * self.tile_mnk[1]),
                                              self.tile_mnk[:2], epi.mn_extent, u.l, ctid)
                self._prefetch_tile_ops(epi, bSC, subtile_count)
                accumulators.consumer_wait(acc_state)
                self._stamp(stamps, ctid, slot, 0, j, "complete")
                self._stamp(stamps, ctid, slot, 0, j, "epilogue")
                tile_acc = TmemAccumulator(t2r, tmem_parts[(None, None, None, None, acc_state.index)], regs,
                                           accumulators, acc_state)
                subtile_count = self._epilogue(epi, tile_acc, bSC, u.m, u.n, u.l, subtile_count)
                self._stamp(stamps, ctid, slot, 0, j, "end")
                acc_state.advance()
                j += 1
            if epi.is_store_warp:
                epi.store_pipe.producer_tail()
            # every epilogue thread has read its last subtile (the driver's barrier after it)
            tmem.relinquish_alloc_permit()
            tmem.free(acc.iterator)

    def _tmem_columns(self, tiled_mma: cute.TiledMma) -> int:
        """The TMEM columns of the accumulator buffers, as the policy counted them (which it
        checked against the 512 an SM has)."""
        buffers = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C(self.mma_tiler[:2]), ACC_STAGES))
        columns = get_num_tmem_alloc_cols(buffers)
        if columns != self.tmem_columns:
            raise RuntimeError(f"the accumulators take {columns} TMEM columns, not the policy's {self.tmem_columns}")
        return columns

    def _tmem_load(self, acc: cute.Tensor, ctid) -> tuple:
        """The TMEM load of one epilogue subtile (``tcgen05.ld``, picked for the subtile and the
        accumulator dtype), thread ``ctid``'s part of every subtile of both accumulator buffers
        as (T2R, T2R_M, T2R_N, subtile, buffer), and registers for one subtile."""
        atom = sm100_utils.get_tmem_load_op(self.tile_mnk[:2], LayoutEnum.ROW_MAJOR, self.out_dtypes[0],
                                            self.acc_dtype, self.epi_tile, self.use_2cta)
        # one MMA covers the CTA's tile: (rows, columns, buffer), then (EPI_M, EPI_N, subtiles
        # down M, subtiles along N, buffer). A 2-CTA 128-row MMA leaves each CTA's 64 rows in
        # TMEM lanes 0-63 for the first half of the columns and lanes 64-127 for the second; a
        # warp reads only its own 32 lanes, so for the four warps to share each load a subtile
        # takes a column block from each half (_epi_tiler): two warps read each block.
        by_subtile = cute.flat_divide(acc[((None, None), 0, 0, None)], self._epi_tiler())
        t2r = tcgen05.make_tmem_copy(atom, by_subtile[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(ctid)
        parts = cute.group_modes(thr_t2r.partition_S(by_subtile), 3, 5)
        # (a tcgen05.ld is a warp's: the source partition holds the warp's values, the
        # destination one this thread's)
        one_subtile = thr_t2r.partition_D(cute.make_identity_tensor(self.epi_tile))
        regs = cute.make_rmem_tensor(one_subtile.shape, self.acc_dtype)
        return t2r, parts, regs

    def _r2s_atom(self, dtype, t2r: cute.TiledCopy):
        """stmatrix where every output is 16 bits wide and the TMEM load's layout suits it (the
        16-lane loads of 64-row tiles); else one value per thread and store."""
        if self.use_stmatrix:
            return sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32, t2r)
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)

    @staticmethod
    def _s2r_atom(dtype, store_atom):
        """ldmatrix for 16-bit TILE operands where the outputs' stores are stmatrix (the same
        8x8 blocks the other way); else one value per thread and load."""
        if dtype.width == 16 and isinstance(store_atom.op, warp.StMatrix8x8x16bOp):
            return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, store_atom.op.num_matrices), dtype)
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)

    def _consumer_epilogue(self, t2r: cute.TiledCopy, regs: cute.Tensor, ctid, warp_idx,
                           tensors: EpilogueTensors) -> ConsumerEpilogue:
        """Build the epilogue warps' machinery for thread ``ctid``: every register <-> smem copy
        takes the TMEM load's thread/value partition, so the visitor's fragments line up with
        the accumulator, every output buffer and every TILE-operand buffer."""
        store_atoms = [self._r2s_atom(dt, t2r) for dt in self.out_dtypes]
        r2s = [cute.make_tiled_copy_D(atom, t2r) for atom in store_atoms]
        s2r = [cute.make_tiled_copy_D(self._s2r_atom(dt, store_atoms[0]), t2r) for dt in self.tile_op_dtypes]
        return self._consumer_epilogue_from(
            tensors, r2s, s2r, r2s[0].retile(regs).shape, ctid, 0, warp_idx,
            coords=lambda thread: self._fragment_coords(t2r, r2s[0], regs, thread), ring=())

    def _fragment_coords(self, t2r: cute.TiledCopy, r2s: cute.TiledCopy, regs: cute.Tensor, ctid) -> tuple:
        """(tCcT, acc_index) of thread ``ctid`` (see :class:`ConsumerEpilogue`): the (m, n)
        within the tile of every accumulator value of every subtile, as the TMEM load places
        them, (T2R, T2R_M, T2R_N, subtiles down M, subtiles along N); and per subtile the index
        in it of each fragment value."""
        tile_coords = cute.flat_divide(cute.make_identity_tensor(self.tile_mnk[:2]), self._epi_tiler())
        return t2r.get_slice(ctid).partition_D(tile_coords), self._subtile_acc_indices(r2s, regs)

    def _subtile_acc_indices(self, r2s: cute.TiledCopy, regs: cute.Tensor) -> list[list[int]]:
        """For each subtile, the index into the (T2R, T2R_M, T2R_N, EPI_M, EPI_N) coordinate
        tensor of the TMEM value behind each fragment value (trace-time integers): fragment value
        ``v`` is the register the r2s view of the TMEM load's registers maps it to, and the
        subtiles follow one another in that tensor, down M first."""
        view = r2s.retile(regs)
        n_frag = cute.size(regs)
        order = [cute.crd2idx(v, view.layout) for v in range(n_frag)]
        if sorted(order) != list(range(n_frag)):
            raise RuntimeError(f"the epilogue fragment does not cover the {n_frag} TMEM values of a subtile once each")
        return [[i + s * n_frag for i in order] for s in range(self.n_sub)]
