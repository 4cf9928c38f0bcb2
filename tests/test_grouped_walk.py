"""The grouped GEMM's persistent walk (``kernels/grouped_walk.py``) on Python ints: every output
row of every column tile is covered exactly once, by a tile of its own group (the rows past the
groups by group G with no k-tiles), and empty groups cost no tile."""

from __future__ import annotations

import pytest

from jax_efc.kernels.grouped_walk import GroupedWalk, table, tile_bound


def _walks(sizes, rows, tile_m, n_tiles, clusters, cluster_n=1, k_tiles=7):
    entries = table(sizes, tile_m, n_tiles, rows)
    for c in range(clusters):
        for cta_n in range(cluster_n):
            yield GroupedWalk(lambda g: entries[g][0], lambda g: entries[g][1], len(sizes), tile_m, n_tiles, c,
                              cta_n, cluster_n, clusters, k_tiles)


def _check(sizes, rows, tile_m=128, n_ctas=3, clusters=5, cluster_n=1):
    """Walk every CTA of the grid; return the units, after checking the coverage."""
    n_tiles = -(-n_ctas // cluster_n)
    starts = [sum(max(s, 0) for s in sizes[:g]) for g in range(len(sizes))] + [sum(sizes)]
    group_of_row = [next((g for g in range(len(sizes)) if starts[g] <= r < starts[g] + sizes[g]), len(sizes))
                    for r in range(rows)]
    covered = {}
    units = []
    for walk in _walks(sizes, rows, tile_m, n_tiles, clusters, cluster_n):
        for j in range(walk.count()):
            u = walk.unit(j)
            units.append(u)
            assert u.k_begin == 0 and u.m_end > u.m
            assert u.k_count == (0 if u.l == len(sizes) else 7)
            for r in range(u.m, min(u.m + tile_m, u.m_end)):  # the rows the epilogue stores
                assert group_of_row[r] == u.l, (r, u)
                key = (r, u.n)
                assert key not in covered, (key, u, covered[key])
                covered[key] = u
    want = {(r, n) for r in range(rows) for n in range(n_tiles * cluster_n)}
    assert set(covered) == want
    assert len(units) <= tile_bound(len(sizes), rows, tile_m, n_tiles) * cluster_n
    return units


@pytest.mark.parametrize("sizes, rows", [
    ((256, 256, 256, 256), 1024),  # balanced, whole tiles
    ((1000, 3, 0, 21), 1024),  # skewed, with an empty group
    ((0, 0, 0, 512), 512),  # one group holds every row
    ((5, 7, 1, 2), 15),  # every group smaller than a tile
    ((100, 50, 0, 10), 400),  # rows past the groups
    ((0, 0, 0, 0), 64),  # no rows in any group: all rows past them
    ((300, 300), 400),  # more rows in the groups than the output has: clamped
    ((129, 127, 128, 1), 385),  # partial tiles at every group edge
])
@pytest.mark.parametrize("clusters, cluster_n", [(5, 1), (1, 1), (4, 2), (132, 1)])
def test_every_row_is_covered_once(sizes, rows, clusters, cluster_n):
    _check(sizes, rows, clusters=clusters, cluster_n=cluster_n, n_ctas=4 if cluster_n == 2 else 3)


def test_empty_groups_cost_nothing():
    units = _check((64, 0, 0, 0, 64, 0), 128, tile_m=64, n_ctas=1, clusters=1)
    assert [(u.m, u.l) for u in units] == [(0, 0), (64, 4)]


def test_partial_tiles_start_at_their_groups_rows():
    units = _check((100, 50), 200, tile_m=64, n_ctas=1, clusters=1)
    # group 0: rows 0 and 64 (the second tile's last 28 rows are group 1's); group 1 at row 100;
    # the rows past the groups, 150..199, as group 2 with no k-tiles
    assert [(u.m, u.m_end, u.l, u.k_count) for u in units] == [
        (0, 100, 0, 7), (64, 100, 0, 7), (100, 150, 1, 7), (150, 200, 2, 0)]


def test_tiles_walk_down_m_first_within_a_group():
    units = _check((256,), 256, tile_m=128, n_ctas=2, clusters=1)
    assert [(u.m, u.n) for u in units] == [(0, 0), (128, 0), (0, 1), (128, 1)]


def test_table_is_the_scan_of_the_sizes():
    assert table((3, 0, 200), 128, 2, 300) == [(0, 0), (3, 2), (3, 2), (203, 6), (300, 8)]


@pytest.mark.parametrize("sizes, rows", [
    ((256, 256, 256, 256), 1024),  # balanced, whole k-tiles
    ((1000, 3, 0, 21), 1024),  # skewed, with an empty group
    ((5, 7, 1, 2), 15),  # every group shorter than a k-tile
    ((100, 50, 0, 10), 400),  # rows past the groups: in no group's contraction
    ((300, 300), 400),  # more rows in the groups than A and B have: clamped
])
@pytest.mark.parametrize("clusters, cluster_n", [(5, 1), (1, 1), (4, 2), (132, 1)])
def test_contraction_walk_covers_every_group_tile_once_with_its_rows(sizes, rows, clusters, cluster_n):
    """A walk over groups of the contraction: every (m, n) tile of every group once, each over its
    group's rows exactly (k-tiles of 64 from the group's first row, the last one cut at its end)."""
    from jax_efc.kernels.grouped_walk import ContractionWalk
    from jax_efc.kernels.schedule import TileSchedule, TileWalk

    tile_k, tiles_m, tiles_n = 64, 3, 2
    entries = table(sizes, 128, 1, rows)
    schedule = TileSchedule(clusters, (1, cluster_n), True, 1)
    covered = {}
    for c in range(clusters):
        for cta_n in range(cluster_n):
            tiles = TileWalk(schedule, (tiles_m, -(-tiles_n // cluster_n), len(sizes)), c, (0, cta_n), clusters, 99)
            walk = ContractionWalk(tiles, lambda g: entries[g][0], tile_k)
            for j in range(walk.count() + 2):  # ping-pong reads units past the end: in the table
                walk.unit(j)
            for j in range(walk.count()):
                u = walk.unit(j)
                start = min(sum(max(s, 0) for s in sizes[:u.l]), rows)
                end = min(start + max(sizes[u.l], 0), rows)
                assert (u.k_start, u.k_end) == (start, end) and u.k_begin == 0
                assert u.k_count * tile_k >= end - start > (u.k_count - 1) * tile_k or u.k_count == end - start == 0
                key = (u.m, u.n, u.l)
                assert key not in covered
                covered[key] = u
    want = {(m, n, g) for m in range(tiles_m) for n in range(-(-tiles_n // cluster_n) * cluster_n)
            for g in range(len(sizes))}
    assert set(covered) == want
