"""``fp8_dense`` through the Hopper kernel (marked ``gpu``; strict mode, so none of its three
GEMMs falls back): output and gradients against a float64 oracle of the same quantisation, with
partial tiles, both scalings, and NaN inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_efc as efc
from test_fp8_dense import ACTS, _q, _scale

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("m, k, n", [(1000, 1024, 768), (2048, 4096, 2048)])
def test_kernel_forward_and_gradients_against_the_quantised_oracle(rng, activation, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    fn = jax.jit(lambda x, w, b, g: jax.vjp(lambda x, w, b: efc.fp8_dense(x, w, b, activation=activation),
                                            x, w, b)[1](g))
    y = jax.jit(lambda x, w, b: efc.fp8_dense(x, w, b, activation=activation))(x, w, b)
    assert all(s.startswith("kernel") for s in efc.backends(fn, x, w, b, g)), efc.backends(fn, x, w, b, g)
    dx, dw, db = fn(x, w, b, g)
    act, act_grad = ACTS[activation]
    x2, w2 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    xq, wq = _q(x2, e4m3, _scale(x2, e4m3)), _q(w2, e4m3, _scale(w2, e4m3))
    z = xq @ wq + np.asarray(b, np.float64)
    gz = np.asarray(g, np.float64) * act_grad(np.asarray(jnp.asarray(z, jnp.bfloat16), np.float64))
    gq = _q(gz, e5m2, _scale(gz, e5m2))
    for name, got, want in (("y", y, act(z)), ("dx", dx, gq @ wq.T), ("dw", dw, xq.T @ gq), ("db", db, gz.sum(0))):
        got = np.asarray(got, np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, (name, err)


def test_kernel_delayed_scaling_and_nan(rng):
    m, k, n = 1024, 1024, 1024
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    meta = efc.Fp8Meta.init(4)._replace(input_amax_history=jnp.full((4,), 5.0, jnp.float32),
                                        kernel_amax_history=jnp.full((4,), 0.2, jnp.float32))
    y = jax.jit(lambda x, w: efc.fp8_dense(x, w, meta=meta))(x, w)
    e4m3 = ml_dtypes.float8_e4m3fn
    top = float(ml_dtypes.finfo(e4m3).max)
    sx, sw = np.float32(5.0) / np.float32(top), np.float32(0.2) / np.float32(top)
    want = _q(np.asarray(x, np.float64), e4m3, float(sx)) @ _q(np.asarray(w, np.float64), e4m3, float(sw))
    got = np.asarray(y, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    bad = jax.jit(lambda x, w: efc.fp8_dense(x, w))(x.at[7, 9].set(jnp.nan), w)
    assert bool(jnp.isnan(bad).all())
