"""The persistent tile schedule (kernels/schedule.py), run on Python ints: the same arithmetic
the kernels trace. Every output element's every k-tile must be computed exactly once, and the
stream-K pieces must be ordered so that no wait can block a partial it depends on."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("cutlass")

from jax_efc.config import GemmConfig  # noqa: E402
from jax_efc.kernels.schedule import TileWalk, cluster_tiles, plan_schedule  # noqa: E402

PINGPONG = GemmConfig(128, 128, 1, 2, swizzle=8, pingpong=True)
PINGPONG_192 = dataclasses.replace(PINGPONG, tile_m=192)
COOP = GemmConfig(128, 256, 2, 1, swizzle=8)


def _walks(cfg, m, n, k, l, clusters):
    """(schedule, {cluster: {cta: [units]}}, cluster tiles (M, N, L), k-tiles)."""
    schedule = plan_schedule(cfg, m, n, k, l, clusters, 64)
    tiles = cluster_tiles(m, n, l, (cfg.tile_m, cfg.tile_n), (cfg.cluster_m, cfg.cluster_n))
    k_tiles = -(-k // 64)
    grid = clusters if schedule.stream_k else min(clusters, tiles[0] * tiles[1] * l)
    units = {}
    for c in range(grid):
        for cta in itertools.product(range(cfg.cluster_m), range(cfg.cluster_n)):
            walk = TileWalk(schedule, tiles, c, cta, grid, k_tiles)
            units.setdefault(c, {})[cta] = [walk.unit(j) for j in range(walk.count())]
    return schedule, units, tiles, k_tiles


CASES = [
    (PINGPONG, 8192, 8192, 8192, 1, 66),      # 2048 cluster tiles: 31 rounds of 66 and 2
    (PINGPONG, 4096, 14336, 4096, 1, 66),     # 27 rounds and 10
    (PINGPONG, 8192, 4096, 14336, 1, 66),     # 15 rounds and 34: whole tiles only
    (COOP, 8192, 7936, 8192, 1, 66),          # 15 rounds and 2
    (PINGPONG, 4096, 4096, 4096, 1, 66),      # 7 rounds and 50: whole tiles only
    (PINGPONG_192, 8192, 8192, 8192, 1, 66),  # 43 x 32 cluster tiles: 20 rounds and 56
    (PINGPONG_192, 2300, 1536, 1288, 1, 66),  # 72 cluster tiles (a partial M edge): all split
    (GemmConfig(128, 128, 2, 2, swizzle=4, raster="n"), 3000, 1200, 1280, 2, 29),
    (GemmConfig(128, 128, swizzle=8), 1200, 1200, 2000, 3, 59),  # last swizzle band narrower
    (GemmConfig(64, 128), 100, 300, 64, 1, 132),  # fewer tiles than SMs, one k-tile each
    # at most half as many tiles as clusters: all of them split
    (GemmConfig(128, 128), 1024, 512, 8192, 1, 132),  # 32 tiles of 128 k-tiles
    (PINGPONG, 128, 4096, 14336, 1, 66),  # 16 cluster tiles of 224 k-tiles
    (GemmConfig(64, 128), 8, 4096, 1000, 2, 132),  # 64 tiles of 16 k-tiles, the last partial
]


@pytest.mark.parametrize("cfg,m,n,k,l,clusters", CASES)
def test_every_k_tile_of_every_tile_once(cfg, m, n, k, l, clusters):
    _, units, tiles, k_tiles = _walks(cfg, m, n, k, l, clusters)
    seen = {}
    for c, ctas in units.items():
        for cta, run in ctas.items():
            for u in run:
                assert u.k_count > 0 and 0 <= u.k_begin and u.k_begin + u.k_count <= k_tiles
                assert (u.m // cfg.cluster_m, u.n // cfg.cluster_n) < tiles[:2] and 0 <= u.l < l
                assert (u.m % cfg.cluster_m, u.n % cfg.cluster_n) == cta
                for kk in range(u.k_begin, u.k_begin + u.k_count):
                    assert (u.m, u.n, u.l, kk) not in seen
                    seen[(u.m, u.n, u.l, kk)] = c
    ctas = tiles[0] * cfg.cluster_m * tiles[1] * cfg.cluster_n * l
    assert len(seen) == ctas * k_tiles


@pytest.mark.parametrize("cfg,m,n,k,l,clusters", CASES)
def test_stream_k_pieces_wait_only_on_partials_written_first(cfg, m, n, k, l, clusters):
    schedule, units, _, k_tiles = _walks(cfg, m, n, k, l, clusters)
    sk = schedule.stream_k
    for ctas in units.values():
        for run in ctas.values():
            whole = sk.whole_rounds if sk else len(run)
            assert all(u.k_begin == 0 and u.k_count == k_tiles for u in run[:whole])
            for j, u in enumerate(run):
                if u.k_begin > 0:  # contributes a partial: the first piece of its run
                    assert j == whole
                head = u.k_begin == 0 and u.k_count < k_tiles
                assert (u.first_helper <= u.last_helper) == head
                if head:  # collects partials: the last piece of its run
                    assert j == len(run) - 1
    if sk is None:
        return
    # a head piece's helpers hold exactly the rest of its tile, as their first split pieces
    for c, ctas in units.items():
        for cta, run in ctas.items():
            u = run[-1]
            if u.k_begin or u.k_count == k_tiles:
                continue
            covered = u.k_count
            for w in range(u.first_helper, u.last_helper + 1):
                assert w > c
                piece = units[w][cta][sk.whole_rounds]
                assert (piece.m, piece.n, piece.l, piece.k_begin) == (u.m, u.n, u.l, covered)
                covered += piece.k_count
            assert covered == k_tiles


def test_stream_k_only_when_the_last_round_leaves_clusters_idle():
    def split(m, n, k, clusters=66, cfg=PINGPONG):
        return plan_schedule(cfg, m, n, k, 1, clusters, 64).stream_k

    sk = split(8192, 8192, 8192)  # 2048 cluster tiles = 31 rounds of 66, and 2
    assert (sk.whole_rounds, sk.split_tiles, sk.k_tiles) == (30, 68, 128)
    assert split(4096, 14336, 4096).whole_rounds == 26  # 1792 = 27 x 66 + 10
    assert split(4096, 4096, 4096) is None  # 512 = 7 x 66 + 50: the last round is 76% full
    assert split(8192, 4096, 4096) is None  # 1024 = 15 x 66 + 34: 52% full
    assert split(128 * 66, 256, 4096) is None  # exactly one round
    assert split(128 * 60, 256, 4096) is None  # less than one round, but more than half
    sk = split(1024, 1024, 8192)  # 32 cluster tiles for 66 clusters: all split
    assert (sk.whole_rounds, sk.split_tiles, sk.k_tiles) == (0, 32, 128)
    assert split(1024, 1024, 512) is None  # 32 x 8 k-tiles: under 8 for each cluster
    assert split(8192, 8192, 64) is None  # one k-tile: nothing to split
    assert plan_schedule(PINGPONG, 8192, 8192, 8192, 1, 66, 64).slots == 132
    assert split(8192, 8192, 8192, cfg=dataclasses.replace(PINGPONG, stream_k=False)) is None


def test_cluster_tiles_round_partial_tiles_up():
    # 1000 rows: 8 tiles of 128 (the last one partial), 4 clusters of 2
    assert cluster_tiles(1000, 300, 2, (128, 128), (2, 1)) == (4, 3, 2)
    assert cluster_tiles(1024, 256, 1, (128, 256), (1, 2)) == (8, 1, 1)


def test_swizzled_raster_walks_bands():
    """Raster "m", swizzle 2 on 3 x 5 cluster tiles: down M in bands of two N columns; the
    last band is one column wide."""
    schedule = plan_schedule(GemmConfig(128, 128, swizzle=2), 3 * 128, 5 * 128, 64, 1, 15, 64)
    walk = TileWalk(schedule, (3, 5, 1), 0, (0, 0), 15, 1)
    order = [walk._cta_tile(t)[:2] for t in range(15)]
    assert order == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1),
                     (0, 2), (0, 3), (1, 2), (1, 3), (2, 2), (2, 3),
                     (0, 4), (1, 4), (2, 4)]
