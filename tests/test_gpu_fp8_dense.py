"""``fp8_dense`` through the Hopper kernel (marked ``gpu``; strict mode, so none of its three
GEMMs falls back): its quantisation on the device against round to nearest even, output and
gradients against a float64 oracle of the FP8 values the device made, with partial tiles, both
scalings, and NaN inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_efc as efc
from jax_efc import fp8
from test_fp8_dense import ACTS, _q, _scale

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


def _device_quantised(x, dtype):
    """``x`` quantised on the device as fp8_dense quantises it (current scaling), in float64."""
    q = jax.jit(lambda x: fp8._quantize(x, dtype, fp8._current_scale(fp8._amax(x), dtype)))(x)
    scale = fp8._current_scale(fp8._amax(x), dtype)
    return np.asarray(q.astype(jnp.float32), np.float64) * float(scale[0])


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_the_device_quantises_to_nearest_even_and_saturates(rng, dtype):
    """The quantisation fp8_dense runs on the GPU (XLA's conversion) against ml_dtypes' round to
    nearest even of the same scaled values, saturated: equal but for rare ties (double rounding)."""
    x = jnp.asarray(rng.standard_normal((1024, 1024)) * 3, jnp.bfloat16)
    x = x.at[0, :8].set(jnp.asarray([1e4, -1e4, 3e-3, -3e-3, 0.0, 15.0, -15.0, 7.0], jnp.bfloat16))
    got = _device_quantised(x, dtype)
    want = _q(np.asarray(x, np.float64), dtype, _scale(np.asarray(x, np.float64), dtype))
    assert np.isfinite(got).all()
    assert (got != want).mean() < 1e-3, (got != want).mean()


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("m, k, n", [(1000, 1024, 768), (2048, 4096, 2048)])
def test_kernel_forward_and_gradients_against_the_quantised_oracle(rng, activation, m, k, n):
    """Each GEMM against a float64 oracle of the FP8 values the device's quantisations made: the
    forward within bf16's rounding, the gradients within e5m2's."""
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
    xq, wq = _device_quantised(x, fp8.E4M3), _device_quantised(w, fp8.E4M3)
    z = xq @ wq + np.asarray(b, np.float64)
    gz = np.asarray(g, np.float64) * act_grad(np.asarray(jnp.asarray(z, jnp.bfloat16), np.float64))
    gq = _device_quantised(jnp.asarray(gz, jnp.float32), fp8.E5M2)
    for name, got, want, tol in (("y", y, act(z), 4e-3), ("dx", dx, gq @ wq.T, 1e-2), ("dw", dw, xq.T @ gq, 1e-2),
                                 ("db", db, gz.sum(0), 1e-2)):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < tol, (name, err)


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


def test_kernel_fp8_mlp_is_two_fp8_dense_layers(rng):
    """fp8_mlp with delayed scaling through the kernel (its reductions checked on first use):
    output and gradients as the two fp8_dense layers composed, up to their bf16 rounding of the
    hidden tensors."""
    from test_fp8_dense import _metas

    x = jnp.asarray(rng.standard_normal((2048, 1024)) * 3, jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal((1024, 2048)) / 32, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((2048, 1024)) / 45, jnp.bfloat16)
    bu, bd = jnp.asarray(rng.standard_normal(2048), jnp.bfloat16), jnp.asarray(rng.standard_normal(1024), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
    mu, md = _metas(rng, 16)

    def fused(*args):
        return efc.fp8_mlp(*args[:5], activation="gelu_tanh", up_meta=args[5], down_meta=args[6])

    def composed(x, up, bu, down, bd, mu, md):
        return efc.fp8_dense(efc.fp8_dense(x, up, bu, activation="gelu_tanh", meta=mu), down, bd, meta=md)

    args = (x, up, bu, down, bd, mu, md)
    assert all(s.startswith("kernel") for s in efc.backends(lambda *a: jax.vjp(fused, *a)[1](g), *args))
    (y1, p1), (y2, p2) = (jax.vjp(jax.jit(f), *args) for f in (fused, composed))
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))  # noqa: E731
    assert rel(y1, y2) < 2e-2
    for i, (a, b) in enumerate(zip(p1(g)[:5], p2(g)[:5])):
        assert rel(a, b) < 5e-2, (i, rel(a, b))
