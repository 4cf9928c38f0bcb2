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

Within a tile, registers first. Call the coordinate a reduction keeps (the column over M, the
row over N, none over both) its position. Each thread folds every value it holds into one
running register per position it holds (masking what lies past the M and N edges): a
subtile's values cost one add each, with no shared memory and no barrier. When the last
subtile that adds to a set of positions is done (over M the last of a column of subtiles, over
N each subtile of the last column, over both the last), the threads that hold the same
positions meet: first the lanes of a warp, by butterfly shuffles, then the warps, through a
small shared buffer of one partial per (position, warp holding it) which one thread per
position reads in a fixed order after the epilogue's barrier. Which lanes and warps hold the
same positions is read off the accumulator's thread/value layout at trace time
(:func:`lane_map`), so each architecture's layout (Hopper's WGMMA fragments, Blackwell's
tensor-memory loads) gets its own pattern. Max and min propagate NaN (a NaN anywhere gives NaN).
A reduction the epilogue consumes (``row_stats.py``) meets the same way and is read back into
every holding thread's registers (:meth:`TileReduction.collect`) instead of leaving the tile.

A subtile may span ``blocks`` column blocks of the tile (Blackwell's 2-CTA 128-row MMA: see
``sm100.py``): its columns are ``blocks`` runs of ``epi_n / blocks``, ``tile_n / blocks``
apart, and the subtiles along N step a run's width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from jax_efc.kernels.problem import REDUCTION_IDENTITY, WARP, reduction_positions

__all__ = ["TileReduction", "LaneMap", "lane_map"]

# the bits of the NaN a max (positive: above every other value's as a signed integer) and a min
# (negative: above every other negative value's as an unsigned one) fold in by atomics, and the
# integer atomics that fold values of each sign in
_NAN_BITS = {"max": 0x7FC00000, "min": -0x00400000}
_SIGNED_OPS = {"max": ("umin", "max"), "min": ("umax", "min")}  # (sign bit set, clear)
_LANE_BITS = WARP.bit_length() - 1  # bits of a thread index that pick its lane
# threads (mod the epilogue's) whose values lane_map checks lie at the sum of their bits'
# offsets: a few of several bits each, since tracing a thread's partition takes a tenth of a
# second (the tests check every thread of the real layouts: test_reductions.reduce_as_the_kernel)
_CHECKED = (3, 5, 6, 9, 10, 12, 0x55, 0xAA, 0xFF, -1)

Points = Callable[[int], Sequence[Sequence[tuple[int, int]]]]


@dataclasses.dataclass(frozen=True)
class LaneMap:
    """Where a reduction's values meet, for one thread/value layout (trace-time integers).

    ``slot[s][v]``: the running register value ``v`` of subtile ``s`` folds into (one per
    position the thread holds); ``offset[s][v]``: its (m, n) past the subtile's first value of
    the same thread. ``closing[s]``: the (register, value) pairs subtile ``s``
    closes, each register with a value of the subtile that lies at its position. ``shuffle``:
    the lane offsets whose partners hold the same positions. ``holders``: the bits of a
    thread's index that pick, among the warps that hold a position, which one it is."""

    slot: tuple[tuple[int, ...], ...]
    offset: tuple[tuple[tuple[int, int], ...], ...]
    slots: int
    closing: tuple[tuple[tuple[int, int], ...], ...]
    shuffle: tuple[int, ...]
    holders: tuple[int, ...]


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
        self.positions = reduction_positions(self.over, epi_tile)
        self.threads = threads
        self.warps = threads // WARP
        self.n_sub = self.sub_m * (tile_mn[1] // self.epi_n)

    def gather(self, n):
        """The subtile column of the column ``n`` past the subtile's first (Python or device
        integers): past a block's run, the next block's columns."""
        if self.blocks == 1:
            return n
        return n - n // (self.tile_mn[1] // self.blocks) * (self.tile_mn[1] // self.blocks - self.run)

    def spread(self, c):
        """The column, from the subtile's first, of its column ``c`` (``gather``'s inverse)."""
        if self.blocks == 1:
            return c
        return c + c // self.run * (self.tile_mn[1] // self.blocks - self.run)

    def closes(self, s: int) -> bool:
        """Whether subtile ``s`` is the last to add to some positions, which then meet and go to
        global memory."""
        if self.over == ("m",):
            return s % self.sub_m == self.sub_m - 1
        return s >= self.n_sub - (self.sub_m if self.over == ("n",) else 1)

    def position(self, s: int, point):
        """The position in subtile ``s``'s set of the tile point (m, n) (Python or device
        integers): its column from the subtile's first over M, its row over N, 0 over both."""
        if self.over == ("m",):
            return self.gather(point[1] - s // self.sub_m * self.run)
        if self.over == ("n",):
            return point[0] - s % self.sub_m * self.epi_m
        return 0

    def _band(self, s: int):
        """The subtiles whose values share subtile ``s``'s positions: its column of subtiles over
        M, its row over N, all over both."""
        if self.over == ("m",):
            return s // self.sub_m
        if self.over == ("n",):
            return s % self.sub_m
        return 0

    def lane_map(self, points: Points) -> LaneMap:
        """See :func:`lane_map`."""
        return lane_map(self, points)

    def layout(self) -> cute.Layout:
        """The shared buffer where warps meet: one fp32 partial per (position, holding warp)."""
        return cute.make_layout((self.positions, self.warps), stride=(1, self.positions))

    def identity(self):
        return cutlass.Float32(REDUCTION_IDENTITY[self.kind])

    def combine(self, a, b):
        """``a`` and ``b`` combined; max and min keep a NaN of either."""
        if self.kind == "sum":
            return a + b
        wins = b > a if self.kind == "max" else b < a
        return cutlass.select_(wins | (b != b), b, a)

    def start(self, lanes: LaneMap) -> cute.Tensor:
        """A thread's running values for a new tile."""
        running = cute.make_rmem_tensor((lanes.slots,), cutlass.Float32)
        for i in range(lanes.slots):
            running[i] = self.identity()
        return running

    @cute.jit
    def fold(self, lanes: LaneMap, running: cute.Tensor, values: cute.Tensor, s: int, coords: list,
             origin: tuple, extent: tuple):
        """Fold this thread's ``values`` of subtile ``s`` (at global ``coords``) into its running
        registers. In a subtile that crosses an edge along a reduced axis, the values past it
        fold as the identity (past an edge along the kept axis a position is never written);
        the test is made once a subtile, which keeps the per-value masks (and the registers
        they hold) off the subtiles inside."""
        last = (origin[0] + (s % self.sub_m + 1) * self.epi_m,
                origin[1] + s // self.sub_m * self.run + self.spread(self.epi_n - 1) + 1)
        inside = True
        for axis in cutlass.range_constexpr(2):
            if cutlass.const_expr("mn"[axis] in self.over):
                inside = inside & (last[axis] <= extent[axis])
        if inside:
            for v in cutlass.range_constexpr(len(lanes.slot[s])):
                j = lanes.slot[s][v]
                running[j] = self.combine(running[j], values[v])
        else:
            # value v lies lanes.offset[s][v] past the thread's first: one room left per axis,
            # then each value's test is against a constant, and guards its fold (a predicated
            # add, where a select held every value's mask at once and spilled on Blackwell)
            room = [extent[axis] - coords[0][axis] for axis in range(2)]
            for v in cutlass.range_constexpr(len(lanes.slot[s])):
                j = lanes.slot[s][v]
                keep = True
                for axis in cutlass.range_constexpr(2):
                    if cutlass.const_expr("mn"[axis] in self.over):
                        keep = keep & (lanes.offset[s][v][axis] < room[axis])
                if keep:
                    running[j] = self.combine(running[j], values[v])

    @cute.jit
    def publish(self, lanes: LaneMap, buf: cute.Tensor, running: cute.Tensor, s: int, coords: list,
                origin: tuple, ctid):
        """If subtile ``s`` closes positions: combine each across the lanes that hold it, and
        have one lane per warp write it to ``buf`` (read by :meth:`flush` after a barrier)."""
        if cutlass.const_expr(self.closes(s)):
            holder = 0
            for i in cutlass.range_constexpr(len(lanes.holders)):
                holder = holder + ((ctid >> lanes.holders[i]) & 1) * (1 << i)
            for c in cutlass.range_constexpr(len(lanes.closing[s])):
                j, v = lanes.closing[s][c]
                total = running[j]
                for i in cutlass.range_constexpr(len(lanes.shuffle)):
                    total = self.combine(total, cute.arch.shuffle_sync_bfly(total, offset=lanes.shuffle[i]))
                if (ctid & sum(lanes.shuffle)) == 0:
                    at = self.position(s, (coords[v][0] - origin[0], coords[v][1] - origin[1]))
                    buf[(at, holder)] = total
                running[j] = self.identity()

    @cute.jit
    def collect(self, lanes: LaneMap, buf: cute.Tensor, totals: cute.Tensor, s: int, coords: list, origin: tuple):
        """After :meth:`publish` and a barrier: this thread's totals of the positions subtile
        ``s`` closes, each combined over the warps that hold it in :meth:`flush`'s order, into
        its registers ``totals`` (a reduction the program consumes)."""
        if cutlass.const_expr(self.closes(s)):
            for c in cutlass.range_constexpr(len(lanes.closing[s])):
                j, v = lanes.closing[s][c]
                at = self.position(s, (coords[v][0] - origin[0], coords[v][1] - origin[1]))
                total = buf[(at, 0)]
                for h in cutlass.range_constexpr(1, 1 << len(lanes.holders)):
                    total = self.combine(total, buf[(at, h)])
                totals[j] = total

    def target(self, s: int, position, m_idx, n_idx, extent: tuple) -> tuple:
        """((row, column) in the partials, or in the result where the output is ``atomic``,
        whether to write) for ``position`` of subtile ``s`` in tile (m_idx, n_idx) (Python or
        device integers). Only inside the M and N edges; a tile that lies wholly past an edge
        (a cluster's padding: a grid of 2-CTA clusters covers an odd tile count with one tile
        more) writes nothing, since its partial has no place (and would add its identity to a
        result)."""
        inside = (m_idx * self.tile_mn[0] < extent[0]) & (n_idx * self.tile_mn[1] < extent[1])
        row, col = (0, 0) if self.atomic else (m_idx, n_idx)  # the reduced axes' index
        if len(self.over) == 2:
            return (row, col), inside
        if self.over == ("m",):
            n = n_idx * self.tile_mn[1] + s // self.sub_m * self.run + self.spread(position)
            return (row, n), inside & (n < extent[1])
        m = m_idx * self.tile_mn[0] + s % self.sub_m * self.epi_m + position
        return (m, col), inside & (m < extent[0])

    @cute.jit
    def flush(self, lanes: LaneMap, buf: cute.Tensor, out: cute.Tensor, s: int, m_idx, n_idx, l_idx,
              extent: tuple, ctid):
        """After :meth:`publish` and a barrier: thread ``p`` combines position ``p``'s partials,
        one per warp holding it, in order, and writes the total to ``out`` ((tiles_m | M, N |
        tiles_n, L)) where :meth:`target` says, or folds it into ``out`` ((1 | M, N | 1, L))
        there where the output is ``atomic``."""
        if cutlass.const_expr(self.closes(s)):
            for base in cutlass.range_constexpr(0, self.positions, self.threads):
                p = base + ctid
                if p < self.positions:
                    total = buf[(p, 0)]
                    for h in cutlass.range_constexpr(1, 1 << len(lanes.holders)):
                        total = self.combine(total, buf[(p, h)])
                    (row, col), writes = self.target(s, p, m_idx, n_idx, extent)
                    if writes:
                        if cutlass.const_expr(self.atomic):
                            self.fold_global(out, (row, col, l_idx), total)
                        else:
                            out[(row, col, l_idx)] = total

    @cute.jit
    def fold_global(self, out: cute.Tensor, coord: tuple, value):
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


def lane_map(red: TileReduction, points: Points) -> LaneMap:
    """Read ``red``'s meeting pattern off a thread/value layout: ``points(t)`` gives, for
    epilogue thread ``t``, the (m, n) within the tile of each of its values of each subtile.

    The layouts the kernels use place a thread's values at its own offset plus a per-value
    constant, the offset adding up over the bits of the thread's index; so the bits whose
    offset does not move a value's position join threads that hold the same positions: within
    a warp they are shuffle partners, across warps holders of one partial each. Checked here on
    threads of several bits (``_CHECKED``), so a layout of another form fails at compile time
    rather than reducing wrongly."""
    keep = {("m",): 1, ("n",): 0}.get(red.over)
    base = points(0)
    n_sub = len(base)
    if n_sub != red.n_sub:
        raise RuntimeError(f"the layout has {n_sub} subtiles where the reduction walks {red.n_sub}")
    bits = red.threads.bit_length() - 1
    if red.threads != 1 << bits:
        raise RuntimeError(f"{red.threads} epilogue threads: a reduction needs a power of two")
    step = []  # per bit of the thread index: the (dm, dn) it moves every value by
    for b in range(bits):
        moved = {(p[0] - q[0], p[1] - q[1]) for sub, sub0 in zip(points(1 << b), base) for p, q in zip(sub, sub0)}
        if len(moved) != 1:
            raise RuntimeError(f"thread bit {b} moves a thread's values by different offsets {sorted(moved)}")
        step.append(moved.pop())

    def kept(point):
        return 0 if keep is None else point[keep]

    def at(t, s, v):  # thread t's value v of subtile s, by the bits' offsets
        dm = sum(step[b][0] for b in range(bits) if t >> b & 1)
        dn = sum(step[b][1] for b in range(bits) if t >> b & 1)
        return base[s][v][0] + dm, base[s][v][1] + dn

    for t in sorted({t % red.threads for t in _CHECKED}):
        if [list(map(tuple, sub)) for sub in points(t)] != [[at(t, s, v) for v in range(len(base[s]))]
                                                           for s in range(n_sub)]:
            raise RuntimeError(f"thread {t}'s values do not lie at the sum of its bits' offsets")
    still = [b for b in range(bits) if kept(step[b]) == 0]  # bits that move no value's position
    shuffle = tuple(1 << b for b in still if b < _LANE_BITS)
    holders = tuple(b for b in still if b >= _LANE_BITS)
    # one running register per position a thread holds in a band of subtiles
    keys = {}
    for s in range(n_sub):
        band = keys.setdefault(red._band(s), {})
        for v in range(len(base[s])):
            band.setdefault(red.position(s, base[s][v]), len(band))
    counts = {len(band) for band in keys.values()}
    slots = max(counts) * (red.sub_m if red.over == ("n",) else 1)
    slot = tuple(tuple(keys[red._band(s)][red.position(s, base[s][v])]
                       + (red._band(s) * max(counts) if red.over == ("n",) else 0)
                       for v in range(len(base[s]))) for s in range(n_sub))
    closing = []
    for s in range(n_sub):
        first = {}
        if red.closes(s):
            for v in range(len(base[s])):
                first.setdefault(slot[s][v], v)
            if len(first) != len(keys[red._band(s)]):
                raise RuntimeError(f"subtile {s} holds {len(first)} of its band's {len(keys[red._band(s)])} positions")
            # every position of the subtile once per holding warp: (thread, register) -> position
            seen = {}
            for t in range(red.threads):
                if any(t >> b & 1 for b in still):
                    continue
                for j, v in first.items():
                    seen.setdefault(red.position(s, at(t, s, v)), []).append((t, j))
            if sorted(seen) != list(range(red.positions)) or {len(w) for w in seen.values()} != {1}:
                raise RuntimeError(f"subtile {s}: the threads that write partials do not hold each of the "
                                   f"{red.positions} positions once")
        closing.append(tuple(first.items()))
    offset = tuple(tuple((p[0] - sub[0][0], p[1] - sub[0][1]) for p in sub) for sub in base)
    return LaneMap(slot, offset, slots, tuple(closing), shuffle, holders)
