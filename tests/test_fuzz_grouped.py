"""Differential fuzzing of grouped GEMMs against a per-group float64 loop: random group sizes
(empty groups, groups smaller and larger than a tile, rows past the groups), shapes, per-group
biases and tile operands; on the reference path here, through the Hopper kernel on a GPU.
Fixed seeds and a bounded budget, so a run is reproducible."""

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


def _run(case) -> None:
    sizes, t, k, n, dtype, seed = case
    rng = np.random.default_rng(seed)
    g = len(sizes)
    lhs = rng.standard_normal((t, k)) / np.sqrt(k)
    rhs = rng.standard_normal((g, k, n))
    bias = rng.standard_normal((g, n))
    c = rng.standard_normal((t, n))
    out = efc.grouped_gemm(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes, jnp.int32),
                           lambda acc, c, b: jnp.tanh(acc + b) * 2.0 + c, jnp.asarray(c, dtype),
                           group_operands=[jnp.asarray(bias, jnp.float32)], out_dtypes=jnp.float32)
    # the oracle from the inputs as the op received them (rounded to dtype)
    lhs, rhs, c = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (lhs, rhs, c))
    acc = np.zeros((t, n))
    start = 0
    for group, size in enumerate(sizes):
        acc[start:start + size] = lhs[start:start + size] @ rhs[group] + bias[group]
        start += size
    want = np.tanh(acc) * 2.0 + c
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
