"""Warp-specialized persistent GEMM with a fused epilogue for Hopper (sm_90a).

Two schedules share this code. Cooperative: one CTA = one producer warpgroup + one or two
consumer warpgroups that work on the same tile (64 rows each, 128 in a 256-row tile). Ping-pong
(``GemmConfig(pingpong=True)``): one producer + two consumer warpgroups, each owning whole
tiles (64, 128 or 192 rows) and taking alternate tiles of the persistent schedule. Two pairs of
named barriers order them: their mainloops alternate, so one consumer's epilogue runs while
the other's WGMMAs do, and their epilogues alternate, so both share one set of epilogue
smem buffers (a consumer hands them over once its TMA stores have read them). Each
consumer has its own epilogue named barrier and TMA-store warp.

- the producer's first warp walks the persistent tile schedule and issues TMA loads of the
  A and B k-tiles into a ``stages``-deep shared-memory ring (``PipelineTmaAsync``: an
  mbarrier "full" per stage completed by the TMA transaction count, an "empty" per stage
  released by the consumers). Inside a cluster, A tiles are multicast to the CTAs that share
  the tile's M coordinate and B tiles to those that share its N coordinate;
- the consumers walk the same schedule, issue WGMMA on each stage (fp32 accumulators in
  registers; cooperative: two warpgroups share a 128-row tile, 64 rows each) and run the
  shared epilogue driver (:mod:`jax_efc.kernels.gemm_base`) on them;
- the schedule (:mod:`jax_efc.kernels.schedule`) hands each CTA a list of units, a tile and
  a range of its k-tiles: whole tiles, then with stream-K pieces of the last ones.

Tensors arrive as (M, K, L) for A, (N, K, L) for B, (M, N, L) for outputs and (M|1, N|1, L|1)
for epilogue operands; which mode is contiguous (the "major") is a compile-time choice.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from jax_efc.kernels.epilogue_state import ConsumerEpilogue, EpilogueTensors
from jax_efc.kernels.gemm_base import FusedGemmBase
from jax_efc.kernels.grouped_walk import ContractionWalk, GroupedWalk, group_step
from jax_efc.kernels.problem import SMEM_ALIGN, KernelProblem
from jax_efc.kernels.schedule import TileSchedule, TileWalk, cluster_tiles
from jax_efc.kernels.sm90_policy import mma_warpgroups, pipeline_stages
from jax_efc.kernels.sm90_tf32 import tf32_tiled_mma

__all__ = ["Sm90FusedGemm"]

# Epilogue subtile width (GemmConfig.epi_n): 32 columns keeps the per-thread output
# fragment at 16 values (128 rows x 32 cols / 256 cooperative threads; 32 for a 128-row
# ping-pong consumer), i.e. few live registers on top of the accumulators; 64 halves the
# barriers and TMA stores per tile; 16 halves the epilogue's smem buffers, which can buy the
# A/B ring a stage. Its height (GemmConfig.epi_m, 64-row steps; the tile's by default): a 64x32
# subtile is as small as a 128x16 one, but each TMA copy of a 16-bit tensor moves 64 bytes a
# row instead of 32; with them, the tiles whose mainloops run while all CTAs do their first
# epilogues at once no longer slow down (benchmarks/FINDINGS.md). The k-tile depth, the
# epilogue buffer count and the smem alignment (tile_k, EPI_STAGES, SMEM_ALIGN) live in
# kernels/problem.py; sm90_policy.pipeline_stages counts the stages that fit Hopper's 227 KiB
# next to them.
# Register split across warpgroups (setmaxnreg): the producer needs few, the consumers hold
# up to 192 fp32 accumulators each plus epilogue temporaries. 40 + 2 * 232 (x 128 threads)
# fits the 64K-register file; the values must be multiples of 8.
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_WG = 128  # threads per warpgroup
# 16-bit values in one 16-byte unit of shared memory, which the 128-byte swizzle keeps whole
_UNIT = 8
# (the epilogue named barrier of consumer group g is gemm_base.EPI_BARRIER_ID + g: 1 or 2)
# ping-pong: consumer g waits on named barrier _MMA_ORDER_ID + g before its mainloop and,
# once its WGMMAs are issued, arrives on the other consumer's; likewise _EPI_ORDER_ID + g
# around its epilogue (256 threads each: both warpgroups)
_MMA_ORDER_ID = 3
_EPI_ORDER_ID = 5


class Sm90FusedGemm(FusedGemmBase):
    """One compiled kernel variant; call it (inside ``cute.jit``) as
    ``kernel(stream, a, b, *operands, *outputs)``, or with stream-K
    ``kernel(stream, a, b, *operands, flags, *outputs, workspace)`` (``outputs`` with the
    reductions' partials last); the results of reductions folded by atomics come right after the
    operands, and with ``timeline`` a ``stamps`` tensor follows the operands (and ``flags``)
    (:meth:`~jax_efc.kernels.gemm_base.FusedGemmBase._call_arguments`). A grouped GEMM's int32
    group sizes come right after ``b``."""

    def __init__(self, problem: KernelProblem, schedule: TileSchedule, timeline: bool = False):
        """See :class:`~jax_efc.kernels.gemm_base.FusedGemmBase`."""
        cfg = problem.config
        self.pingpong = bool(cfg.pingpong)
        self.promote = problem.promote
        # warpgroups that cooperate on one tile (its MMA and its epilogue); each covers
        # tile_m / n_mma_wg rows in 64-row WGMMA blocks (two per k-step for a 128x128
        # ping-pong consumer or a cooperative 256x128 tile)
        self.n_mma_wg = mma_warpgroups(cfg)
        # consumer warpgroups per CTA; each group of n_mma_wg runs its own tiles and epilogue
        epi_groups = 2 if self.pingpong else 1
        self.n_consumer_wg = self.n_mma_wg * epi_groups
        super().__init__(problem, schedule, timeline, stages=pipeline_stages(problem),
                         epi_threads=self.n_mma_wg * _WG, epi_groups=epi_groups)
        # LayoutEnum speaks BLAS: "row major" A is K-contiguous, "row major" B (N, K) too.
        self.a_layout = LayoutEnum.ROW_MAJOR if problem.a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if problem.b_major == "k" else LayoutEnum.COL_MAJOR
        # ping-pong: every epilogue but the CTA's last runs under the other consumer's
        # WGMMAs, which dense fp32 issue slows; those run paced where there is arithmetic
        # (EpilogueVisitor.__call__; benchmarks/FINDINGS.md). Stream-K kernels stay dense,
        # and so do tiles of 192 accumulators a thread (192x128, 128x192), whose paced
        # bias+gelu kernel spills registers: paced (the latter in 64x16 subtiles, which do
        # not spill), neither was faster on the H200.
        self.paced = (self.pingpong and schedule.stream_k is None
                      and self.visitor.pace_link is not None
                      and self.acc_per_thread <= 128)
        self.threads = _WG * (1 + self.n_consumer_wg)

    # ---------------------------------------------------------------- architecture hooks
    def _subtile_accumulators(self, epi: ConsumerEpilogue, acc, s: int, m_idx, n_idx,
                              last_read: bool = True) -> list[tuple]:
        """The accumulators are registers: subtile ``s``'s are renamed into ``epi.frag``."""
        sub_index = epi.acc_index[self._gated_subtiles(s)[0] if self.gated else s]
        _gather_registers(epi.frag, acc, sub_index)
        if cutlass.const_expr(self.gated):
            _gather_registers(epi.frag_up, acc, epi.acc_index[self._gated_subtiles(s)[1]])
        if epi.frag_raw is not None:
            _gather_registers(epi.frag_raw, acc, sub_index)
        return self._tile_coords(epi, s, m_idx, n_idx)

    def _epi_smem_layout(self, dtype, stages: int, m_major: bool = False) -> cute.ComposedLayout:
        major = LayoutEnum.COL_MAJOR if m_major else LayoutEnum.ROW_MAJOR
        return sm90_utils.make_smem_layout_epi(dtype, major, self.epi_tile, stages)

    def _store_warp(self, group):
        """The first warp of the group's (first) consumer warpgroup."""
        return 4 + 4 * self.n_mma_wg * group

    # ---------------------------------------------------------------- host side (traced)
    @cute.jit
    def __call__(self, stream, a: cute.Tensor, b: cute.Tensor, *rest):
        grouped = ()
        if cutlass.const_expr(self.groups):
            grouped, rest = rest[:1], rest[1:]
        args = self._call_arguments(rest)
        operands, stamps, outputs, partials = args.operands, args.stamps, args.outputs, args.partials
        split = self.schedule.stream_k is not None
        sk_buffers = ()
        if cutlass.const_expr(split):
            # workspace slot s, thread t, accumulator 4c + v at ((v, t, c, s)): each warp
            # writes and reads 512 contiguous bytes per vector
            tile_elems = self.tile_mnk[0] * self.tile_mnk[1]
            sk_buffers = (args.flags, cute.make_tensor(args.workspace.iterator, cute.make_layout(
                (4, self.n_epi_threads, self.acc_per_thread // 4, self.schedule.slots),
                stride=(1, 4, 4 * self.n_epi_threads, tile_elems))))
        if cutlass.const_expr(self.ab_dtype is cutlass.Float32):
            # fp32 inputs multiply as TF32 (the plan reads them K-major)
            tiled_mma = tf32_tiled_mma((self.n_mma_wg, 1, 1), (64, self.tile_mnk[1]))
        else:
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.b_dtype,
                self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype, (self.n_mma_wg, 1, 1), tiler_mn=(64, self.tile_mnk[1]),
            )
        a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, self.ab_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, self.b_dtype, self.stages)
        # A is shared by the CTAs of a cluster row (same M tile): multicast over cluster_n.
        tma_a, g_a = self._tma_load(a, a_smem, (self.tile_mnk[0], self.tile_mnk[2]), self.cluster_mn[1])
        tma_b, g_b = self._tma_load(b, b_smem, (self.tile_mnk[1], self.tile_mnk[2]), self.cluster_mn[0])
        d_smem, tma_d, g_d, c_smem, tma_c, g_c = self._epilogue_tma(operands, outputs)

        # cluster tiles along M, N and L; the grid is one cluster per (cluster_m, cluster_n)
        # block of x and y, and the persistent clusters along z
        d0 = outputs[0]
        if cutlass.const_expr(self.groups):
            grouped = (grouped[0], tuple(outputs))  # (sizes, the outputs for predicated stores)
        tiles_mnl = cluster_tiles(*d0.shape, self.out_tile, self.cluster_mn)
        clusters = self.schedule.clusters
        if cutlass.const_expr(not split and not self.grouped_rows):  # (the plan bounds a grouped grid)
            clusters = cutlass.min(tiles_mnl[0] * tiles_mnl[1] * tiles_mnl[2], clusters)
        self.kernel(
            tiled_mma, tma_a, g_a, tma_b, g_b, tuple(tma_d), tuple(g_d), tuple(operands),
            tuple(tma_c), tuple(g_c), a_smem, b_smem, d_smem, c_smem, tiles_mnl, sk_buffers, stamps,
            tuple(partials), grouped,
        ).launch(
            grid=(*self.cluster_mn, clusters), block=[self.threads, 1, 1], cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1, stream=stream, use_pdl=True,
        )

    @staticmethod
    def _tma_load(tensor, smem_staged, tile, n_mcast):
        op = cpasync.CopyBulkTensorTileG2SOp() if n_mcast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=n_mcast
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
               tma_b: cute.CopyAtom, mB: cute.Tensor, tma_d: tuple, mD: tuple, operands: tuple,
               tma_c: tuple, mC: tuple,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, d_smem: tuple,
               c_smem: tuple, tiles_mnl: tuple, sk_buffers: tuple, stamps: tuple, mP: tuple,
               grouped: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG)
        if warp_idx == 0:
            self._prefetch_descriptors((tma_a, tma_b, *tma_d, *tma_c))

        # ---- cluster geometry and multicast masks
        cta_layout = cute.make_layout((*self.cluster_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout.get_flat_coord(cta_rank)
        a_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)
        a_mcast_mask = a_mcast_mask if self.cluster_mn[1] > 1 else 0
        b_mcast_mask = b_mcast_mask if self.cluster_mn[0] > 1 else 0
        cluster_size = self.cluster_mn[0] * self.cluster_mn[1]

        # ---- shared memory: pipeline barriers, A/B rings, one epilogue buffer per output
        smem = SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, 2 * self.stages, byte_alignment=8)
        sA = smem.allocate_tensor(self.ab_dtype, a_smem.outer, SMEM_ALIGN, a_smem.inner)
        sB = smem.allocate_tensor(self.b_dtype, b_smem.outer, SMEM_ALIGN, b_smem.inner)
        tensors = self._epilogue_tensors(smem, warp_idx, operands, mD, d_smem, tma_d, mC, c_smem, tma_c, mP)
        if cutlass.const_expr(self.groups):
            group_table = smem.allocate_tensor(cutlass.Int32, cute.make_layout((self.groups + 2, 2), stride=(2, 1)),
                                               16)
        n_sub = self.n_sub

        stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) + \
            cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        # every consumer warp (of the warpgroups that consume the stage: one per stage with
        # ping-pong) of every CTA that multicasts into this CTA's stage must release it before
        # the producer may overwrite it
        consumer_arrivals = (self.cluster_mn[0] + self.cluster_mn[1] - 1) * self.n_mma_wg * 4
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout.shape)),
        )
        if cluster_size > 1:
            cute.arch.cluster_arrive_relaxed()

        # ---- global tiles and TMA partitions: (bM, bK, RestM, RestK, RestL) etc.
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(self.cluster_mn[1]),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(self.cluster_mn[0]),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )
        k_tiles = cute.size(gA, mode=[3])
        bidx, bidy, bidz = cute.arch.block_idx()
        if cutlass.const_expr(not self.groups):
            walk = TileWalk(self.schedule, tiles_mnl, bidz, (bidx, bidy), cute.arch.grid_dim()[2], k_tiles)
            n_units = walk.count()
        # this CTA's stream-K workspace slot and flag
        slot = bidz * cluster_size + cta_rank

        if cluster_size > 1:
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        # Programmatic dependent launch: the launch lets this grid start while the stream's
        # previous kernel finishes, so its launch and the set-up above overlap that kernel's
        # tail. No global memory is touched before the wait, which returns once that kernel
        # has ended and its writes are visible. The next kernel on the stream may launch at
        # once: its CTAs find no room on SMs this persistent grid holds, and wait likewise.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.groups):
            # the group sizes are read now, by every thread a share, into the table's second
            # column (one thread reading them all would wait on each load in turn: hundreds of
            # cycles a group); then one thread scans them there into the walk's table
            for g in cutlass.range(tidx, self.groups, self.threads):
                group_table[(g, 1)] = grouped[0][g]
            cute.arch.sync_threads()
            if tidx == 0:  # (the groups' rows: of the output, or of A and B, (M|K, K|T, 1))
                self._fill_group_table(group_table, tiles_mnl[1], mA.shape[1] if self.grouped_k else mA.shape[0])
            cute.arch.sync_threads()
            if cutlass.const_expr(self.grouped_k):
                walk = ContractionWalk(TileWalk(self.schedule, tiles_mnl, bidz, (bidx, bidy), cute.arch.grid_dim()[2],
                                                k_tiles), lambda g: group_table[(g, 0)], self.tile_mnk[2])
            else:
                walk = GroupedWalk(lambda g: group_table[(g, 0)], lambda g: group_table[(g, 1)], self.groups,
                                   self.tile_mnk[0], tiles_mnl[1], bidz, bidy, self.cluster_mn[1],
                                   cute.arch.grid_dim()[2], k_tiles)
            n_units = walk.count()

        # ================================================================ producer
        # (Prefetches to L2 made the H200 run slower: TMA ones of the k-tiles 8 to 16 ahead
        # of the ring by 10-30%; of a tile's TILE operands before its mainloop, TMA ones by
        # 3-14% and per-thread `prefetch.global.L2` of their lines by 3-8% (alpha-beta, six
        # ping-pong shapes; even on a cooperative one); of only a consumer's last tile's, the
        # exposed last epilogue was no shorter. So the ring is the only look-ahead. L2
        # eviction hints on these and the epilogue's TMA copies were no faster:
        # benchmarks/FINDINGS.md)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(_PRODUCER_REGS)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                j = cutlass.Int32(0)
                while j < n_units:
                    u = self._unit(walk, j)
                    if cutlass.const_expr(self.grouped_k):  # A and B from the group's first row
                        tAgA_t = self._shifted(tma_a, gA, sA, (0, u.k_start), u.m, cluster_coord[1], 1)
                        tBgB_t = self._shifted(tma_b, gB, sB, (0, u.k_start), u.n, cluster_coord[0], 0)
                    else:
                        if cutlass.const_expr(self.grouped_rows):  # A from the tile's first row
                            tAgA_t = self._shifted(tma_a, gA, sA, (u.m, 0), 0, cluster_coord[1], 1)
                        else:
                            tAgA_t = tAgA[(None, u.m, None, u.l if self.a_batched else 0)]
                        tBgB_t = tBgB[(None, u.n, None, u.l if self.b_batched else 0)]
                    for k in range(u.k_count):
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA_t[(None, u.k_begin + k)], tAsA[(None, state.index)],
                                  tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                        cute.copy(tma_b, tBgB_t[(None, u.k_begin + k)], tBsB[(None, state.index)],
                                  tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
                        mainloop.producer_commit(state)
                        state.advance()
                    j += 1
                if cutlass.const_expr(self.ring_slots is not None):
                    if n_units > 0:
                        state = self._load_ring(mainloop, state, (sA, sB), tma_c, mC,
                                                self._unit(walk, n_units - 1))
                mainloop.producer_tail(state)

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.warpgroup_reg_alloc(_CONSUMER_REGS)
            # epilogue group of this warpgroup (ping-pong: 0 or 1, each with its own tiles)
            # and this thread's index within the group
            if cutlass.const_expr(self.pingpong):
                group = wg_idx - 1
                ctid = tidx % _WG
            else:
                group = 0
                ctid = tidx - _WG
            thr_mma = tiled_mma.get_slice(ctid)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            epi = self._consumer_epilogue(tiled_mma, ctid, group, warp_idx, tensors, sA, sB)
            if cutlass.const_expr(self.grouped_rows):
                epi = dataclasses.replace(epi, outputs=grouped[1])
            acc = cute.make_rmem_tensor(cute.shape(epi.tCcT), self.acc_dtype)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            # subtiles through the shared epilogue buffers so far (both consumers' with
            # ping-pong): it picks the buffer and the TILE-operand mbarrier phase
            subtile_count = cutlass.Int32(0)
            j = cutlass.Int32(0)
            if cutlass.const_expr(self.pingpong):
                # group 1 starts at the CTA's second unit, whose k-tiles follow the first's in
                # the ring; group 0 goes first (group 1 opens group 0's order barriers)
                if group == 1:
                    self._order_barrier(_MMA_ORDER_ID, 0).arrive()
                    self._order_barrier(_EPI_ORDER_ID, 0).arrive()
                first = self._unit(walk, 0)
                read.advance(group * first.k_count)
                release.advance(group * first.k_count)
                subtile_count = group * first.subtiles(n_sub)
                j = cutlass.Int32(group)
            while j < n_units:
                u = self._unit(walk, j)
                self._stamp(stamps, ctid, slot, group, j, "reached")
                # TMA partitions of this tile's TILE-operand subtiles
                bSC = self._tile_op_partitions(epi, u.m, u.n, u.l)
                # the CTA's last tile takes its TILE operands through the ring (the producer
                # loads them)
                in_ring = j == n_units - 1 if self.ring_slots is not None else False
                # ROW/COL vector lines into L1 ahead of the epilogue's loads (about 0.5% fewer
                # cycles for bias+gelu_tanh under Nsight Compute: benchmarks/FINDINGS.md)
                if u.k_begin == 0:
                    self.visitor.prefetch_vectors(epi.operands, (self._first_row(u.m), u.n * self.out_tile[1]),
                                                  self.out_tile, epi.mn_extent, u.l, ctid)
                if cutlass.const_expr(not self.pingpong):
                    # the buffers are free: the first subtiles arrive while the mainloop runs
                    if u.k_begin == 0 and not in_ring:
                        self._prefetch_tile_ops(epi, bSC, subtile_count)
                # ---- mainloop (ping-pong: in turn with the other consumer)
                if cutlass.const_expr(self.pingpong):
                    self._order_barrier(_MMA_ORDER_ID, group).arrive_and_wait()
                self._stamp(stamps, ctid, slot, group, j, "mainloop")
                clear_rows = None
                if cutlass.const_expr(self.groups):
                    # the rows past the groups (an empty group of the contraction) run no mainloop:
                    # their product is 0 (zeroed in a branch taken for those tiles only, the
                    # accumulators spilled: ptxas, 464 bytes at 128x256)
                    acc.fill(0.0)
                    if cutlass.const_expr(self.grouped_k):
                        # the rows of the group's last k-tile from here on are the next group's
                        clear_rows = u.k_end - u.k_start - (u.k_count - 1) * self.tile_mnk[2]
                read, release, tiled_mma = self._mainloop(mainloop, read, release, tiled_mma, acc, tCrA, tCrB,
                                                          u.k_count, (sA, sB, ctid, epi.barrier), clear_rows)
                if cutlass.const_expr(self.pingpong):
                    # our WGMMAs are issued: the other consumer may issue its own
                    self._order_barrier(_MMA_ORDER_ID, 1 - group).arrive()
                self._stamp(stamps, ctid, slot, group, j, "issued")
                warpgroup.wait_group(0)
                self._stamp(stamps, ctid, slot, group, j, "complete")
                if cutlass.const_expr(self.groups):
                    # the rows past the groups ran no mainloop (no stage to release)
                    if u.k_count > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                else:
                    mainloop.consumer_release(release)
                    release.advance()
                if cutlass.const_expr(self.pingpong):
                    # skip the other consumer's unit in the ring
                    other = self._unit(walk, j + 1)
                    skip = cutlass.Int32(cutlass.select_(j + 1 < n_units, other.k_count, 0))
                    read.advance(skip)
                    release.advance(skip)
                    # our turn with the epilogue buffers (the other consumer's stores have
                    # read them); the first subtiles load while the acc is converted
                    self._order_barrier(_EPI_ORDER_ID, group).arrive_and_wait()
                    if u.k_begin == 0 and not in_ring:
                        self._prefetch_tile_ops(epi, bSC, subtile_count)
                if cutlass.const_expr(self.ring_out_slots is not None and not self.pingpong):
                    if in_ring:
                        # outputs staged in the ring overwrite stages that the other
                        # warpgroup's last WGMMAs read (ping-pong: the other consumer's ended
                        # before its epilogue, which ended before the order barrier)
                        epi.barrier.arrive_and_wait()

                # ---- epilogue
                self._stamp(stamps, ctid, slot, group, j, "epilogue")
                if cutlass.const_expr(self.schedule.stream_k is not None):
                    subtile_count = self._split_epilogue(epi, acc, bSC, u, subtile_count, sk_buffers,
                                                         slot, cta_rank, ctid)
                elif cutlass.const_expr(self.ring_slots is None and not self.paced):
                    # every tile's epilogue alike: one call, no branch on the last tile
                    subtile_count = self._epilogue(epi, acc, bSC, u.m, u.n, u.l, subtile_count, m_end=u.m_end)
                else:
                    # the CTA's last tile runs dense (nothing hides it), with its TILE
                    # operands through the ring where they have slots there
                    if j == n_units - 1:
                        ring = None if self.ring_slots is None else (mainloop, read)
                        subtile_count = self._epilogue(epi, acc, bSC, u.m, u.n, u.l, subtile_count,
                                                       ring=ring, m_end=u.m_end)
                    else:
                        subtile_count = self._epilogue(epi, acc, bSC, u.m, u.n, u.l, subtile_count,
                                                       paced=self.paced, m_end=u.m_end)
                self._stamp(stamps, ctid, slot, group, j, "end")
                if cutlass.const_expr(self.pingpong):
                    # hand the buffers over once our TMA stores have read them
                    if epi.is_store_warp:
                        epi.store_pipe.producer_tail()
                    self._order_barrier(_EPI_ORDER_ID, 1 - group).arrive()
                    subtile_count += other.subtiles(n_sub)  # the other consumer's unit
                j += self.n_epi_groups
            if epi.is_store_warp:
                epi.store_pipe.producer_tail()

    @cute.jit
    def _fill_group_table(self, table: cute.Tensor, n_tiles, rows):
        """Scan the group sizes, found in ``table``'s second column, into ``table``: the entries
        of :func:`~jax_efc.kernels.grouped_walk.table`."""
        row = cutlass.Int32(0)
        tiles = cutlass.Int32(0)
        for g in cutlass.range(self.groups):
            size = table[(g, 1)]
            table[(g, 0)] = row
            table[(g, 1)] = tiles
            row, tiles = group_step(row, tiles, size, self.tile_mnk[0], n_tiles, rows)
        table[(self.groups, 0)] = row
        table[(self.groups, 1)] = tiles
        row, tiles = group_step(row, tiles, rows - row, self.tile_mnk[0], n_tiles, rows)
        table[(self.groups + 1, 0)] = row
        table[(self.groups + 1, 1)] = tiles

    def _shifted(self, tma: cute.CopyAtom, tiles: cute.Tensor, smem: cute.Tensor, shift: tuple, index,
                 cluster_coord, mcast_mode: int) -> cute.Tensor:
        """A grouped GEMM's TMA partition of the k-tiles of ``tiles`` (gA or gB) ``index`` moved by
        ``shift`` (rows, k) elements: a tile at its group's first row, or the k-tiles from the
        group's first row of the contraction on (the copy multicast along cluster mode
        ``mcast_mode``, as the unshifted partition's is). Rows past the tensor's end load as zeros;
        other groups' rows in a tile make products its epilogue does not store, and in a k-tile
        are cleared (:meth:`_clear_k_rows`)."""
        moved = cute.domain_offset((*shift, 0), tiles[(None, None, index, None, 0)])
        return cpasync.tma_partition(tma, cluster_coord, cute.make_layout(self.cluster_mn[mcast_mode]),
                                     cute.group_modes(smem, 0, 2), cute.group_modes(moved, 0, 2))[1]

    @cute.jit
    def _clear_k_rows(self, sA: cute.Tensor, sB: cute.Tensor, stage, first, ctid, barrier):
        """Zero rows ``first`` on of the k-tile in ``stage`` of the A and B rings (each thread of
        the epilogue group that consumes it a share, consecutive threads along M or N), and make
        the zeros visible to the WGMMAs that read them. A grouped GEMM over groups of the
        contraction loads whole k-tiles from its group's first row; those rows are the next
        group's (or any rows past the groups: zeroing only one operand would leave 0 * NaN)."""
        self._zero_rows(sA, self.tile_mnk[0], stage, first, ctid)
        self._zero_rows(sB, self.tile_mnk[1], stage, first, ctid)
        cute.arch.fence_proxy("async.shared", space="cta")
        barrier.arrive_and_wait()

    @cute.jit
    def _zero_rows(self, smem: cute.Tensor, width: int, stage, first, ctid):
        """Zero rows ``first`` on of ``smem``'s k-tile in ``stage``, 16 bytes a store: M/N-major,
        eight consecutive 16-bit values of a row stay together under the 128-byte swizzle (it
        permutes 16-byte units), so each thread writes whole units."""
        zeros = cute.make_rmem_tensor((_UNIT,), smem.element_type)
        zeros.fill(0)
        units = width // _UNIT
        for e in cutlass.range(ctid, (self.tile_mnk[2] - first) * units, self.n_epi_threads):
            row = cute.zipped_divide(smem[(None, first + e // units, stage)], (_UNIT,))
            cute.autovec_copy(zeros, row[(None, e % units)])

    @staticmethod
    def _order_barrier(first_id, group):
        """Ping-pong: the named barrier consumer ``group`` waits on before its mainloop
        (``_MMA_ORDER_ID``) or its epilogue (``_EPI_ORDER_ID``)."""
        return pipeline.NamedBarrier(barrier_id=first_id + group, num_threads=2 * _WG)

    @cute.jit
    def _mainloop(self, mainloop, read, release, tiled_mma: cute.TiledMma, acc: cute.Tensor,
                  tCrA: cute.Tensor, tCrB: cute.Tensor, k_tiles, ring: tuple, clear_rows=None):
        """Issue one tile's WGMMAs, keeping one k-tile batch in flight (none before partial sums
        are promoted) and releasing each stage once the batch after it is issued; the last
        batch is left in flight (the caller waits for it and releases its stage). Returns the
        advanced (read, release) states and ``tiled_mma`` (its accumulate field is set here; the
        caller rebinds all three so the tracer carries them through the tile loop). ``ring``:
        (sA, sB, ctid, barrier), the stages this thread's group consumes; with ``clear_rows``,
        the rows of the group's last k-tile (:meth:`_clear_k_rows` zeroes the rest)."""
        if cutlass.const_expr(self.promote):
            # 8-bit floats: the WGMMAs of ``promote`` k-tiles accumulate into ``part`` from zero
            # and, once they complete, ``part`` is added into ``acc`` in fp32 (Hopper's 8-bit
            # WGMMA keeps fewer bits than fp32 in its own accumulation, so a long K would lose
            # precision). Waiting for the batch before each promotion leaves the tensor cores to
            # the other warpgroup meanwhile; between promotions one batch stays in flight.
            # (Two ``part`` sets taken in turn, keeping one batch in flight, spill registers
            # even at 64 accumulators a thread: ptxas, 216 bytes at 240 registers a thread.)
            part = cute.make_rmem_tensor(acc.layout, self.acc_dtype)
            acc.fill(0.0)
        else:
            # the tile's first WGMMA overwrites the accumulators (D = A*B) and the rest add to
            # them: no zero-fill, which would cost one instruction per accumulator per tile
            part = acc
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            # order the epilogue's reads of the previous tile's accumulators before the WGMMAs
            warpgroup.fence()
        sA, sB, ctid, barrier = ring
        # promoting every few k-tiles, warpgroup w of a cooperative tile promotes after the k-tiles
        # k with (k + w) % promote == promote - 1: the two drain their WGMMAs and add at alternate
        # k-tiles, so the tensor cores run one's WGMMAs meanwhile (at the same k-tiles they
        # idled; benchmarks/FINDINGS.md, sixteenth sitting). Ping-pong consumers, and 64-row
        # cooperative tiles, are one warpgroup: w = 0.
        phase = ctid // _WG if cutlass.const_expr(self.promote > 1) else None
        for k in range(k_tiles):
            step = k + phase if cutlass.const_expr(self.promote > 1) else k  # (in the interval)
            mainloop.consumer_wait(read)
            if cutlass.const_expr(clear_rows is not None):
                if k == k_tiles - 1:
                    if clear_rows < self.tile_mnk[2]:
                        self._clear_k_rows(sA, sB, read.index, clear_rows, ctid, barrier)
            if cutlass.const_expr(self.promote):
                # (each promotion's first k-tile starts ``part`` from zero, and so does the tile's)
                if cutlass.const_expr(self.promote == 1):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                else:
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, step % self.promote * k != 0)
                # order the adds' reads of ``part`` (and the epilogue's of ``acc``) before them
                warpgroup.fence()
            tiled_mma = self._issue_k_tile(read, tiled_mma, part, tCrA, tCrB)
            # (two batches in flight, each stage released a k-tile later, was not kept: on an
            # H200 at 128x128 it was 0.1-2.1% slower at 14 of 15 problems in one run (equal
            # at the 15th) after 0.9-5.4% faster at 6 of 8 in an earlier one, and 2.5-6.6%
            # slower for alpha-beta)
            if cutlass.const_expr(self.promote > 1):
                if step % self.promote == self.promote - 1 or k == k_tiles - 1:
                    warpgroup.wait_group(0)
                    _add_into(acc, part)
                else:
                    warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0 if self.promote else 1)
            if k > 0:
                mainloop.consumer_release(release)
                release.advance()
            read.advance()
            if cutlass.const_expr(self.promote == 1):
                _add_into(acc, part)
        return read, release, tiled_mma

    @cute.jit
    def _issue_k_tile(self, read, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
                      tCrB: cute.Tensor):
        """Issue the WGMMAs of the k-tile at ``read`` into ``acc`` as one batch (the first as
        ``tiled_mma``'s accumulate field says, the rest adding); returns ``tiled_mma``."""
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            coord = (None, None, kb, read.index)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return tiled_mma

    def _consumer_epilogue(self, tiled_mma: cute.TiledMma, ctid, group, warp_idx, tensors: EpilogueTensors,
                           sA, sB) -> ConsumerEpilogue:
        """Build consumer ``group``'s epilogue machinery for thread ``ctid`` of the group."""
        # register <-> smem copies share one thread/value partition for all outputs and TILE
        # operands, so the visitor's fragments line up with every buffer
        c_layout_atom = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), tiled_mma
        )
        r2s = [cute.make_tiled_copy_S(self._r2s_atom(dt, t), c_layout_atom)
               for dt, t in zip(self.out_dtypes, self.out_m_major)]
        frag_shape = cute.shape(r2s[0].get_slice(ctid).partition_S(tensors.sD[0]))[:3]
        # TILE operands come back from smem by ldmatrix when 16-bit (four 8x8 blocks per
        # instruction instead of one value per load)
        s2r = [cute.make_tiled_copy_S(self._s2r_atom(dt), c_layout_atom) for dt in self.tile_op_dtypes]
        acc_index = []  # made at the first call, as the kernel always has

        def coords(thread):
            if not acc_index:
                acc_index.append(self._subtile_acc_indices(tiled_mma, r2s[0]))
            return (tiled_mma.get_slice(thread).partition_C(cute.make_identity_tensor(self.tile_mnk[:2])),
                    acc_index[0])

        return self._consumer_epilogue_from(tensors, r2s, s2r, frag_shape, ctid, group, warp_idx, coords=coords,
                                            ring=(sA, sB))

    def _r2s_atom(self, dtype, m_major: bool):
        """stmatrix where every output is 16-bit (its transposing form into an M-major subtile:
        the same registers, the same thread/value partition as the plain form's); else one
        value per thread and store."""
        if self.use_stmatrix:
            return cute.make_copy_atom(warp.StMatrix8x8x16bOp(m_major, 4), dtype)
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)

    @staticmethod
    def _s2r_atom(dtype):
        if dtype.width == 16:
            return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dtype)
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)

    def _subtile_acc_indices(self, tiled_mma: cute.TiledMma, r2s: cute.TiledCopy) -> list[list[int]]:
        """For each epilogue subtile, the accumulator element behind each value of the
        register fragment that ``r2s`` stores (trace-time integers).

        Matched by coordinates: a thread's accumulator and fragment values are the same
        (m, n) points up to one per-thread offset, since the copy is built from the MMA's
        C layout; so thread 0's static coordinates give every thread's mapping."""
        acc_coords = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(self.tile_mnk[:2]))
        where = {tuple(acc_coords[i]): i for i in range(cute.size(acc_coords))}
        frag_coords = r2s.get_slice(0).partition_S(cute.make_identity_tensor(self.epi_tile))
        n_frag = cute.size(frag_coords)
        sub_m = self.tile_mnk[0] // self.epi_tile[0]
        indices = [[where[(frag_coords[v][0] + s % sub_m * self.epi_tile[0],
                           frag_coords[v][1] + s // sub_m * self.epi_tile[1])] for v in range(n_frag)]
                   for s in range(self.n_acc_sub)]
        if sorted(i for sub in indices for i in sub) != list(range(len(where))):
            raise RuntimeError(f"epilogue subtiles of {self.epi_tile} do not cover the "
                               f"{self.tile_mnk[:2]} accumulators exactly once")
        return indices


def _gather_registers(frag: cute.Tensor, acc: cute.Tensor, indices: list[int]) -> None:
    """``frag[v] = acc[indices[v]]``: register renames, unrolled by Python at trace time (a
    subtile holds up to 96 values a thread, past the DSL's static-loop warning)."""
    widen = acc.element_type is not frag.element_type  # a 16-bit accumulator, read as fp32
    for v, i in enumerate(indices):
        frag[v] = frag.element_type(acc[i]) if widen else acc[i]


@cute.jit
def _add_into(acc: cute.Tensor, part: cute.Tensor) -> None:
    """``acc`` += ``part``, elementwise (promoted partial sums)."""
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        acc[i] = acc[i] + part[i]

