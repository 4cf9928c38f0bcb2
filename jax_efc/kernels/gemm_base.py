"""The epilogue driver every architecture's fused-GEMM kernel shares.

A consumer runs a tile's epilogue one ``epi_m x epi_n`` subtile at a time
(:meth:`FusedGemmBase._epilogue`): it takes the subtile's fp32 accumulators (the one
architecture hook, :meth:`~FusedGemmBase._subtile_accumulators`: registers on Hopper, tensor
memory on Blackwell), hands them with their coordinates to the :class:`EpilogueVisitor`,
converts each output to its dtype, writes it to its own smem buffer and stores it with TMA
(the TMA store clips the M/N edges); an output stored only where its mask holds
(``KernelProblem.masked``) goes from registers to global memory by predicated stores instead.
TILE operands come in through two smem buffers per operand, TMA-loaded two subtiles ahead,
except on the CTA's last tile: the producer loads its TILE operands into the A/B ring's stages
as that tile's mainloop frees them, and its outputs are staged in the ring too where they fit.
Stream-K pieces that start past k = 0
leave their partial sums in a workspace slot instead (:meth:`~FusedGemmBase._split_epilogue`);
the tile's first piece adds them before its epilogue. Outputs that reduce are staged and
reduced per subtile by ``reduction.py`` and leave one partial per tile (or fold it into the
result by atomics).

The mainloop, the warp roles and the launch are the architecture's (``sm90.py``,
``sm100.py``), and so is the set-up the driver's helpers below share between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from jax_efc.kernels.dtypes import cutlass_dtype
from jax_efc.kernels.epilogue_state import CallArguments, ConsumerEpilogue, EpilogueTensors
from jax_efc.kernels.fragment_math import store_if
from jax_efc.kernels.problem import (EPI_STAGES, SMEM_ALIGN, TIMELINE_EVENTS, TIMELINE_UNITS,
                                     KernelProblem, cta_tile, epilogue_tile, tile_operand_indices)
from jax_efc.kernels.reduction import TileReduction
from jax_efc.kernels.row_stats import RowStats
from jax_efc.kernels.schedule import TileSchedule, TileWalk, Unit
from jax_efc.kernels.visitor import EpilogueVisitor

__all__ = ["FusedGemmBase", "EPI_BARRIER_ID"]

# named barrier 0 is __syncthreads; epilogue group g syncs its threads on EPI_BARRIER_ID + g
EPI_BARRIER_ID = 1


class FusedGemmBase:
    """The architecture-neutral part of a fused-GEMM kernel: its epilogue geometry, the
    subtile walk, TILE-operand staging, output stores, the stream-K fix-up and the timeline
    stamps. Subclasses add the mainloop, the warp roles and the launch, and implement the
    hooks below."""

    def __init__(self, problem: KernelProblem, schedule: TileSchedule, timeline: bool, *, stages: int,
                 epi_threads: int, epi_groups: int, epi_blocks: int = 1):
        """``schedule``: the persistent grid and how it walks the tiles. With stream-K,
        ``flags`` holds ``schedule.slots`` zeroed int32 and ``workspace`` as many fp32 tiles.
        ``timeline``: a diagnostic build that also writes, per consumer group and unit, the SM
        clock (32 bits, wrapping) at each of :data:`TIMELINE_EVENTS` into ``stamps`` (int32,
        :meth:`timeline_size` values, zeroed beforehand; units past :data:`TIMELINE_UNITS` a
        group are not kept). ``stages``: the A/B ring's depth (the architecture's policy
        counts what fits); ``epi_threads``: threads of one epilogue group; ``epi_groups``:
        groups per CTA, each with its own tiles and epilogue; ``epi_blocks``: column blocks a
        subtile spans (:meth:`_epi_tiler`)."""
        cfg = problem.config
        self.schedule = schedule
        self.timeline = timeline
        # the CTA's tile (a 2-CTA MMA's tile is a pair of them)
        tile_m, tile_n = cta_tile(cfg)
        self.tile_mnk = (tile_m, tile_n, problem.tile_k)
        self.cluster_mn = (cfg.cluster_m, cfg.cluster_n)
        self.ab_dtype = cutlass_dtype(problem.ab_dtype)  # A's
        self.b_dtype = cutlass_dtype(problem.b_dtype)
        self.acc_dtype = cutlass_dtype(problem.acc_dtype)  # the MMA's; the epilogue reads it as fp32
        self.a_batched = problem.a_batched
        self.b_batched = problem.b_batched
        self.visitor = EpilogueVisitor(problem.program, problem.operand_batched)
        self.n_operands = len(problem.ir.operands)
        self.out_dtypes = self.visitor.out_dtypes
        # outputs stored transposed: their smem subtiles and global tensors are M-major
        self.out_m_major = tuple(o.transposed for o in self.visitor.stored)
        self.aliased = problem.aliased  # outputs stored into their operand's tensor
        self.masked = problem.masked  # of those, the ones stored only where their mask holds
        self.n_epi_groups = epi_groups
        self.n_epi_threads = epi_threads
        # fp32 accumulators per epilogue thread (a stream-K partial is written in this order)
        self.acc_per_thread = tile_m * tile_n // epi_threads
        self.epi_tile = epilogue_tile(cfg)
        self.epi_blocks = epi_blocks
        # a gated GEMM (jax_efc.gated): the tile's columns are (gate, up) block pairs, and its
        # outputs' tile is half as wide, a gate block's columns
        self.gated = problem.ir.gated
        self.out_tile = (tile_m, tile_n // 2 if self.gated else tile_n)
        # a grouped GEMM (jax_efc.grouped_gemm): units walk grouped_walk.GroupedWalk, where the
        # groups split the output's rows, or grouped_walk.ContractionWalk, where they split the
        # contraction (the output then batched by group, its tiles those of a batched GEMM)
        self.groups = problem.groups
        self.grouped_rows = bool(problem.groups) and not problem.ragged_k
        self.grouped_k = bool(problem.groups) and problem.ragged_k
        self.reductions = tuple(TileReduction(o.reduce, o.over, self.epi_tile, self.out_tile, epi_threads,
                                              epi_blocks, atomic=o.atomic) for o in self.visitor.reduced)
        # the reductions the program consumes (KernelProblem.row_stats); their buffers, fragments
        # and lane maps follow the outputs' in the red_* lists
        self.row_stats = RowStats(self.visitor, self.epi_tile, self.out_tile, epi_threads, epi_blocks,
                                  first=len(self.reductions))
        self.meeting = self.reductions + self.row_stats.reductions  # in red_* order
        # subtiles of the outputs' tile, numbered down M first (of the accumulator tile:
        # n_acc_sub); values in one subtile of one tensor
        self.n_sub = (tile_m // self.epi_tile[0]) * (self.out_tile[1] // self.epi_tile[1])
        self.n_acc_sub = (tile_m // self.epi_tile[0]) * (tile_n // self.epi_tile[1])
        self.subtile_elems = self.epi_tile[0] * self.epi_tile[1]
        # TILE operands that some output uses are staged through smem by TMA
        ops = problem.ir.operands
        self.tile_ops = tile_operand_indices(problem.program)
        self.tile_op_dtypes = tuple(cutlass_dtype(ops[i].dtype) for i in self.tile_ops)
        self.tile_op_batched = tuple(problem.operand_batched[i] for i in self.tile_ops)
        # bytes one subtile of every TILE operand brings in (the TMA transaction count)
        self.tile_op_bytes = sum(self.subtile_elems * dt.width // 8 for dt in self.tile_op_dtypes)
        # stmatrix stores 8x8 blocks of 16-bit values; it only helps when every output is
        # 16-bit (one register->smem partition is shared by all outputs; each architecture picks
        # its atoms).
        self.use_stmatrix = all(dt.width == 16 for dt in self.out_dtypes)
        self.stages = stages
        if self.stages < 2:
            raise ValueError(f"{cfg} with {len(self.out_dtypes)} outputs leaves room for "
                             f"{self.stages} pipeline stages; use a smaller tile.")
        self.ring_slots, self.ring_out_slots, self.ring_stage_bytes = self._place_ring_subtiles()

    # ---------------------------------------------------------------- architecture hooks
    def _subtile_accumulators(self, epi: ConsumerEpilogue, acc, s: int, m_idx, n_idx,
                              last_read: bool = True) -> list[tuple]:
        """Put subtile ``s``'s fp32 accumulators of tile (m_idx, n_idx) into ``epi.frag`` and
        return each value's global (m, n): registers on Hopper, tensor memory on Blackwell.
        ``last_read``: the tile's accumulators are read no more after its last subtile (a walk
        of ``RowStats.totals`` is followed by the epilogue's own)."""
        raise NotImplementedError

    def _walk_offset(self):
        """What a walk of ``RowStats.totals`` adds to the coordinates it reads and masks at:
        nothing, or a zero the compiler cannot see through, where the walks must not share
        their addresses with the epilogue (``sm100.py``)."""
        return None

    def _epi_smem_layout(self, dtype, stages: int, m_major: bool = False) -> cute.ComposedLayout:
        """The smem layout of ``stages`` epilogue subtiles of ``dtype`` (row-major, or M-major for
        an output stored transposed; swizzled)."""
        raise NotImplementedError

    def _store_warp(self, group):
        """The warp of epilogue group ``group`` that issues its TMA stores and TILE-operand loads."""
        raise NotImplementedError

    def _place_ring_subtiles(self) -> tuple:
        """Where the CTA's last tile puts its TILE-operand subtiles and, where they fit too,
        its output subtiles, in the A/B ring past the last k-tile: one 1 KiB-aligned slot
        per tensor and subtile, as (stage, part, byte offset) with ``stage`` counted from the
        stage after the last k-tile and part 0 for A's share of a stage, 1 for B's. Returns
        (operand slots, output slots, bytes each operand stage receives); ``None`` for all
        three where there are no TILE operands, they do not all fit, or under stream-K (its
        last units end in the split epilogue, which keeps the shared buffers); the output
        slots are ``None`` where only the operands fit.

        Nothing hides the CTA's last epilogue, and through the two shared buffers its TILE
        loads run only two subtiles ahead. So the producer, once it has issued the last
        k-tile, loads that tile's TILE operands into the next ring stages as the mainloop
        frees them, in subtile order, and the epilogue finds them there. Measured on H200
        (alpha-beta, 128x128 ping-pong tiles, SM cycles, `benchmarks/timeline.py`) at
        2048x4096x4096 and 4096^3, the last epilogue took: 7.5k through the buffers and 5.7k
        and 5.5k loaded all at once into the idle ring after the mainloop (128x16 subtiles);
        5.3k to 5.7k loaded that way and 3.9k to 4.0k loaded by the producer (64x32 subtiles).

        Outputs staged in the stages after those each have a slot per subtile, so no subtile
        waits for the TMA store of the one before to have read its buffer: alpha-beta's last
        epilogue (bf16 outputs, same tiles) took 5.2k and 5.3k cycles against 5.4k and 5.9k,
        and the kernel ran 0.3% to 5% faster at four shapes (``benchmarks/FINDINGS.md``)."""
        if not self.tile_ops or self.schedule.stream_k is not None or self.groups:
            return None, None, None
        room = (self.tile_mnk[0] * self.tile_mnk[2] * self.ab_dtype.width // 8,
                self.tile_mnk[1] * self.tile_mnk[2] * self.b_dtype.width // 8)

        def nbytes(dt):
            return self.subtile_elems * dt.width // 8

        def size(dt):
            return -(-nbytes(dt) // SMEM_ALIGN) * SMEM_ALIGN

        def pack(dtypes, stage):
            """Slots for ``dtypes``' subtiles, subtile by subtile, from ``stage`` on; with the
            stage after the last one used, or None where they run past the ring."""
            slots = [[] for _ in dtypes]
            part, used = 0, 0
            for _ in range(self.n_sub):
                for t, dt in enumerate(dtypes):
                    while used + size(dt) > room[part]:
                        stage, part, used = (stage, 1, 0) if part == 0 else (stage + 1, 0, 0)
                        if stage == self.stages:
                            return None
                    slots[t].append((stage, part, used))
                    used += size(dt)
            return tuple(tuple(s) for s in slots), stage + 1

        placed = pack(self.tile_op_dtypes, 0)
        if placed is None:
            return None, None, None
        op_slots, n_op_stages = placed
        stage_bytes = [0] * n_op_stages
        for dt, slots in zip(self.tile_op_dtypes, op_slots):
            for stage, _, _ in slots:
                stage_bytes[stage] += nbytes(dt)
        outputs = pack(self.out_dtypes, n_op_stages) if n_op_stages < self.stages else None
        return op_slots, outputs and outputs[0], tuple(stage_bytes)

    def _gated_subtiles(self, s: int) -> tuple[int, int, int]:
        """A gated GEMM's output subtile ``s``: the accumulator subtiles of its gate and up values
        and how many columns left of the gate's its output columns lie (trace-time integers).
        The output's column c of the tile lies in block pair c // B at c % B; that pair's gate
        block starts at accumulator column 2B (c // B), its up block B columns further."""
        sub_m, epi_n, block = self.tile_mnk[0] // self.epi_tile[0], self.epi_tile[1], self.gated
        col = s // sub_m * epi_n
        gate_col = col + col // block * block
        gate = s % sub_m + sub_m * (gate_col // epi_n)
        return gate, gate + sub_m * (block // epi_n), gate_col - col

    def _epi_tiler(self):
        """A subtile as a CuTe tiler of the CTA tile: ``epi_tile``, or where a subtile spans
        ``epi_blocks`` column blocks, its N mode as that many runs of ``epi_n / epi_blocks``
        columns, ``tile_n / epi_blocks`` apart; the subtiles along N follow one another a run's
        width apart (see :class:`~jax_efc.kernels.reduction.TileReduction`)."""
        if self.epi_blocks == 1:
            return self.epi_tile
        epi_m, epi_n = self.epi_tile
        blocks = self.epi_blocks
        return epi_m, cute.make_layout((epi_n // blocks, blocks), stride=(1, self.tile_mnk[1] // blocks))

    @staticmethod
    def _unit(walk: TileWalk, j) -> Unit:
        """Unit ``j`` of the CTA's walk, its coordinates marked warp-uniform."""
        u = walk.unit(j)
        return Unit(*(cute.arch.make_warp_uniform(v) if isinstance(v, cutlass.Int32) else v for v in u))

    # ---------------------------------------------------------------- shared set-up
    def _call_arguments(self, rest: tuple) -> CallArguments:
        """Split a launch's tensors after A and B: the operands, the results of the reductions
        folded by atomics, stream-K's flags, a timeline's stamps, the outputs, the other
        reductions' partials and stream-K's workspace. An output written over its operand
        (``KernelProblem.aliased``) is not passed apart: it is the operand's tensor; nor is a
        reduction's result: it is the input that holds its identity."""
        operands = rest[: self.n_operands]
        n_atomic = sum(r.atomic for r in self.reductions)
        folded = iter(rest[self.n_operands: self.n_operands + n_atomic])
        rest = rest[self.n_operands + n_atomic:]
        aliased = dict(self.aliased)
        n_out = len(self.out_dtypes) - len(aliased)
        split = self.schedule.stream_k is not None
        n_extra = int(split) + int(self.timeline)  # inputs between the operands and the outputs
        end = n_extra + n_out + len(self.reductions) - n_atomic
        passed = iter(rest[n_extra: n_extra + n_out])
        outputs = tuple(operands[aliased[i]] if i in aliased else next(passed) for i in range(len(self.out_dtypes)))
        partials = iter(rest[n_extra + n_out: end])
        reduced = tuple(next(folded) if r.atomic else next(partials) for r in self.reductions)
        return CallArguments(operands, rest[0] if split else None, (rest[int(split)],) if self.timeline else (),
                             outputs, reduced, rest[end] if split else None)

    def _epilogue_tma(self, operands: tuple, outputs: tuple) -> tuple:
        """The epilogue's TMA: per output a store and per TILE operand a load of one subtile,
        and their smem layouts (``EPI_STAGES`` subtiles each). Returns (d_smem, tma_d, g_d,
        c_smem, tma_c, g_c)."""
        d_smem = tuple(self._epi_smem_layout(dt, EPI_STAGES, t) for dt, t in zip(self.out_dtypes, self.out_m_major))
        c_smem = tuple(self._epi_smem_layout(dt, EPI_STAGES) for dt in self.tile_op_dtypes)
        tma_c, g_c = [], []
        for j in range(len(self.tile_ops)):  # plain Python: helpers are not preprocessed
            atom, tensor = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), operands[self.tile_ops[j]],
                cute.slice_(c_smem[j], (None, None, 0)), self._epi_tiler(),
            )
            tma_c.append(atom)
            g_c.append(tensor)
        tma_d, g_d = [], []
        for i in range(len(outputs)):
            atom, tensor = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), outputs[i],
                cute.slice_(d_smem[i], (None, None, 0)), self._epi_tiler(),
            )
            tma_d.append(atom)
            g_d.append(tensor)
        return d_smem, tuple(tma_d), tuple(g_d), c_smem, tuple(tma_c), tuple(g_c)

    @staticmethod
    def _prefetch_descriptors(atoms) -> None:
        for atom in atoms:
            cpasync.prefetch_descriptor(atom)

    def _epilogue_tensors(self, smem: SmemAllocator, warp_idx, operands: tuple, mD: tuple, d_smem: tuple,
                          tma_d: tuple, mC: tuple, c_smem: tuple, tma_c: tuple, mP: tuple) -> EpilogueTensors:
        """Allocate the epilogue's shared memory after the architecture's own: per output and
        per TILE operand its ``EPI_STAGES`` subtile buffers, per reducing output its fp32
        buffers, and one "full" mbarrier per TILE-operand buffer (initialized by warp 0)."""
        sD = [smem.allocate_tensor(dt, layout.outer, SMEM_ALIGN, layout.inner)
              for dt, layout in zip(self.out_dtypes, d_smem)]
        sC = [smem.allocate_tensor(dt, layout.outer, SMEM_ALIGN, layout.inner)
              for dt, layout in zip(self.tile_op_dtypes, c_smem)]
        red_smem = [smem.allocate_tensor(cutlass.Float32, r.layout(), 16) for r in self.meeting]
        c_bar = self._full_barriers(smem, EPI_STAGES, warp_idx) if self.tile_ops else None
        return EpilogueTensors(operands, mD, sD, tma_d, mC, sC, tma_c, c_bar, red_smem, mP)

    def _consumer_epilogue_from(self, tensors: EpilogueTensors, r2s: list, s2r: list, frag_shape, ctid, group,
                                warp_idx, *, coords: Callable[[Any], tuple], ring: tuple) -> ConsumerEpilogue:
        """Epilogue group ``group``'s machinery for its thread ``ctid``, from the architecture's
        register <-> smem copies (``r2s`` per output, ``s2r`` per TILE operand, all of one
        thread/value partition, whose register fragments have ``frag_shape``) and ``coords``,
        which gives the coordinates of a thread's accumulator values (``tCcT``, ``acc_index``: see
        :class:`ConsumerEpilogue`); it is called for ``ctid`` where Hopper's kernel has always
        built them, which keeps that kernel's generated code as it was, and for threads given as
        integers where the reductions read their layout."""
        t = tensors
        thr_r2s = [c.get_slice(ctid) for c in r2s]
        thr_s2r = [c.get_slice(ctid) for c in s2r]
        frag_c = [cute.make_rmem_tensor(frag_shape, dt) for dt in self.tile_op_dtypes]
        fields = dict(
            operands=t.operands,
            mn_extent=(t.mD[0].shape[0], t.mD[0].shape[1]),
            sD=t.sD,
            gD=self._local_tiles(t.mD),
            tma_d=t.tma_d,
            r2s=r2s,
            tRS_sD=[thr.partition_D(sd) for thr, sd in zip(thr_r2s, t.sD)],
            frag_out=[cute.make_rmem_tensor(frag_shape, dt) for dt in self.out_dtypes],
            sC=t.sC,
            gC=self._local_tiles(t.mC),
            tma_c=t.tma_c,
            s2r=s2r,
            tSR_sC=[thr.partition_S(sc) for thr, sc in zip(thr_s2r, t.sC)],
            tSR_rC=[c.retile(f) for c, f in zip(s2r, frag_c)],
            frag_c=frag_c,
            c_bar=t.c_bar,
            ring=ring,
            thr_s2r=thr_s2r,
            thr_r2s=thr_r2s,
            frag=cute.make_rmem_tensor(frag_shape, cutlass.Float32),
            frag_up=cute.make_rmem_tensor(frag_shape, cutlass.Float32) if self.gated else None,
            frag_raw=(cute.make_rmem_tensor(frag_shape, self.acc_dtype)
                      if self.acc_dtype in (cutlass.Int32,) else None),
        )
        fields["tCcT"], fields["acc_index"] = coords(ctid)
        return ConsumerEpilogue(
            **fields,
            barrier=pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID + group, num_threads=self.n_epi_threads),
            store_pipe=pipeline.PipelineTmaStore.create(
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.n_epi_threads),
            ),
            is_store_warp=warp_idx == self._store_warp(group),
            ctid=ctid,
            red_smem=tuple(t.red_smem),
            red_out=tuple(t.mP),
            red_frag=tuple(cute.make_rmem_tensor(frag_shape, cutlass.Float32) for _ in self.meeting),
            red_lanes=self._lane_maps(coords, fields["acc_index"]),
        )

    def _tile_coords(self, epi: ConsumerEpilogue, s: int, m_idx, n_idx) -> list[tuple]:
        """Global (m, n) in the outputs of subtile ``s``'s fragment values in tile (m_idx, n_idx)."""
        m0, n0 = self._first_row(m_idx), n_idx * self.out_tile[1]
        if self.gated:
            gate, _, shift = self._gated_subtiles(s)
            return [(m0 + epi.tCcT[i][0], n0 + epi.tCcT[i][1] - shift) for i in epi.acc_index[gate]]
        return [(m0 + epi.tCcT[i][0], n0 + epi.tCcT[i][1]) for i in epi.acc_index[s]]

    def _lane_maps(self, coords: Callable[[Any], tuple], acc_index: list) -> tuple:
        """Each reduction's lane map, read off the points of the threads it asks for (each
        thread's partition made once, shared by the reductions)."""
        seen: dict[int, list] = {}

        def points(t: int) -> list:
            if t not in seen:
                seen[t] = self._subtile_points(coords(t)[0], acc_index)
            return seen[t]

        return tuple(r.lane_map(points) for r in self.meeting)

    def _subtile_points(self, tCcT, acc_index: list) -> list[list[tuple]]:
        """Per output subtile, the (m, n) within the outputs' tile of each fragment value of the
        thread whose accumulator coordinates are ``tCcT`` (trace-time integers for a thread
        given as one: what :func:`~jax_efc.kernels.reduction.lane_map` reads)."""
        if self.gated:
            return [[(tCcT[i][0], tCcT[i][1] - shift) for i in acc_index[gate]]
                    for gate, _, shift in map(self._gated_subtiles, range(self.n_sub))]
        return [[tuple(tCcT[i]) for i in acc_index[s]] for s in range(self.n_sub)]

    @cute.jit
    def _split_epilogue(self, epi: ConsumerEpilogue, acc: cute.Tensor, bSC, u: Unit, subtile_count,
                        sk_buffers: tuple, slot, cta_rank, ctid):
        """Stream-K: a piece that does not start at k = 0 leaves its partial in the CTA's
        workspace slot; one that does adds its helpers' partials (if any), then runs the
        epilogue. Returns the running subtile count."""
        flags, ws = sk_buffers
        cluster_size = self.cluster_mn[0] * self.cluster_mn[1]
        # the accumulators in register order, flat and as the workspace's (4, n) vectors
        acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(self.acc_per_thread))
        acc_vec = cute.make_tensor(acc.iterator, cute.make_layout((4, self.acc_per_thread // 4)))
        if u.k_begin > 0:
            cute.autovec_copy(acc_vec, ws[(None, ctid, None, slot)])
            # every thread's partial is written before one thread raises the flag (release)
            epi.barrier.arrive_and_wait()
            if ctid == 0:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.store(flags.iterator + slot, cutlass.Int32(1), sem="relaxed", scope="gpu")
        else:
            w = u.first_helper
            while w <= u.last_helper:
                helper = w * cluster_size + cta_rank
                if ctid == 0:
                    while cute.arch.load(flags.iterator + helper, cutlass.Int32, sem="acquire",
                                         scope="gpu") != 1:
                        pass
                epi.barrier.arrive_and_wait()
                partial = ws[(None, ctid, None, helper)]
                # four vectors at a time: a whole partial would not fit next to the accumulators
                for c in cutlass.range_constexpr(self.acc_per_thread // 16):
                    part = cute.make_rmem_tensor((4, 4), cutlass.Float32)
                    cute.autovec_copy(cute.local_tile(partial, (4, 4), (0, c)), part)
                    for i in cutlass.range_constexpr(16):
                        acc_flat[16 * c + i] += part[i]
                w += 1
            subtile_count = self._epilogue(epi, acc, bSC, u.m, u.n, u.l, subtile_count)
        return subtile_count

    def timeline_size(self) -> int:
        """Values in a ``timeline`` build's ``stamps``: per CTA of the grid, consumer group and
        unit, one per event."""
        ctas = self.schedule.clusters * self.cluster_mn[0] * self.cluster_mn[1]
        return ctas * self.n_epi_groups * TIMELINE_UNITS * len(TIMELINE_EVENTS)

    @cute.jit
    def _stamp(self, stamps: tuple, ctid, slot, group, j, event: str):
        """``timeline`` builds: the first thread of consumer ``group`` in CTA ``slot`` writes
        the SM clock for ``event`` of its unit ``j`` (units past :data:`TIMELINE_UNITS` are
        not kept)."""
        if cutlass.const_expr(len(stamps) > 0):
            row = ((slot * self.n_epi_groups + group) * TIMELINE_UNITS + j // self.n_epi_groups) \
                * len(TIMELINE_EVENTS)
            if ctid == 0 and row < cute.size(stamps[0]):
                stamps[0][row + TIMELINE_EVENTS.index(event)] = cute.arch.clock()

    @cute.jit
    def _prefetch_tile_ops(self, epi: ConsumerEpilogue, bSC, subtile_count):
        """Start the TMA loads of a tile's first ``EPI_STAGES`` TILE-operand subtiles."""
        if cutlass.const_expr(len(bSC) > 0):
            if epi.is_store_warp:
                for s in cutlass.range_constexpr(min(self.n_sub, EPI_STAGES)):
                    self._load_tile_ops(epi, bSC, s, (subtile_count + s) % EPI_STAGES)

    def _subtile_tma(self, atom: cute.CopyAtom, smem: cute.Tensor, tile: cute.Tensor) -> tuple:
        """(smem, gmem) TMA partitions for copies between the staged epilogue ``smem``
        (indexed ``(None, stage)``) and the (epi_m x epi_n) subtiles of the global ``tile``
        (indexed ``(None, subtile)``)."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                     cute.zipped_divide(tile, self._epi_tiler()))

    def _local_tiles(self, tensors) -> list:
        """Each (M|1, N|1, L|1) tensor of ``tensors`` (outputs, TILE operands) as (bM, bN, RestM,
        RestN, RestL) tiles of the outputs' tile."""
        tile_2d = self.out_tile if self.gated else cute.slice_(self.tile_mnk, (None, None, 0))
        return [cute.local_tile(t, tile_2d, (None, None, None)) for t in tensors]

    def _tile_op_tile(self, gC: list, j, m_idx, n_idx, l_idx) -> cute.Tensor:
        """TILE operand ``j``'s part of tile (m_idx, n_idx, l_idx) (batch 0 if it has none),
        from its ``gC`` tiles."""
        return self._tile_of(gC[j], m_idx, n_idx, l_idx if self.tile_op_batched[j] else 0)

    def _tile_of(self, tiles: cute.Tensor, m_idx, n_idx, l_idx) -> cute.Tensor:
        """Tile (m_idx, n_idx, l_idx) of ``tiles`` (a tensor's, from :meth:`_local_tiles`). In a
        GEMM whose groups split the rows ``m_idx`` is the tile's first row, anywhere (groups are
        not padded to whole tiles), and ``l_idx`` (the group) indexes none of the outputs and TILE
        operands."""
        if self.grouped_rows:
            return cute.domain_offset((m_idx, 0), tiles[(None, None, 0, n_idx, 0)])
        return tiles[(None, None, m_idx, n_idx, l_idx)]

    def _first_row(self, m_idx):
        """The first row of a unit's tile (a grouped GEMM's units give it as their ``m``)."""
        return m_idx if self.grouped_rows else m_idx * self.out_tile[0]

    def _tile_op_partitions(self, epi: ConsumerEpilogue, m_idx, n_idx, l_idx) -> list:
        """(smem, gmem) TMA partitions of tile (m_idx, n_idx, l_idx)'s TILE-operand subtiles."""
        return [self._subtile_tma(epi.tma_c[j], epi.sC[j], self._tile_op_tile(epi.gC, j, m_idx, n_idx, l_idx))
                for j in range(len(self.tile_ops))]

    @cute.jit
    def _epilogue(self, epi: ConsumerEpilogue, acc: cute.Tensor, bSC, m_idx, n_idx, l_idx,
                  subtile_count, ring=None, paced: bool = False, m_end=None):
        """The fused epilogue of one tile, one (epi_m x epi_n) subtile at a time, through
        the ``EPI_STAGES`` epilogue smem buffers. ``ring``: the CTA's last tile, as (the A/B
        pipeline, its state past the tile's last k-tile); its TILE operands come through
        the ring stages from there on (the producer loads them) and its outputs are staged
        in the stages after those where they have slots. ``paced``: the visitor's paced
        evaluation. ``m_end``: a grouped GEMM's end of the tile's group, whose rows past it the
        tile does not store. Returns the running subtile count."""
        n_out = len(self.out_dtypes)
        from_ring = ring is not None
        out_in_ring = from_ring and self.ring_out_slots is not None
        n_tc = len(self.tile_ops)
        n_sub = self.n_sub
        frag = epi.frag
        gD = [self._tile_of(epi.gD[i], m_idx, n_idx, l_idx) for i in range(n_out)]
        bSG = [self._subtile_tma(epi.tma_d[i], epi.sD[i], gD[i]) for i in range(n_out)]
        ring_states = []  # the ring's stages from the one past the last k-tile on
        if cutlass.const_expr(from_ring):
            mainloop, past = ring
            for k in cutlass.range_constexpr(self.stages):
                index = past.index + k
                ring_states.append(pipeline.PipelineState(
                    self.stages, past.count + k, index % self.stages, past.phase ^ (index // self.stages)))
        waited = 0  # operand stages waited for so far
        origin = (self._first_row(m_idx), n_idx * self.out_tile[1])
        # A grouped GEMM's tile that runs past its group's rows stores only those from its staged
        # subtiles by predicate: the next group's tile owns the rest, and a TMA store writes a whole
        # box (bounding it at the group's end would take a tensor map per group, rewritten on the
        # device before the store, for one tile a group).
        whole = True
        if cutlass.const_expr(self.grouped_rows):
            whole = m_idx + self.out_tile[0] <= m_end
        totals = self.row_stats.totals(self, epi, acc, m_idx, n_idx, l_idx, origin)
        running = [r.start(lanes) for r, lanes in zip(self.reductions, epi.red_lanes)]
        for s in cutlass.range_constexpr(n_sub):
            coords = self._subtile_accumulators(epi, acc, s, m_idx, n_idx)
            buf = subtile_count % EPI_STAGES
            # this subtile's smem: its own ring slots, or buffer `buf`
            tile_op_smem = []
            if cutlass.const_expr(from_ring):
                for k in cutlass.range_constexpr(waited, 1 + max(sl[s][0] for sl in self.ring_slots)):
                    mainloop.consumer_wait(ring_states[k])
                    waited = k + 1
                tile_op_smem = [
                    epi.thr_s2r[t].partition_S(self._ring_view(
                        epi.ring, self.tile_op_dtypes[t], self.ring_slots[t][s],
                        ring_states[self.ring_slots[t][s][0]].index))[(None, None, None, 0)]
                    for t in range(n_tc)]
            elif cutlass.const_expr(n_tc > 0):
                # subtile_count-th load into this buffer: its parity is the phase
                cute.arch.mbarrier_wait(epi.c_bar + buf, (subtile_count // EPI_STAGES) % 2)
                tile_op_smem = [part[(None, None, None, buf)] for part in epi.tSR_sC]
            preloaded = {}
            for j in cutlass.range_constexpr(n_tc):
                cute.copy(epi.s2r[j], tile_op_smem[j], epi.tSR_rC[j])
                preloaded[self.tile_ops[j]] = epi.frag_c[j].load().to(cutlass.Float32)
            outs = self.visitor(frag.load(), coords, epi.operands, epi.mn_extent, l_idx, preloaded,
                                paced=paced, raw=None if epi.frag_raw is None else epi.frag_raw.load(),
                                up=epi.frag_up.load() if self.gated else None,
                                given=self.row_stats.given(epi, totals, s))
            # (Stores from registers straight to global memory, 32 bits a pair of values with
            # no smem buffers and no barriers, were slower for alpha-beta on H200, and the smem
            # they free bought nothing: benchmarks/FINDINGS.md)
            out_stage = 0 if out_in_ring else buf
            out_views = []
            out_smem = epi.tRS_sD
            if cutlass.const_expr(out_in_ring):
                out_views = [self._ring_view(epi.ring, self.out_dtypes[i], self.ring_out_slots[i][s],
                                             ring_states[self.ring_out_slots[i][s][0]].index, self.out_m_major[i])
                             for i in range(n_out)]
                out_smem = [epi.thr_r2s[i].partition_D(out_views[i]) for i in range(n_out)]
            for i in cutlass.range_constexpr(n_out):
                epi.frag_out[i].store(outs[i])
                if cutlass.const_expr(i in self.masked):
                    self._store_masked(epi, i, outs[n_out + len(self.reductions) + self.masked.index(i)],
                                       coords, l_idx)
                else:
                    cute.copy(epi.r2s[i], epi.frag_out[i], out_smem[i][(None, None, None, out_stage)])
            for r in cutlass.range_constexpr(len(self.reductions)):
                epi.red_frag[r].store(outs[n_out + r])
                self.reductions[r].fold(epi.red_lanes[r], running[r], epi.red_frag[r], s, coords, origin,
                                        epi.mn_extent)
            # make the generic-proxy smem writes visible to the TMA (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            epi.barrier.arrive_and_wait()
            if epi.is_store_warp:
                for i in cutlass.range_constexpr(n_out):
                    if cutlass.const_expr(i not in self.masked):
                        s_part, g_part = (self._subtile_tma(epi.tma_d[i], out_views[i], gD[i])
                                          if out_in_ring else bSG[i])
                        if cutlass.const_expr(self.grouped_rows):
                            if whole:
                                cute.copy(epi.tma_d[i], s_part[(None, out_stage)], g_part[(None, s)])
                        else:
                            cute.copy(epi.tma_d[i], s_part[(None, out_stage)], g_part[(None, s)])
                epi.store_pipe.producer_commit()
                # every thread has read operand buffer `buf` (barrier above): refill it
                if cutlass.const_expr(n_tc > 0 and not from_ring and s + EPI_STAGES < n_sub):
                    self._load_tile_ops(epi, bSC, s + EPI_STAGES, buf)
                if cutlass.const_expr(not out_in_ring):
                    epi.store_pipe.producer_acquire()
            if cutlass.const_expr(self.grouped_rows):
                if not whole:
                    self._store_group_rows(epi, s, out_stage, m_idx, n_idx, m_end)
            # (under the stores just issued) the positions this subtile closes meet: across lanes,
            # then across warps through smem, read after the barrier below
            closes = any(r.closes(s) for r in self.reductions)
            for r in cutlass.range_constexpr(len(self.reductions)):
                self.reductions[r].publish(epi.red_lanes[r], epi.red_smem[r], running[r], s, coords, origin,
                                           epi.ctid)
            # (a subtile staged in its own ring slot waits for no earlier store to read it)
            if cutlass.const_expr(not out_in_ring or closes):
                epi.barrier.arrive_and_wait()
            for r in cutlass.range_constexpr(len(self.reductions)):
                self.reductions[r].flush(epi.red_lanes[r], epi.red_smem[r], epi.red_out[r], s, m_idx, n_idx,
                                         l_idx, epi.mn_extent, epi.ctid)
            subtile_count += 1
        if cutlass.const_expr(len(self.reductions) > 0):
            # (the consumed reductions' buffers are read before their passes' last barrier)
            # every thread is done with the reduction buffers before the other consumer's
            # epilogue (ping-pong) may write them
            epi.barrier.arrive_and_wait()
        if cutlass.const_expr(from_ring):
            # every thread has read its operands (the barriers above): the producer's tail
            # waits for these stages too
            for k in cutlass.range_constexpr(len(self.ring_stage_bytes)):
                mainloop.consumer_release(ring_states[k])
        return subtile_count

    @cute.jit
    def _store_masked(self, epi: ConsumerEpilogue, i: int, mask: cute.TensorSSA, coords: list, l_idx):
        """Store masked output ``i`` (converted, in ``epi.frag_out[i]``) from registers into its
        operand's tensor, one value at a time where ``mask`` holds and inside the M/N edges.
        A TMA store writes a whole box, so it cannot leave the rest of the operand as it was:
        these are predicated global stores (a value's neighbour in its register pair may differ
        in its mask, so none wider). The output keeps its smem buffers and TMA atom, unused: the
        register partition every output shares is built on them."""
        j = dict(self.aliased)[i]
        keep = cute.make_rmem_tensor(mask.shape, cutlass.Boolean)
        keep.store(mask)
        b = l_idx if cutlass.const_expr(self.visitor.operand_batched[j]) else 0
        for k in cutlass.range_constexpr(len(coords)):
            m, n = coords[k]
            store_if(epi.operands[j], (m, n, b), epi.frag_out[i][k],
                     keep[k] & (m < epi.mn_extent[0]) & (n < epi.mn_extent[1]))

    def _store_group_rows(self, epi: ConsumerEpilogue, s: int, stage, m_idx, n_idx, m_end) -> None:
        """A grouped GEMM's tile that runs past its group's rows: each thread stores its share of
        subtile ``s`` of every output from the staged smem buffer ``stage``, consecutive threads
        along a row, each value inside the N edge and its group's rows by a predicated store."""
        epi_m, epi_n = self.epi_tile
        sub_m = self.out_tile[0] // epi_m
        m0, n0 = m_idx + s % sub_m * epi_m, n_idx * self.out_tile[1] + s // sub_m * epi_n
        for i in range(len(self.out_dtypes)):  # plain Python: helpers are not preprocessed
            for v in range(epi_m * epi_n // self.n_epi_threads):
                e = epi.ctid + v * self.n_epi_threads
                r, c = e // epi_n, e % epi_n
                store_if(epi.outputs[i], (m0 + r, n0 + c, 0), epi.sD[i][(r, c, stage)],
                         (m0 + r < m_end) & (n0 + c < epi.mn_extent[1]))

    def _load_tile_ops(self, epi: ConsumerEpilogue, bSC, s, buf):
        """TMA-load subtile ``s`` of every TILE operand, through its (smem, gmem) partitions
        ``bSC``, into buffer ``buf``; the bytes complete mbarrier ``c_bar + buf`` (one warp)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(epi.c_bar + buf, self.tile_op_bytes)
        for j in range(len(bSC)):  # plain Python: helpers are not preprocessed
            s_part, g_part = bSC[j]
            cute.copy(epi.tma_c[j], g_part[(None, s)], s_part[(None, buf)], tma_bar_ptr=epi.c_bar + buf)

    @cute.jit
    def _load_ring(self, mainloop, state, ring: tuple, tma_c: tuple, mC: tuple, u: Unit):
        """The producer's loads of the CTA's last tile ``u``'s TILE operands, past its last
        k-tile (``state``): each ring stage that holds some of their subtiles, once every
        consumer has released it, expects those subtiles' bytes. Returns the advanced state
        (the caller rebinds it, so the tracer carries it out of the enclosing branch)."""
        gC = self._local_tiles(mC)
        tiles = [self._tile_op_tile(gC, t, u.m, u.n, u.l) for t in range(len(self.tile_ops))]
        for stage in cutlass.range_constexpr(len(self.ring_stage_bytes)):
            mainloop.sync_object_empty.wait(state.index, state.phase)
            mainloop.sync_object_full.arrive_and_expect_tx(state.index, self.ring_stage_bytes[stage])
            bar = mainloop.producer_get_barrier(state)
            for t in cutlass.range_constexpr(len(self.tile_ops)):
                tile = tiles[t]
                for s in cutlass.range_constexpr(self.n_sub):
                    if cutlass.const_expr(self.ring_slots[t][s][0] == stage):
                        view = self._ring_view(ring, self.tile_op_dtypes[t], self.ring_slots[t][s], state.index)
                        s_part, g_part = self._subtile_tma(tma_c[t], view, tile)
                        cute.copy(tma_c[t], g_part[(None, s)], s_part[(None, 0)], tma_bar_ptr=bar)
            state.advance()
        return state

    @cute.jit
    def _full_barriers(self, smem: SmemAllocator, count: int, warp_idx):
        """``count`` mbarriers that one TMA transaction count each completes, initialized by
        warp 0."""
        bars = smem.allocate_array(cutlass.Int64, count, byte_alignment=8)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for b in cutlass.range_constexpr(count):
                    cute.arch.mbarrier_init(bars + b, 1)
        cute.arch.mbarrier_init_fence()
        return bars

    def _ring_view(self, ring: tuple, dtype, slot: tuple, stage_index, m_major: bool = False) -> cute.Tensor:
        """A single-stage epilogue smem tensor of ``dtype`` at ``slot`` (stage, part, byte
        offset) of the (sA, sB) ``ring``, its stage at ring index ``stage_index`` (M-major for an
        output stored transposed)."""
        _, part, offset = slot
        layout = self._epi_smem_layout(dtype, 1, m_major)
        ab = (self.ab_dtype, self.b_dtype)[part].width // 8
        # a stage spans whole SMEM_ALIGN blocks: say so, or the pointer loses its alignment
        stage_offset = cute.assume(stage_index * (self.tile_mnk[part] * self.tile_mnk[2]), divby=SMEM_ALIGN // ab)
        ptr = ring[part].iterator + stage_offset + offset // ab
        return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)
