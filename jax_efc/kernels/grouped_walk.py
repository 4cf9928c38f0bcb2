"""The persistent walk of a grouped (ragged) GEMM: which output tiles exist, given the group
sizes the kernel reads at run time, and which of them each cluster computes.

Group g owns rows [start_g, start_g + size_g) of the (T, N) output (the groups follow one
another from row 0). Its tiles are ``ceil(size_g / tile_m)`` row tiles starting at start_g, row
tile i at row ``start_g + i * tile_m`` (an element offset: groups are not padded to a tile
multiple, so a group's last row tile may run into the next group's rows, which its epilogue
does not store), by the cluster tiles along N. An empty group has no tiles. The rows past the
groups, [sum(sizes), T), form one more group, G, whose tiles run no mainloop: their product
is 0 (``jax.lax.ragged_dot``'s meaning), and the epilogue stores what it makes of that.

Tiles are numbered group after group, down M first within a group; cluster ``c`` of ``P``
takes tiles ``c, c + P, ...`` (whole tiles: no stream-K). Before its walk each CTA writes the
:func:`table` of its groups' first rows and first tiles (a scan of the sizes) into shared
memory; a tile's group is then a binary search of that table.

A grouped GEMM whose groups split the contraction instead (the weight gradient: group g's
product is A's rows of the group, transposed, times B's) has the same (M, N) tiles for every
group, walked as a batch of G (:class:`ContractionWalk`); its units run ``ceil(size_g /
tile_k)`` k-tiles from row start_g on (none for an empty group, whose tiles store zeros), and
the rows of their last k-tile past the group's end are cleared before the MMAs read them.

The arithmetic is plain integer operations that trace into the kernel and also run on Python
ints, which is how the tests check it (``schedule.TileWalk`` does the same).
"""

from __future__ import annotations

from typing import Any, Callable

from jax_efc.kernels.schedule import TileWalk, Unit, _is_static, _min, _select

__all__ = ["ContractionWalk", "GroupedWalk", "group_step", "table", "tile_bound"]


def _max(a, b):
    if _is_static(a, b):
        return max(a, b)
    import cutlass

    return cutlass.max(a, b)


def group_step(row, tiles, size, tile_m: int, n_tiles, rows):
    """One step of the scan: a group of ``size`` rows that starts at ``row`` and tile ``tiles``
    ends at the returned row (clamped to the ``rows`` of the output; a negative size counts as
    0), and the next group's first tile follows its ``ceil(rows / tile_m) * n_tiles`` tiles."""
    end = _max(_min(row + size, rows), row)
    return end, tiles + (end - row + tile_m - 1) // tile_m * n_tiles


def table(sizes, tile_m: int, n_tiles: int, rows: int) -> list[tuple[int, int]]:
    """(first row, first tile) of each group 0..G (G: the rows past the groups) and, last, (the
    output's rows, the tile count), for Python ints. The kernel runs the same scan."""
    row = tiles = 0
    out = []
    for size in sizes:
        out.append((row, tiles))
        row, tiles = group_step(row, tiles, size, tile_m, n_tiles, rows)
    out.append((row, tiles))
    out.append(group_step(row, tiles, rows - row, tile_m, n_tiles, rows))
    return out


def tile_bound(groups: int, rows: int, tile_m: int, n_tiles: int) -> int:
    """The most tiles any group sizes give: each of the G + 1 groups adds at most one partial
    row tile to the ``ceil(rows / tile_m)`` of whole ones."""
    return (-(-rows // tile_m) + groups + 1) * n_tiles


class GroupedWalk:
    """One CTA's view of a grouped schedule: ``count()`` units, unit ``j`` by ``unit(j)``.

    ``first_row(g)`` and ``first_tile(g)`` read :func:`table` (``g`` in 0..G+1); ``groups``: G;
    ``tile_m``: rows of a tile; ``n_tiles``: cluster tiles along N; ``cluster``: this CTA's
    cluster index; ``cta_n``: its coordinate along N in its cluster of ``cluster_n`` (clusters
    span one row tile); ``clusters``: the grid's cluster count; ``k_tiles``: k-tiles per tile.

    A unit's ``m`` is its tile's first row (an element offset, not a tile index), ``m_end`` the
    end of its group's rows, ``l`` its group (G for the rows past the groups, with ``k_count``
    0) and ``n`` its CTA tile along N."""

    def __init__(self, first_row: Callable[[Any], Any], first_tile: Callable[[Any], Any], groups: int,
                 tile_m: int, n_tiles, cluster, cta_n, cluster_n: int, clusters, k_tiles):
        self.first_row, self.first_tile = first_row, first_tile
        self.groups = groups
        self.tile_m = tile_m
        self.n_tiles = n_tiles
        self.cluster, self.cta_n, self.cluster_n = cluster, cta_n, cluster_n
        self.clusters = clusters
        self.k_tiles = k_tiles

    def count(self):
        """Units of this CTA's cluster."""
        return (self.first_tile(self.groups + 1) - self.cluster + self.clusters - 1) // self.clusters

    def group_of(self, t):
        """The group whose tiles hold tile ``t``: the last g in 0..G with first_tile(g) <= t (an
        empty group shares its first tile with the next, which is later)."""
        lo, hi = 0, self.groups
        for _ in range(self.groups.bit_length()):  # hi - lo halves each step
            mid = (lo + hi + 1) // 2
            take = self.first_tile(mid) <= t
            lo, hi = _select(take, mid, lo), _select(take, hi, mid - 1)
        return lo

    def unit(self, j) -> Unit:
        """Unit ``j`` (``0 <= j < count()``) of this CTA's cluster."""
        t = self.cluster + j * self.clusters
        g = self.group_of(t)
        start, end = self.first_row(g), self.first_row(g + 1)
        # (at least 1: a unit past the walk's end, which ping-pong reads but never runs, finds
        # the rows past the groups, perhaps none)
        row_tiles = _max((end - start + self.tile_m - 1) // self.tile_m, 1)
        r = t - self.first_tile(g)
        row = start + r % row_tiles * self.tile_m
        n = r // row_tiles * self.cluster_n + self.cta_n
        k_count = _select(g < self.groups, self.k_tiles, 0)
        return Unit(row, n, g, 0, k_count, 0, -1, end)


class ContractionWalk:
    """One CTA's view of a grouped GEMM whose groups split the contraction: ``tiles`` (a
    :class:`~jax_efc.kernels.schedule.TileWalk` of whole tiles over L = the groups) says which
    tiles, ``first_row(g)`` where group g's rows start (:func:`table`, g in 0..G), and each
    unit runs its group's k-tiles of ``tile_k`` rows."""

    def __init__(self, tiles: TileWalk, first_row: Callable[[Any], Any], tile_k: int):
        self.tiles, self.first_row, self.tile_k = tiles, first_row, tile_k

    def count(self):
        """Units of this CTA's cluster."""
        return self.tiles.count()

    def unit(self, j) -> Unit:
        """Unit ``j`` (``0 <= j < count()``) of this CTA's cluster."""
        u = self.tiles.unit(j)
        # (a unit past the walk's end, which ping-pong reads but never runs, has a group past the
        # last: it reads the table's last entries, the rows past the groups, not past the table)
        g = _min(u.l, self.tiles.lc)
        start, end = self.first_row(g), self.first_row(g + 1)
        return u._replace(k_count=(end - start + self.tile_k - 1) // self.tile_k, k_start=start, k_end=end)
