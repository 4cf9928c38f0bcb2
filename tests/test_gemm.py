"""Forward numerics of gemm and fused_dense on the reference path (any machine)."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import rel_err
from jax_efc.primitive import fused_gemm_eqns

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def arrays(rng, *shapes, dtype=jnp.float32):
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# the CUTLASS example's four epilogues ---------------------------------------------------------------

def alpha_beta(acc, c, x, *, alpha, beta, x_factor):
    return {"D": acc * alpha + c * beta + x * x_factor, "Y": acc}


def activation_fusion(acc):
    return jax.nn.relu(acc)


def multi_output(acc, c):
    d = acc + c
    return d, d * d, jnp.exp(-jnp.abs(d))


def complex_expr(acc, bias, c, x, *, scale):
    return jax.nn.gelu((acc + bias) * scale + c + jnp.tanh(x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_alpha_beta(rng, dtype):
    a, b, c, x = arrays(rng, (96, 64), (64, 80), (96, 80), (96, 80), dtype=dtype)
    out = efc.gemm(a, b, alpha_beta, c, x, alpha=2.0, beta=1.0, x_factor=3.0,
                   out_dtypes={"D": jnp.float16, "Y": jnp.float32})
    acc = f32(a) @ f32(b)
    assert out["D"].dtype == jnp.float16 and out["Y"].dtype == jnp.float32
    assert rel_err(out["D"], 2 * acc + f32(c) + 3 * f32(x)) < max(TOL[dtype], 2e-3)
    assert rel_err(out["Y"], acc) < TOL[dtype]


def test_activation_and_multi_output(rng):
    a, b, c = arrays(rng, (40, 24), (24, 56), (40, 56))
    acc = f32(a) @ f32(b)
    assert rel_err(efc.gemm(a, b, activation_fusion), np.maximum(acc, 0)) < 1e-5
    d, d2, e = efc.gemm(a, b, multi_output, c)
    ref = acc + f32(c)
    assert rel_err(d, ref) < 1e-5 and rel_err(d2, ref * ref) < 1e-5
    assert rel_err(e, np.exp(-np.abs(ref))) < 1e-5


def test_complex_expression(rng):
    a, b, bias, c, x = arrays(rng, (64, 32), (32, 48), (48,), (64, 48), (64, 48))
    out = efc.gemm(a, b, complex_expr, bias, c, x, scale=0.5)
    ref = jax.nn.gelu((a @ b + bias) * 0.5 + c + jnp.tanh(x))
    assert rel_err(out, ref) < 1e-5


def test_one_minus_square_is_fused(rng):
    """``one_minus_square`` (how newer JAX writes tanh's derivative) is traced as 1 - x*x."""
    from jax.extend.core import Primitive

    one_minus_square = Primitive("one_minus_square")
    one_minus_square.def_abstract_eval(lambda x: x)
    a, b = arrays(rng, (64, 32), (32, 48))
    out = efc.gemm(a, b, lambda acc: one_minus_square.bind(jnp.tanh(acc)))
    assert rel_err(out, 1.0 - jnp.tanh(a @ b) ** 2) < 1e-5


@pytest.mark.parametrize("name", sorted(efc.ACTIVATIONS))
def test_builtin_activations(rng, name):
    x, w, bias = arrays(rng, (3, 20, 32), (32, 48), (48,))
    y = efc.fused_dense(x, w, bias, activation=name)
    assert y.shape == (3, 20, 48)
    ref = efc.ACTIVATIONS[name](jnp.einsum("btk,kn->btn", x, w) + bias)
    assert rel_err(y, ref) < 1e-5


def test_fused_dense_residual_and_callable(rng):
    x, w, bias, r = arrays(rng, (16, 32), (32, 24), (24,), (16, 24))
    y = efc.fused_dense(x, w, bias, activation=lambda z: jnp.where(z > 0, z, 0.2 * z), residual=r)
    ref = jax.nn.leaky_relu(x @ w + bias, 0.2) + r
    assert rel_err(y, ref) < 1e-5
    assert rel_err(efc.fused_dense(x, w), x @ w) < 1e-6


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_transposed_and_batched(rng, ta, tb):
    L, M, N, K = 3, 36, 44, 28
    a, b = arrays(rng, (L, K, M) if ta else (L, M, K), (L, N, K) if tb else (L, K, N))
    row, col, tile = arrays(rng, (N,), (M, 1), (L, M, N))
    out = efc.gemm(a, b, lambda acc, r, c, t, *, s: (acc + r) * c - t * s, row, col, tile, s=0.5,
                   transpose_a=ta, transpose_b=tb)
    opa = np.swapaxes(f32(a), 1, 2) if ta else f32(a)
    opb = np.swapaxes(f32(b), 1, 2) if tb else f32(b)
    ref = (opa @ opb + f32(row)) * f32(col) - f32(tile) * 0.5
    assert out.shape == (L, M, N)
    assert rel_err(out, ref) < 1e-5


def test_batch_broadcast_against_2d(rng):
    a, b = arrays(rng, (2, 8, 16), (16, 24))
    assert rel_err(efc.gemm(a, b), f32(a) @ f32(b)) < 1e-6
    a2, b2 = arrays(rng, (8, 16), (2, 16, 24))
    assert rel_err(efc.gemm(a2, b2), f32(a2) @ f32(b2)) < 1e-6


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 5), (129, 65, 33), (1000, 1000, 24)])
def test_odd_shapes(rng, shape):
    m, n, k = shape
    a, b, bias = arrays(rng, (m, k), (k, n), (n,))
    y = efc.fused_dense(a, b, bias, activation="silu")
    assert rel_err(y, jax.nn.silu(f32(a) @ f32(b) + f32(bias))) < 1e-5


@pytest.mark.parametrize("m, n, k", [(0, 24, 16), (8, 24, 0), (8, 0, 16)])
def test_zero_sized_dimensions(rng, m, n, k):
    """An empty M, N or K gives what the dot gives (with K = 0 the epilogue of a zero
    accumulator), through gemm, fused_dense with leading dimensions and a residual, vmap,
    fused_mlp and the gradients."""
    x, w, bias, r = arrays(rng, (2, m, k), (k, n), (n,), (2, m, n))
    want = jax.nn.silu(f32(x) @ f32(w) + f32(bias)) + f32(r)
    y = efc.fused_dense(x, w, bias, activation="silu", residual=r)
    assert y.shape == (2, m, n) and np.allclose(y, want, atol=1e-6)
    mapped = jax.vmap(lambda x, r: efc.gemm(x, w, lambda acc, r: acc + r, r))(x, r)
    assert np.allclose(mapped, f32(x) @ f32(w) + f32(r))
    grads = jax.grad(lambda x, w: jnp.sum(efc.fused_dense(x, w, bias, activation="silu") ** 2), (0, 1))(x, w)
    want_grads = jax.grad(lambda x, w: jnp.sum(jax.nn.silu(x @ w + bias) ** 2), (0, 1))(x, w)
    for g, v in zip(grads, want_grads):
        assert g.shape == v.shape and np.allclose(g, v, atol=1e-5)
    (down,) = arrays(rng, (n, 8))
    mlp = efc.fused_mlp(x, w, bias, down, None, activation="silu")
    assert mlp.shape == (2, m, 8)
    assert np.allclose(mlp, jax.nn.silu(f32(x) @ f32(w) + f32(bias)) @ f32(down), atol=1e-5)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_one_row_runs_as_two_row_gemm(rng, batched, ta, tb):
    """A one-row A is padded to two rows (XLA's GPU GEMM beats its one-row path), and only
    the real row comes back, forward and backward."""
    lead = (3,) if batched else ()
    M, N, K = 1, 44, 28
    a, b = arrays(rng, lead + ((K, M) if ta else (M, K)), lead + ((N, K) if tb else (K, N)))
    bias, tile = arrays(rng, (N,), lead + (M, N))

    def f(a, b, bias, tile):
        return efc.gemm(a, b, lambda acc, r, t: jax.nn.gelu(acc + r) * t, bias, tile,
                        transpose_a=ta, transpose_b=tb)

    opa = np.swapaxes(f32(a), -1, -2) if ta else f32(a)
    opb = np.swapaxes(f32(b), -1, -2) if tb else f32(b)
    want = jax.nn.gelu(opa @ opb + f32(bias)) * f32(tile)
    out = jax.jit(f)(a, b, bias, tile)
    assert out.shape == lead + (M, N) and rel_err(out, want) < 1e-5
    hlo = jax.jit(f).lower(a, b, bias, tile).as_text()
    assert re.search(r"dot_general.*-> tensor<%s2x44xf32>" % "".join(f"{d}x" for d in lead), hlo)

    def loss(f, *args):
        return jnp.sum(jnp.sin(f(*args)))

    def plain(a, b, bias, tile):
        opa = jnp.swapaxes(a, -1, -2) if ta else a
        opb = jnp.swapaxes(b, -1, -2) if tb else b
        return jax.nn.gelu(opa @ opb + bias) * tile

    got = jax.grad(partial(loss, f), argnums=(0, 1, 2, 3))(a, b, bias, tile)
    ref = jax.grad(partial(loss, plain), argnums=(0, 1, 2, 3))(a, b, bias, tile)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and rel_err(g, f32(r)) < 1e-5


def test_dynamic_scalars_do_not_retrace(rng):
    a, b, c = arrays(rng, (32, 16), (16, 24), (32, 24))
    traces = []

    @jax.jit
    def f(a, b, c, beta):
        traces.append(1)
        return efc.gemm(a, b, lambda acc, c, *, alpha, beta: acc * alpha + c * beta, c,
                        alpha=2.0, beta=beta)

    acc = f32(a) @ f32(b)
    for beta in (0.5, -1.25, 3.0):
        assert rel_err(f(a, b, c, jnp.float32(beta)), 2 * acc + beta * f32(c)) < 1e-5
    assert len(traces) == 1


def test_static_scalars_are_baked(rng):
    a, b = arrays(rng, (8, 8), (8, 8))
    static = jax.make_jaxpr(lambda a, b: efc.gemm(a, b, lambda acc, *, s: acc * s, s=3.0))(a, b)
    dynamic = jax.make_jaxpr(lambda a, b, s: efc.gemm(a, b, lambda acc, *, s: acc * s, s=s))(
        a, b, jnp.float32(3.0))
    (eqn,) = fused_gemm_eqns(static)
    assert len(eqn.invars) == 2 and any(i.op == "const" and i.attr == 3.0 for i in eqn.params["ir"].instrs)
    (eqn,) = fused_gemm_eqns(dynamic)
    assert len(eqn.invars) == 3
    assert rel_err(efc.gemm(a, b, lambda acc, *, s: acc * s, s=3.0), 3 * (f32(a) @ f32(b))) < 1e-6


def test_float64_epilogue_runs_in_float64(rng):
    """With x64 on, float64 inputs accumulate and run their epilogue in float64 (not the
    float32 default of narrower inputs), operands and run-time scalars included."""
    with jax.enable_x64(True):
        a, b, c = (jnp.asarray(rng.standard_normal(s)) for s in [(64, 32), (32, 48), (64, 48)])
        y = efc.gemm(a, b, lambda acc, c, *, s: jnp.tanh(acc * s) + c, c, s=jnp.float64(0.3))
        want = np.tanh((np.asarray(a) @ np.asarray(b)) * 0.3) + np.asarray(c)
        assert y.dtype == jnp.float64 and rel_err(y, want) < 1e-13
        g = efc.fused_dense(a, b, activation="gelu")
        assert rel_err(g, jax.nn.gelu(a @ b, approximate=False)) < 1e-13


def test_jit_matches_eager(rng):
    a, b, c, x = arrays(rng, (48, 32), (32, 40), (48, 40), (48, 40))
    kw = dict(alpha=1.5, beta=-0.5, x_factor=2.0)
    eager = efc.gemm(a, b, alpha_beta, c, x, **kw)
    jitted = jax.jit(lambda *t: efc.gemm(*t[:2], alpha_beta, *t[2:], **kw))(a, b, c, x)
    np.testing.assert_allclose(jitted["D"], eager["D"], rtol=1e-6, atol=1e-6)


def test_disable_and_strict(rng, monkeypatch):
    a, b = arrays(rng, (8, 8), (8, 8))
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    with pytest.raises(efc.FallbackError, match="no jax_efc kernel"):
        jax.jit(lambda a, b: efc.gemm(a, b, lambda acc: acc * 1.0001))(a, b)
    monkeypatch.delenv("JAX_EFC_STRICT")
    monkeypatch.setenv("JAX_EFC_DISABLE", "1")
    assert rel_err(jax.jit(lambda a, b: efc.gemm(a, b, lambda acc: acc * 1.0002))(a, b),
                   1.0002 * (f32(a) @ f32(b))) < 1e-6
