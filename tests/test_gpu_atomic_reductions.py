"""Epilogue reductions folded across tiles by atomics (``deterministic=False``) through the Hopper
kernel (marked ``gpu``; ``JAX_EFC_UNVERIFIED_KERNELS=1`` and strict mode, so nothing falls back),
against the float64 oracle and the deterministic mode of ``test_gpu_reductions.py``: sums, maxes,
mins and amaxes over M, N and both, with partial tiles, ping-pong and cooperative tiles, clusters
(tiles wholly past an edge), stream-K and a batch; NaN inputs; values all of one sign."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from test_gpu_reductions import CONFIGS, _epilogue, _oracle, assert_near

pytestmark = pytest.mark.gpu

OUT_DTYPES = {"y": jnp.bfloat16, "cols": jnp.float32, "rows": jnp.float32, "amax": jnp.float32,
              "lo": jnp.float32, "sq": jnp.float32}


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "heuristic" if c is None else
                         f"{c.tile_m}x{c.tile_n}_{c.cluster_m}x{c.cluster_n}{'_pp' if c.pingpong else ''}")
@pytest.mark.parametrize("shape", [(1000, 3000, 1024), (2296, 2824, 1288), (4096, 4096, 512)])
def test_atomic_reductions_against_the_oracle(rng, config, shape):
    """Every tile counts once: the sums match the oracle as the deterministic ones do, and the
    maxes and mins, which no order rounds, are the deterministic mode's bit for bit."""
    m, n, k = shape
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)

    def call(deterministic):
        return jax.jit(lambda a, b, c: efc.gemm(a, b, _epilogue, c, config=config, out_dtypes=OUT_DTYPES,
                                                deterministic=deterministic))

    assert efc.backends(lambda a, b, c: efc.gemm(a, b, _epilogue, c, config=config, deterministic=False),
                        a, b, bias)[0].startswith("kernel")
    got, exact = call(False)(a, b, bias), call(True)(a, b, bias)
    want = _oracle(a, b, bias)
    assert_near(got, want)
    for key in ("y", "rows", "amax", "lo"):
        assert np.array_equal(np.asarray(got[key]), np.asarray(exact[key])), key
    again = call(False)(a, b, bias)
    for key in ("cols", "sq"):  # summed in another order, perhaps: within a few ulps of a sum of |terms|
        np.testing.assert_allclose(np.asarray(again[key]), np.asarray(got[key]), rtol=1e-4, atol=1e-3)


def test_batched_nan_and_values_of_one_sign(rng):
    """A NaN in one batch reaches its sums, maxes and mins (a min folds it in as a negative NaN,
    a max as a positive one) and no other batch's; maxes of negative values only and mins of
    positive ones fold by the unsigned and signed integer atomics alone."""
    m, n, k, batch = 520, 384, 256, 3
    a = jnp.asarray(rng.standard_normal((batch, m, k)) / 16, jnp.bfloat16).at[1, 7, 3].set(jnp.nan)
    b = jnp.asarray(rng.standard_normal((batch, k, n)), jnp.bfloat16)

    def epilogue(acc):
        return (acc, jnp.sum(acc, axis=1), jnp.max(acc, axis=2), jnp.min(acc, axis=(1, 2)),
                jnp.max(-jnp.abs(acc), axis=2), jnp.min(jnp.abs(acc) + 1, axis=1), jnp.max(jnp.abs(acc), axis=(1, 2)))

    got = efc.gemm(a, b, epilogue, out_dtypes=jnp.float32, deterministic=False)[1:]
    exact = efc.gemm(a, b, epilogue, out_dtypes=jnp.float32)[1:]
    acc = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    with np.errstate(invalid="ignore"):
        wants = (acc.sum(1), acc.max(2), acc.min((1, 2)), (-np.abs(acc)).max(2), (np.abs(acc) + 1).min(1),
                 np.abs(acc).max((1, 2)))
    for i, (g, e, want) in enumerate(zip(got, exact, wants)):
        g = np.asarray(g, np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(want), err_msg=str(i))
        np.testing.assert_allclose(np.nan_to_num(g), np.nan_to_num(want), rtol=2e-3, atol=2e-3, err_msg=str(i))
        if i:  # maxes and mins: the deterministic mode's values, NaN where it has one
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e, np.float64), err_msg=str(i))
