"""The persistent tile schedule: which output tiles, and which k-range of each, every cluster
of the persistent grid computes, and in what order. Shared by every architecture; planned
without cutlass (the walk's arithmetic imports it only when it traces device integers).

Cluster tiles (the ``cluster_m x cluster_n`` CTA tiles one cluster computes together) are
numbered along a raster. With raster ``"m"`` the walk goes down M inside a band of
``swizzle`` cluster columns, visiting the band's columns in turn before the next row, so the
clusters at work at one time share A rows and B columns in L2; ``"n"`` swaps M and N.
Cluster ``c`` of ``P`` takes tiles ``c, c + P, c + 2P, ...``.

Stream-K. When the tile count is just past a multiple of ``P``, the last round of whole
tiles leaves most clusters idle (8192^3 in 128x256 cluster tiles: 31 rounds and 2 tiles).
Then the last two rounds' worth of tiles are not handed out whole: their k-iterations are
split evenly, in one run per cluster, over all ``P`` clusters. A problem with at most half as
many tiles as clusters is split whole the same way. A run covers the tail of one
tile, perhaps whole tiles, and the head of another. A piece that does not start at k = 0
(a cluster's first) writes its fp32 partial sums to the cluster's workspace slot and raises
the slot's flag; a piece that starts at k = 0 but stops short of the end (a cluster's last)
waits for the flags of the clusters that hold the rest of its tile, adds their partials and
runs the epilogue. Every cluster writes its partial before it waits on anyone, and the whole
grid fits the GPU at once (it is sized by the device's occupancy), so every wait ends; if
another kernel holds some SMs, the waits last until it releases them.

:class:`TileWalk` is the arithmetic of both, in plain integer operations that trace into the
kernel and also run on Python ints, which is how the tests check it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax_efc.config import GemmConfig
from jax_efc.kernels.problem import cta_tile

__all__ = ["StreamK", "TileSchedule", "TileWalk", "Unit", "cluster_tiles", "plan_schedule"]

# Stream-K pays when the last round of whole tiles would leave at least this fraction of the
# clusters idle. Measured on H200 (bf16, 128x128 ping-pong tiles in 1x2 clusters, one run,
# time against whole tiles only): idle 97% (8192^3, 16384x4096x14336) and 85%
# (4096x14336x4096) ran 2-5% faster; idle 70% (8192x14336x4096) the same; idle 48%
# (8192x4096x14336) 2% slower. The clusters' runs then start at scattered k offsets, so
# clusters that share an A row or a B column no longer meet in L2 at the same k-tile.
_STREAM_K_MIN_IDLE = 0.8
# Fewer tiles than clusters: all their k-iterations are shared by all clusters when the tiles
# would keep at most this share of the clusters busy and each cluster gets at least
# _SPLIT_ALL_MIN_K_TILES k-tiles. Measured on H200 (bf16, 128x128 tiles, 16 calls inside one
# jit, ms, split against whole tiles), plain GEMMs: 0.026 / 0.043 at 1024x512x8192 (32 tiles on
# 132 SMs), 0.060 / 0.077 at 768x1024x14336 (48), 0.039 / 0.048 at 1024x1024x8192 (64), 0.024
# / 0.024 at 512x2048x4096 (64), but 0.030 / 0.027 at 1024x1536x4096 (96); bias+gelu_tanh:
# 0.046 / 0.079 at 128x4096x14336 (32), 0.022 / 0.025 at 128x4096x4096 (32), but 0.043 /
# 0.036 at 128x14336x4096 (112).
# (The heuristic hands such GEMMs to XLA, which runs them faster still: a pinned config or
# JAX_EFC_STRICT=1 runs them here.)
_SPLIT_ALL_MAX_FILL = 0.5
_SPLIT_ALL_MIN_K_TILES = 8
# A partial's round trip through L2 (write 4 bytes per output, read them back) costs about
# what loading a few k-tiles of A and B does: below this many k-tiles per tile it does not pay
_STREAM_K_MIN_K_TILES = 16
# the schedule's integer arithmetic runs in int32 on the device
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class StreamK:
    """The stream-K part of a schedule: after ``whole_rounds`` rounds of whole tiles, the
    next ``split_tiles`` cluster tiles' ``split_tiles * k_tiles`` k-iterations are shared
    evenly by all clusters."""

    whole_rounds: int
    split_tiles: int
    k_tiles: int

    @property
    def iters(self) -> int:
        return self.split_tiles * self.k_tiles


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Compile-time description of a kernel's persistent schedule."""

    clusters: int  # the persistent grid, in clusters (the device's occupancy)
    cluster_mn: tuple[int, int]
    raster_along_m: bool
    swizzle: int
    stream_k: StreamK | None = None

    @property
    def slots(self) -> int:
        """Workspace slots (one fp32 tile and one flag each) stream-K needs: one per CTA."""
        return self.clusters * self.cluster_mn[0] * self.cluster_mn[1] if self.stream_k else 0


def cluster_tiles(m, n, l, tile_mn: tuple[int, int], cluster_mn: tuple[int, int]) -> tuple:
    """Cluster tiles along M, N and L of an M x N x L output (Python or device integers)."""
    return tuple((x + t * c - 1) // (t * c) for x, t, c in zip((m, n), tile_mn, cluster_mn)) + (l,)


def plan_schedule(config: GemmConfig, m: int, n: int, k: int, l: int, clusters: int, tile_k: int) -> TileSchedule:
    """The schedule of an M x N x K x L GEMM run with ``config`` on a grid of ``clusters``, in
    k-tiles ``tile_k`` deep (:func:`jax_efc.kernels.problem.tile_k`: the kernel's own)."""
    cm, cn = config.cluster_m, config.cluster_n
    base = TileSchedule(clusters, (cm, cn), config.raster == "m", config.swizzle)
    mc, nc, _ = cluster_tiles(m, n, l, cta_tile(config), (cm, cn))
    tiles = mc * nc * l
    k_tiles = -(-k // tile_k)
    rounds, last = divmod(tiles, clusters)
    if rounds == 0:  # one partial round: split all of it, if each cluster gets enough k-tiles
        whole, split = 0, last
        worth_it = (last <= _SPLIT_ALL_MAX_FILL * clusters
                    and last * k_tiles >= _SPLIT_ALL_MIN_K_TILES * clusters)
    else:
        whole, split = rounds - 1, last + clusters
        worth_it = 0 < last <= (1 - _STREAM_K_MIN_IDLE) * clusters and k_tiles >= _STREAM_K_MIN_K_TILES
    if not (config.stream_k and worth_it) or 2 * split * k_tiles * clusters > _INT32_MAX:
        return base
    return dataclasses.replace(base, stream_k=StreamK(whole, split, k_tiles))


class Unit(NamedTuple):
    """One unit of a cluster's work: CTA tile (m, n, l) over k-tiles [k_begin, k_begin + k_count).

    A stream-K piece with ``k_begin > 0`` contributes a partial; one with ``k_begin == 0``
    and ``k_count`` short of the tile's k-tiles collects the partials of the clusters
    ``first_helper .. last_helper`` (an empty range otherwise). A grouped walk's units
    (:class:`~jax_efc.kernels.grouped_walk.GroupedWalk`) give the tile's first row as ``m``
    and its group's end as ``m_end``; those of a walk over groups of the contraction
    (:class:`~jax_efc.kernels.grouped_walk.ContractionWalk`) give the group's rows of A and B as
    [``k_start``, ``k_end``)."""

    m: Any
    n: Any
    l: Any
    k_begin: Any
    k_count: Any
    first_helper: Any
    last_helper: Any
    m_end: Any = None
    k_start: Any = None
    k_end: Any = None

    def subtiles(self, per_tile: int):
        """Epilogue subtiles this unit runs: ``per_tile``, or none for a contributing piece."""
        return _select(self.k_begin == 0, per_tile, 0)


def _is_static(*values) -> bool:
    return all(isinstance(v, (int, bool)) for v in values)


def _min(a, b):
    if _is_static(a, b):
        return min(a, b)
    import cutlass  # device integers: only inside a kernel being traced

    return cutlass.min(a, b)


def _select(cond, a, b):
    if _is_static(cond):
        return a if cond else b
    import cutlass

    return cutlass.Int32(cutlass.select_(cond, a, b))


class TileWalk:
    """One CTA's view of a :class:`TileSchedule`: ``count()`` units, unit ``j`` by ``unit(j)``.

    ``tiles_mnl``: cluster tiles along M, N and L; ``cluster``: this CTA's cluster index;
    ``cta_mn``: its coordinate in the cluster; ``clusters``: the grid's cluster count (only
    read without stream-K, where a small problem may launch fewer than the schedule's);
    ``k_tiles``: k-tiles per output tile."""

    def __init__(self, schedule: TileSchedule, tiles_mnl, cluster, cta_mn, clusters, k_tiles):
        self.s = schedule
        self.mc, self.nc, self.lc = tiles_mnl
        self.cluster = cluster
        self.cta_mn = cta_mn
        self.clusters = schedule.clusters if schedule.stream_k else clusters
        self.k_tiles = schedule.stream_k.k_tiles if schedule.stream_k else k_tiles

    # ---- stream-K runs: cluster c covers split iterations [lo(c), lo(c + 1))
    def _lo(self, c):
        return c * self.s.stream_k.iters // self.clusters

    def _owner(self, it):
        """The cluster whose run holds split iteration ``it``."""
        return ((it + 1) * self.clusters - 1) // self.s.stream_k.iters

    def count(self):
        """Units of this CTA's cluster."""
        c, p = self.cluster, self.clusters
        sk = self.s.stream_k
        if sk is None:
            return (self.mc * self.nc * self.lc - c + p - 1) // p
        lo, hi = self._lo(c), self._lo(c + 1)
        return sk.whole_rounds + (hi - 1) // sk.k_tiles - lo // sk.k_tiles + 1

    def unit(self, j) -> Unit:
        """Unit ``j`` (``0 <= j < count()``) of this CTA's cluster."""
        c, p = self.cluster, self.clusters
        sk = self.s.stream_k
        if sk is None:
            return Unit(*self._cta_tile(c + j * p), 0, self.k_tiles, 0, -1)
        kt = sk.k_tiles
        lo, hi = self._lo(c), self._lo(c + 1)
        # piece q of the run starts at lo or at a tile boundary and stops at one or at hi
        q = j - sk.whole_rounds
        start = _select(q == 0, lo, (lo // kt + q) * kt)
        stop = _min(hi, (lo // kt + q + 1) * kt)
        split = j >= sk.whole_rounds
        tile = _select(split, sk.whole_rounds * p + start // kt, c + j * p)
        k_begin = _select(split, start % kt, 0)
        k_count = _select(split, stop - start, kt)
        # helpers of a head piece: the runs holding the rest of its tile (none if it is whole)
        tile_start = start - start % kt
        first = self._owner(tile_start + k_count)
        last = _select(k_count < kt, self._owner(tile_start + kt - 1), first - 1)
        last = _select(k_begin == 0, last, first - 1)
        return Unit(*self._cta_tile(tile), k_begin, k_count, first, last)

    def _cta_tile(self, t):
        """(m, n, l) CTA tile of this CTA in cluster tile ``t`` of the raster walk."""
        per_l = self.mc * self.nc
        l, r = t // per_l, t % per_l
        major, minor = (self.mc, self.nc) if self.s.raster_along_m else (self.nc, self.mc)
        band = r // (self.s.swizzle * major)
        within = r % (self.s.swizzle * major)
        width = _min(self.s.swizzle, minor - band * self.s.swizzle)
        along, across = within // width, band * self.s.swizzle + within % width
        mc, nc = (along, across) if self.s.raster_along_m else (across, along)
        cm, cn = self.s.cluster_mn
        return mc * cm + self.cta_mn[0], nc * cn + self.cta_mn[1], l
