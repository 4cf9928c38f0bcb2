"""Differential fuzzing of grouped GEMMs against a per-group float64 loop: random group sizes
(empty groups, groups smaller and larger than a tile, rows past the groups), shapes, per-group
biases and tile operands, and the weight gradient (each group's rows of lhs, transposed, times
the output gradient's, with NaN in the rows past the groups); on the reference path here,
through the Hopper kernels on a GPU.
Fixed seeds and a bounded budget, so a run is reproducible. Sharded jit on 8 host devices is
fuzzed against the same oracle."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis")

import jax.numpy as jnp  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import fuzzing  # noqa: E402
import jax_efc as efc  # noqa: E402

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw, kernel: bool = False):
    """(group sizes, T, K, N, dtype, seed): sizes from empty to a few tiles of 128 rows, T at
    least their sum; K and N multiples of 8 (a TMA row's 16 bytes in 16-bit types)."""
    groups = draw(st.integers(1, 9))
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(1, 400)), min_size=groups, max_size=groups))
    t = sum(sizes) + draw(st.integers(0, 200 if kernel else 40))
    k = 8 * draw(st.integers(1, 48 if kernel else 8))
    n = 8 * draw(st.integers(1, 64 if kernel else 8))
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16] if kernel else [jnp.float32, jnp.bfloat16]))
    return sizes, max(t, 1), k, n, dtype, draw(st.integers(0, 2 ** 31 - 1))


def _epilogue(acc, c, b):
    return jnp.tanh(acc + b) * 2.0 + c


def _oracle(lhs, rhs, sizes, bias, c) -> np.ndarray:
    """The epilogue of the ragged product in float64: groups follow one another from row 0 (a
    negative size counts as 0; rows past the last row are dropped), rows past them 0."""
    t, n = lhs.shape[0], rhs.shape[2]
    acc = np.zeros((t, n))
    start = 0
    for group, size in enumerate(sizes):
        rows = slice(min(start, t), min(start + max(size, 0), t))
        acc[rows] = lhs[rows] @ rhs[group] + bias[group]
        start += max(size, 0)
    return np.tanh(acc) * 2.0 + c


def _inputs(rng, t, k, n, g):
    return (rng.standard_normal((t, k)) / np.sqrt(k), rng.standard_normal((g, k, n)), rng.standard_normal((g, n)),
            rng.standard_normal((t, n)))


def _run(case) -> None:
    sizes, t, k, n, dtype, seed = case
    lhs, rhs, bias, c = _inputs(np.random.default_rng(seed), t, k, n, len(sizes))
    out = efc.grouped_gemm(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes, jnp.int32),
                           _epilogue, jnp.asarray(c, dtype), group_operands=[jnp.asarray(bias, jnp.float32)],
                           out_dtypes=jnp.float32)
    # the oracle from the inputs as the op received them (rounded to dtype)
    lhs, rhs, c = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (lhs, rhs, c))
    want = _oracle(lhs, rhs, sizes, bias, c)
    got = np.asarray(out, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), case


@settings(max_examples=40, **_SETTINGS)
@given(cases())
def test_reference_matches_the_per_group_oracle(case):
    _run(case)


@pytest.mark.gpu
@settings(max_examples=30, **_SETTINGS)
@given(cases(kernel=True))
def test_kernel_matches_the_per_group_oracle(case):
    with fuzzing.strict():  # every call the grouped kernel, unchecked (this is its check), or an error
        _run(case)


def _run_weight_gradient(case) -> None:
    import jax

    sizes, t, k, n, dtype, seed = case
    rng = np.random.default_rng(seed)
    lhs, ct = rng.standard_normal((t, k)), rng.standard_normal((t, n))
    lhs, ct = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (lhs, ct))
    past = sum(sizes)
    poisoned = [jnp.asarray(np.where(np.arange(t)[:, None] < past, x, np.nan), dtype) for x in (lhs, ct)]
    rhs = jnp.zeros((len(sizes), k, n), dtype)  # (the product is linear in rhs: any point)
    _, pullback = jax.vjp(lambda r: efc.grouped_gemm(poisoned[0], r, jnp.asarray(sizes, jnp.int32)), rhs)
    got = np.asarray(pullback(poisoned[1])[0], np.float64)
    want, start = np.zeros((len(sizes), k, n)), 0
    for group, size in enumerate(sizes):
        want[group] = lhs[start:start + size].T @ ct[start:start + size]
        start += size
    assert got.shape == want.shape and np.isfinite(got).all(), case
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), case


@settings(max_examples=25, **_SETTINGS)
@given(cases())
def test_reference_weight_gradient_matches_the_per_group_oracle(case):
    _run_weight_gradient(case)


@pytest.mark.gpu
@settings(max_examples=30, **_SETTINGS)
@given(cases(kernel=True))
def test_kernel_weight_gradient_matches_the_per_group_oracle(case):
    with fuzzing.strict():  # the weight-gradient kernel, unchecked (this is its check), or an error
        _run_weight_gradient(case)


# (lhs rows, rhs columns) over the 2 x 4 mesh of the 8 host devices
_SHARDINGS = {"rows": ("data", None), "columns": (None, "model"), "rows and columns": ("data", "model"),
              "rows over both axes": (("data", "model"), None), "experts and K (gathered)": (None, None)}


@settings(max_examples=25, **_SETTINGS)
@given(st.sampled_from(sorted(_SHARDINGS)), st.lists(st.integers(-20, 90), min_size=1, max_size=6),
       st.integers(1, 12), st.integers(0, 2 ** 31 - 1))
def test_sharded_jit_matches_the_per_group_oracle(sharding, sizes, row_blocks, seed):
    """Sharded jit on 8 host devices: each device's rows with its slice's group sizes, or its
    columns, against the oracle of the whole call; sizes that are negative, or that overrun
    the rows, included."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows, cols = _SHARDINGS[sharding]
    t, k, n = 8 * row_blocks, 16, 32
    if sharding.startswith("experts"):
        sizes = sizes + [0] * (len(sizes) % 2)  # experts split in two
    lhs, rhs, bias, c = _inputs(np.random.default_rng(seed), t, k, n, len(sizes))
    specs = {"experts and K (gathered)": (P(None, "model"), P("data", "model"), P(), P())}.get(
        sharding, (P(rows), P(None, None, cols), P(None, cols), P(rows, cols)))
    args = [jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, s))
            for x, s in zip((lhs, rhs, bias, c), specs)]
    sizes_arr = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda x, w, b, c: efc.grouped_gemm(x, w, sizes_arr, _epilogue, c, group_operands=[b]))(*args)
    want = _oracle(lhs, rhs, sizes, bias, c)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
