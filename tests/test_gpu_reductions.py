"""Epilogue reductions through the Hopper kernel (marked ``gpu``; ``JAX_EFC_UNVERIFIED_KERNELS=1``
and strict mode, so nothing falls back), against a float64 NumPy oracle: sums, maxes, mins and
amaxes over M, N and both, with partial tiles, ping-pong and cooperative tiles, clusters,
stream-K and a batch; NaN inputs; poisoned memory under the partials; and bit-identical
results across runs (no atomics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _epilogue(acc, bias):
    y = jax.nn.gelu(acc + bias)
    return {"y": y, "cols": jnp.sum(y, axis=-2), "rows": jnp.max(y, axis=-1), "amax": jnp.max(jnp.abs(y)),
            "lo": jnp.min(acc, axis=-1, keepdims=True), "sq": jnp.sum(acc * acc, axis=(-2, -1))}


def _oracle(a, b, bias):
    acc = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    y = _gelu_tanh(acc + np.asarray(bias, np.float64))
    return {"y": y, "cols": y.sum(-2), "rows": y.max(-1), "amax": np.abs(y).max(),
            "lo": acc.min(-1, keepdims=True), "sq": (acc * acc).sum((-2, -1))}


def assert_near(got: dict, want: dict) -> None:
    """Every output of ``got`` finite and within its bar of the float64 ``want``: bf16 rounding
    for the tile, fp32 accumulation for the reductions."""
    for key, w in want.items():
        g = np.asarray(got[key], np.float64)
        assert g.shape == np.shape(w) and np.isfinite(g).all(), key
        tol = 2e-2 if key == "y" else 2e-3
        assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), (key, np.abs(g - w).max())


CONFIGS = [None, efc.GemmConfig(128, 128, 1, 2, pingpong=True), efc.GemmConfig(128, 256, 2, 1),
           efc.GemmConfig(256, 128, 1, 2, epi_m=128), efc.GemmConfig(128, 192, 2, 1, pingpong=True, raster="n"),
           efc.GemmConfig(64, 256, 1, 1, pingpong=True, epi_n=16)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "heuristic" if c is None else
                         f"{c.tile_m}x{c.tile_n}_{c.cluster_m}x{c.cluster_n}{'_pp' if c.pingpong else ''}")
@pytest.mark.parametrize("shape", [(1000, 3000, 1024), (2296, 2824, 1288), (4096, 4096, 512)])
def test_reductions_against_the_oracle(rng, config, shape):
    m, n, k = shape
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    assert efc.backends(lambda a, b, c: efc.gemm(a, b, _epilogue, c, config=config), a, b, bias)[0].startswith("kernel")
    f = jax.jit(lambda a, b, c: efc.gemm(a, b, _epilogue, c, config=config, out_dtypes={
        "y": jnp.bfloat16, "cols": jnp.float32, "rows": jnp.float32, "amax": jnp.float32, "lo": jnp.float32,
        "sq": jnp.float32}))
    jax.block_until_ready(f(a, b, bias))
    poison = [jnp.full((m, n), jnp.nan, jnp.float32) for _ in range(4)]  # what the partials land on
    jax.block_until_ready(poison)
    del poison
    got = f(a, b, bias)
    want = _oracle(a, b, bias)
    assert_near(got, want)
    again = f(a, b, bias)
    for key in want:  # the same bits on every run
        assert np.array_equal(np.asarray(got[key]), np.asarray(again[key]), equal_nan=True), key


def test_batched_and_nan(rng):
    m, n, k, batch = 520, 384, 256, 3
    a = jnp.asarray(rng.standard_normal((batch, m, k)) / 16, jnp.bfloat16).at[1, 7, 3].set(jnp.nan)
    b = jnp.asarray(rng.standard_normal((batch, k, n)), jnp.bfloat16)
    s, mx, amax = efc.gemm(a, b, lambda acc: (acc, jnp.sum(acc, axis=1), jnp.max(acc, axis=2),
                                              jnp.max(jnp.abs(acc), axis=(1, 2))), out_dtypes=jnp.float32)[1:]
    acc = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    for got, want in ((s, acc.sum(1)), (mx, acc.max(2)), (amax, np.abs(acc).max((1, 2)))):
        got = np.asarray(got, np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=2e-3, atol=2e-3)


def test_fp8_output_and_its_amax(rng):
    """The FP8 recipe's step: scale, an e4m3 output and the amax of what it saturates from."""
    m, n, k = 2048, 2048, 1024
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(jnp.float8_e4m3fn)
    y, amax = efc.gemm(a, b, lambda acc, *, s: (acc * s, jnp.max(jnp.abs(acc * s))), transpose_b=True,
                       s=jnp.float32(0.05), out_dtypes=(jnp.float8_e4m3fn, jnp.float32))
    acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    np.testing.assert_allclose(float(amax), np.abs(acc * 0.05).max(), rtol=1e-3)
