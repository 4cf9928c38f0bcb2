"""Epilogue reductions in the kernel: a tile's sum, max or min over M, N or both.

Shared by every architecture's kernel (the epilogue driver calls it per subtile). Each output
that reduces (``Output.reduce``) leaves one partial per tile in global memory, fp32: over M a
row of N per tile row ((tiles_m, N, L)), over N a column of M per tile column ((M, tiles_n,
L)), over both one value per tile ((tiles_m, tiles_n, L)); XLA reduces those (``ffi``). Every
partial is written by the one CTA that runs its tile's epilogue (stream-K pieces meet before
it), in a fixed order: the result is the same bit for bit on every run, with no atomics and no
zeroed workspace. An output marked ``atomic`` has no partials: that CTA folds its tile's value
straight into the result ((1 | M, N | 1, L), fp32, which starts at the reduction's identity) by
a global atomic, the tiles in whatever order they finish: a sum's rounding depends on it, a max
or min does not.

Within a tile, per subtile: every thread writes its values to a staging subtile in shared
memory (fp32, rows padded by one value so that a warp reading a row's lanes hits 32 banks);
then thread t takes lane ``t % lanes`` (a column for a reduction over M, a row over N) and
reduces every ``groups``-th position along it, masking what lies past the M and N edges; the
``groups`` partials of a lane meet through a second buffer, in order; each thread keeps its
lane's running value in a register (over N one per row of subtiles: the subtiles are walked
down M first) and writes it to global memory after the last subtile that adds to it. Over
both axes, the lanes' values meet once more through a third buffer. Max and min propagate
NaN (a NaN anywhere gives NaN).

A subtile may span ``blocks`` column blocks of the tile (Blackwell's 2-CTA 128-row MMA: see
``sm100.py``): its columns are ``blocks`` runs of ``epi_n / blocks``, ``tile_n / blocks``
apart, and the subtiles along N step a run's width; the staging subtile holds the runs side by
side.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from jax_efc.kernels.problem import REDUCTION_IDENTITY, reduction_lanes

__all__ = ["TileReduction"]

_UNROLL = 4  # loads in flight per lane loop
# the bits of the NaN a max (positive: above every other value's as a signed integer) and a min
# (negative: above every other negative value's as an unsigned one) fold in by atomics, and the
# integer atomics that fold values of each sign in
_NAN_BITS = {"max": 0x7FC00000, "min": -0x00400000}
_SIGNED_OPS = {"max": ("umin", "max"), "min": ("umax", "min")}  # (sign bit set, clear)


class TileReduction:
    """One reducing output's trace-time geometry and its per-subtile steps."""

    def __init__(self, kind: str, over: tuple[str, ...], epi_tile: tuple[int, int],
                 tile_mn: tuple[int, int], threads: int, blocks: int = 1, atomic: bool = False):
        self.kind, self.over = kind, tuple(over)
        self.atomic = atomic
        self.epi_m, self.epi_n = epi_tile
        self.blocks = blocks
        self.run = self.epi_n // blocks  # columns of one block; the step between subtiles along N
        self.sub_m = tile_mn[0] // self.epi_m
        self.tile_mn = tile_mn
        self.lanes, self.length = reduction_lanes(self.over, epi_tile)
        self.groups = threads // self.lanes
        self.threads = threads
        self.n_sub = self.sub_m * (tile_mn[1] // self.epi_n)
        self.slots = self.sub_m if self.over == ("n",) else 1  # running values a thread keeps

    def spread(self, c):
        """The column, from the subtile's first, of its column ``c`` (Python or device integers)."""
        if self.blocks == 1:
            return c
        return c + c // self.run * (self.tile_mn[1] // self.blocks - self.run)

    def gather(self, n):
        """The subtile column of the column ``n`` past the subtile's first (``spread``'s inverse)."""
        if self.blocks == 1:
            return n
        return n - n // (self.tile_mn[1] // self.blocks) * (self.tile_mn[1] // self.blocks - self.run)

    def position(self, lane, group, i) -> tuple:
        """(row, column) in the staging subtile of the ``i``-th value the thread of ``lane`` and
        ``group`` reduces (Python or device integers)."""
        along = group + i * self.groups
        return (along, lane) if "m" in self.over else (lane, along)

    def slot(self, s: int) -> int:
        """The running value subtile ``s`` folds into: over M one (the subtiles of a column of
        them come one after another), over N one per row of subtiles, over both one."""
        return s % self.sub_m if self.over == ("n",) else 0

    def closes(self, s: int) -> bool:
        """Whether subtile ``s`` is the last to fold into its running value, which then goes
        to global memory."""
        if self.over == ("m",):
            return s % self.sub_m == self.sub_m - 1
        return s >= self.n_sub - (self.sub_m if self.over == ("n",) else 1)

    def offset(self, s: int, lane):
        """The column (over M) or row (over N) within the tile of ``lane``'s value of subtile ``s``."""
        if self.over == ("m",):
            return s // self.sub_m * self.run + self.spread(lane)
        return s % self.sub_m * self.epi_m + lane

    def layouts(self) -> tuple:
        """Layouts of the staging subtile, the group partials and the lane totals."""
        stage = cute.make_layout((self.epi_m, self.epi_n), stride=(self.epi_n + 1, 1))
        return stage, cute.make_layout(self.threads), cute.make_layout(self.lanes)

    def identity(self):
        return cutlass.Float32(REDUCTION_IDENTITY[self.kind])

    def combine(self, a, b):
        """``a`` and ``b`` combined; max and min keep a NaN of either."""
        if self.kind == "sum":
            return a + b
        wins = b > a if self.kind == "max" else b < a
        return cutlass.select_(wins | (b != b), b, a)

    def start(self) -> cute.Tensor:
        """A thread's running values for a new tile."""
        running = cute.make_rmem_tensor((self.slots,), cutlass.Float32)
        for i in range(self.slots):
            running[i] = self.identity()
        return running

    @cute.jit
    def stage(self, smem: tuple, values: cute.Tensor, tile_coords: cute.Tensor, indices: list, s: int):
        """Write this thread's ``values`` of subtile ``s`` into the staging subtile: value ``v``
        lies at ``tile_coords[indices[v]]`` within the tile (a per-thread base plus a constant,
        so each store's address folds to one immediate offset)."""
        stage = smem[0]
        m0 = s % self.sub_m * self.epi_m
        n0 = s // self.sub_m * self.run
        for v in cutlass.range_constexpr(len(indices)):
            at = tile_coords[indices[v]]
            stage[(at[0] - m0, self.gather(at[1] - n0))] = values[v]

    @cute.jit
    def reduce(self, smem: tuple, running: cute.Tensor, s: int, origin: tuple, extent: tuple, ctid,
               barrier):
        """Fold staged subtile ``s`` into the running values; the staging subtile was written
        by every thread before ``barrier`` was passed. Returns when the buffers may be
        written again."""
        stage, partial, totals = smem
        lane, group = ctid % self.lanes, ctid // self.lanes
        m0 = origin[0] + s % self.sub_m * self.epi_m
        n0 = origin[1] + s // self.sub_m * self.run
        part = self.identity()
        # a loop the compiler keeps (a few loads in flight), not unrolled: unrolled, all of a
        # lane's loads are hoisted and spill next to the accumulators
        for i in cutlass.range(self.length // self.groups, unroll=_UNROLL):
            r, c = self.position(lane, group, i)
            inside = (m0 + r < extent[0]) & (n0 + self.spread(c) < extent[1])
            part = self.combine(part, cutlass.select_(inside, stage[(r, c)], self.identity()))
        partial[ctid] = part
        barrier.arrive_and_wait()
        total = self.identity()
        for g in cutlass.range_constexpr(self.groups):
            total = self.combine(total, partial[g * self.lanes + lane])
        if cutlass.const_expr(len(self.over) == 2):
            if group == 0:
                totals[lane] = total
            barrier.arrive_and_wait()
            total = self.identity()
            for c in cutlass.range(self.lanes, unroll=_UNROLL):
                total = self.combine(total, totals[c])
            running[0] = self.combine(running[0], total)
        else:
            running[self.slot(s)] = self.combine(running[self.slot(s)], total)

    def target(self, s: int, lane, group, m_idx, n_idx, extent: tuple) -> tuple:
        """((row, column) in the partials, or in the result where the output is ``atomic``,
        whether to write) for the running value the thread of ``lane`` and ``group`` closes after
        subtile ``s`` of tile (m_idx, n_idx) (Python or device integers). One thread a lane
        writes, only inside the M and N edges; a tile that lies wholly past an edge (a cluster's
        padding: a grid of 2-CTA clusters covers an odd tile count with one tile more) writes
        nothing, since its partial has no place (and would add its identity to a result)."""
        inside = (m_idx * self.tile_mn[0] < extent[0]) & (n_idx * self.tile_mn[1] < extent[1])
        first = group == 0
        row, col = (0, 0) if self.atomic else (m_idx, n_idx)  # the reduced axes' index
        if len(self.over) == 2:
            return (row, col), inside & first & (lane == 0)
        if self.over == ("m",):
            n = n_idx * self.tile_mn[1] + self.offset(s, lane)
            return (row, n), inside & first & (n < extent[1])
        m = m_idx * self.tile_mn[0] + self.offset(s, lane)
        return (m, col), inside & first & (m < extent[0])

    @cute.jit
    def flush(self, out: cute.Tensor, running: cute.Tensor, s: int, m_idx, n_idx, l_idx, extent: tuple, ctid):
        """After subtile ``s``: if it closed its running value, write that to ``out`` ((tiles_m
        | M, N | tiles_n, L), fp32) where :meth:`target` says, or fold it into ``out`` ((1 | M,
        N | 1, L)) there where the output is ``atomic``, and start it again."""
        if cutlass.const_expr(self.closes(s)):
            slot = self.slot(s)
            (row, col), writes = self.target(s, ctid % self.lanes, ctid // self.lanes, m_idx, n_idx, extent)
            if writes:
                if cutlass.const_expr(self.atomic):
                    self.fold(out, (row, col, l_idx), running[slot])
                else:
                    out[(row, col, l_idx)] = running[slot]
            running[slot] = self.identity()

    @cute.jit
    def fold(self, out: cute.Tensor, coord: tuple, value):
        """``out[coord] = combine(out[coord], value)`` by one global atomic: a sum by a float
        reduction; a max or min by an integer one on the value's bits, which order as the floats
        do as signed integers where the sign bit is clear and the other way round as unsigned
        ones where it is set. A NaN folds in as the one that wins (``_NAN_BITS``), so it
        propagates as :meth:`combine` makes it."""
        at = out.iterator + cute.crd2idx(coord, out.layout)
        if cutlass.const_expr(self.kind == "sum"):
            cute.arch.red(at, value, op="add", dtype=cutlass.Float32, sem="relaxed", scope="gpu")
        else:
            negative, positive = _SIGNED_OPS[self.kind]
            bits = cutlass.select_(value != value, cutlass.Int32(_NAN_BITS[self.kind]),
                                   cutlass.Int32(llvm.bitcast(T.i32(), value.ir_value())))
            if bits < 0:
                cute.arch.red(at, bits, op=negative, dtype=cutlass.Uint32, sem="relaxed", scope="gpu")
            else:
                cute.arch.red(at, bits, op=positive, dtype=cutlass.Int32, sem="relaxed", scope="gpu")
