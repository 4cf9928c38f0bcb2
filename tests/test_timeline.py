"""The timeline summary, on stamps laid out as the kernel's timeline build writes them."""

import numpy as np
import pytest

from jax_efc.kernels import TIMELINE_EVENTS, TIMELINE_UNITS
from jax_efc.timeline import by_position, summarize

T, E = 1000, 300  # WGMMA cycles per tile, epilogue cycles


def _stamps(n_units, start, late=(), slower=None):
    """(groups=2, units=4, events) int32 of one ping-pong CTA whose unit j's WGMMAs run
    from j*T (200 cycles later, and later on, for each j in ``late``) to the next, taking
    ``slower[j]`` cycles more where given, each epilogue 10 cycles after its tile completes;
    clocks start at ``start`` (may wrap)."""
    cta = np.zeros((2, 4, len(TIMELINE_EVENTS)), np.int64)
    t = 0
    for j in range(n_units):
        t += 200 if j in late else 0
        w = T + (slower or {}).get(j, 0)
        events = (t - 50, t, t + w - 100, t + w, t + w + 10, t + w + 10 + E)
        cta[j % 2, j // 2] = [(start + v) % 2**32 for v in events]
        t += w
    return cta.astype(np.uint32).view(np.int32)


def test_summary_of_two_ctas():
    # CTA 0: 4 units, the clock wrapping on the way; CTA 1: 3 units, unit 2 starting 200 late
    stamps = np.stack([_stamps(4, 2**32 - 1500), _stamps(3, 7, late=(2,))])
    s = summarize(stamps)
    assert s.units == 3.5
    assert s.span == ((4 * T + 10 + E) + (3 * T + 200 + 10 + E)) / 2
    assert s.span_max == 4 * T + 10 + E
    assert s.tile == T
    assert s.gaps == 200 / 2
    assert s.epilogue == E
    assert s.last == 10 + E


def test_by_position_over_the_most_common_walk():
    # two CTAs of 3 units whose second tile is 300 and 100 cycles slower (one also starting
    # its third 200 late, which is idle time, not WGMMA time), and one of 4 that is left out
    stamps = np.stack([_stamps(3, 7, late=(2,), slower={1: 300}), _stamps(4, 2**32 - 1500, slower={0: 900}),
                       _stamps(3, 40, slower={1: 100})])
    pos = by_position(stamps)
    assert (pos.units, pos.ctas) == (3, 2)
    np.testing.assert_array_equal(pos.tile, [T, T + 200, T])
    np.testing.assert_array_equal(pos.epilogue, [E, E, E])


def test_stamps_without_units_are_refused():
    empty = np.zeros((3, 2, 4, len(TIMELINE_EVENTS)), np.int32)
    for fn in (summarize, by_position):
        with pytest.raises(ValueError, match="no CTA stamped a unit"):
            fn(empty)


def test_ctas_without_units_are_left_out():
    stamps = np.stack([_stamps(2, 5), np.zeros((2, 4, len(TIMELINE_EVENTS)), np.int32)])
    s = summarize(stamps)
    assert (s.units, s.span_max, s.tile, s.last) == (2, 2 * T + 10 + E, T, 10 + E)


@pytest.mark.gpu
def test_timeline_of_a_pingpong_kernel():
    from jax_efc.bench import bench_problem
    from jax_efc.config import GemmConfig
    from jax_efc.timeline import _cta_units, record

    # 16 x 16 tiles of 128x128 over the H200's 66 clusters of 2: one round and a bit, no
    # stream-K split, so every tile is one unit
    cfg = GemmConfig(128, 128, 1, 2, swizzle=8, pingpong=True, epi_n=64)
    stamps = record(bench_problem("bias+gelu_tanh", (2048, 2048, 1024, 1), config=cfg), calls=2)
    assert stamps.shape[1:] == (2, TIMELINE_UNITS, len(TIMELINE_EVENTS))
    assert np.count_nonzero(stamps[..., 0]) == 256
    for cta in stamps:
        e = _cta_units(cta)
        assert (np.diff(e, axis=1) >= 0).all()  # each unit's events in order
    s = summarize(stamps)
    assert s.units == pytest.approx(256 / stamps.shape[0])
    assert 0 < s.tile < s.span and 0 < s.epilogue and 0 < s.last
    pos = by_position(stamps)
    assert pos.tile.shape == pos.epilogue.shape == (pos.units,) and pos.ctas > 0
    assert (pos.tile > 0).all() and (pos.epilogue > 0).all()
