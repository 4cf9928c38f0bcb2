"""Reductions the epilogue consumes, finished inside a tile that spans the rows (a row softmax, a
row norm; ``KernelProblem.row_stats``), through the Hopper kernel (marked ``gpu``; strict mode and
``JAX_EFC_UNVERIFIED_KERNELS=1``, so nothing falls back), against a float64 NumPy oracle: partial
tiles along M and N, both schedules, clusters, stream-K, a batch, a transposed output, NaN and
infinite inputs, outputs poisoned beforehand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from test_row_stats import crowded_oracle, crowded_rows, oracle as _oracle, softmax_norm as _epilogue

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")


OUT_DTYPES = {"p": jnp.bfloat16, "u": jnp.float32, "lse": jnp.float32, "y": jnp.bfloat16}
CONFIGS = [None, efc.GemmConfig(128, 256, 2, 1), efc.GemmConfig(128, 128, 1, 2, pingpong=True, epi_m=64),
           efc.GemmConfig(128, 192, 1, 1, epi_n=64), efc.GemmConfig(128, 128, 1, 1, epi_n=16)]


def _check(got, want, rows=slice(None)):
    for key, w in want.items():
        g = np.asarray(got[key], np.float64)[..., rows, :] if key != "lse" else np.asarray(got[key], np.float64)
        w = w[..., rows, :] if key != "lse" else w
        assert g.shape == w.shape and np.isfinite(g).all(), key
        tol = {"p": 1e-2, "y": 1e-2}.get(key, 1e-4)
        assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), (key, np.abs(g - w).max())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "heuristic" if c is None else
                         f"{c.tile_m}x{c.tile_n}_{c.cluster_m}x{c.cluster_n}{'_pp' if c.pingpong else ''}_epi{c.epi_n}")
@pytest.mark.parametrize("shape", [(1000, 120, 1024), (2296, 128, 4104), (4096, 64, 512)])
def test_row_softmax_and_norm_against_the_oracle(rng, config, shape):
    m, n, k = shape
    if config is not None and config.tile_n < n:
        pytest.skip("the tile does not span the row")
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)) * 4, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    call = lambda a, b, c: efc.gemm(a, b, _epilogue, c, config=config, out_dtypes=OUT_DTYPES)  # noqa: E731
    assert efc.backends(call, a, b, bias)[0].startswith("kernel")
    f = jax.jit(call)
    jax.block_until_ready(f(a, b, bias))
    poison = [jnp.full((m, n), jnp.nan, jnp.float32) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    _check(f(a, b, bias), _oracle(a, b, bias))


@pytest.mark.parametrize("shape", [(1000, 120, 48), (2296, 128, 4104)])
def test_crowded_rows_in_narrow_subtiles(rng, shape):
    """Outputs and a TILE operand enough that the heuristic runs the row stats in 16-wide
    subtiles (one k-tile, and a long K with stream-K)."""
    m, n, k = shape
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)) * 4, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    c = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    out_dtypes = {**OUT_DTYPES, **{f"z{i}": jnp.float32 for i in range(4)}}
    call = lambda a, b, bias, c: efc.gemm(a, b, crowded_rows, bias, c, out_dtypes=out_dtypes)  # noqa: E731
    assert efc.backends(call, a, b, bias, c)[0].startswith("kernel")
    f = jax.jit(call)
    jax.block_until_ready(f(a, b, bias, c))
    poison = [jnp.full((m, n), jnp.nan, jnp.float32) for _ in range(8)]
    jax.block_until_ready(poison)
    del poison
    _check(f(a, b, bias, c), crowded_oracle(a, b, bias, c))


def test_batched_rows_with_nan_and_inf(rng):
    """A NaN in a row makes that row's softmax NaN and leaves the others; an infinite bias makes
    every row's max infinite, and ``inf - inf`` NaN, as in XLA."""
    batch, m, n, k = 3, 520, 96, 256
    a = jnp.asarray(rng.standard_normal((batch, m, k)) / 16, jnp.bfloat16).at[1, 7, 3].set(jnp.nan)
    b = jnp.asarray(rng.standard_normal((batch, k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    got = efc.gemm(a, b, _epilogue, bias, out_dtypes=OUT_DTYPES)
    want = _oracle(a, b, bias)
    p = np.asarray(got["p"], np.float64)
    assert np.isnan(p[1, 7]).all() and np.isnan(np.asarray(got["u"])[1, 7]).all()
    keep = np.ones((batch, m), bool)
    keep[1, 7] = False
    np.testing.assert_allclose(p[keep], want["p"][keep], atol=1e-2)
    inf = efc.gemm(a[0], b[0], lambda acc, c: jax.nn.softmax(acc + c, axis=-1), bias.at[5].set(jnp.inf),
                   out_dtypes=jnp.float32)
    assert np.isnan(np.asarray(inf)).all()


def test_a_softmax_stored_transposed(rng):
    m, n, k = 4096, 96, 1024
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)) * 4, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    got = efc.gemm(a, b, _epilogue, bias, out_dtypes=OUT_DTYPES, transposed_outputs="p")
    assert got["p"].shape == (n, m)
    _check({**got, "p": got["p"].T}, _oracle(a, b, bias))
