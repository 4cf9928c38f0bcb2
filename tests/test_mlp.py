"""fused_mlp: the output and every gradient against JAX's autodiff of the same MLP, and its
arguments checked."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc

from conftest import rel_err


def _mlp(x, up_k, up_b, down_k, down_b, gate_k=None, gate_b=None, *, act):
    """The MLP in plain JAX, layer by layer."""
    def lin(h, k, b):
        return h @ k + (0.0 if b is None else b)
    hidden = act(lin(x, up_k, up_b)) if gate_k is None else act(lin(x, gate_k, gate_b)) * lin(x, up_k, up_b)
    return lin(hidden, down_k, down_b)


def _params(rng, k, h, d, gated, bias):
    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    up = (normal(k, h, scale=k ** -0.5), normal(h) if bias else None)
    down = (normal(h, d, scale=h ** -0.5), normal(d) if bias else None)
    gate = (normal(k, h, scale=k ** -0.5), normal(h) if bias else None) if gated else ()
    return (*up, *down, *gate)


@pytest.mark.parametrize("gated,activation,act", [
    pytest.param(False, "gelu_tanh", jax.nn.gelu, id="gelu_tanh"),
    pytest.param(False, "relu", jax.nn.relu, id="relu"),
    pytest.param(True, "silu", jax.nn.silu, id="gated_silu"),
    pytest.param(True, "gelu", lambda z: jax.nn.gelu(z, approximate=False), id="gated_gelu"),
])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_output_and_gradients_match_autodiff(rng, gated, activation, act, bias):
    x = jnp.asarray(rng.standard_normal((2, 24, 16)), jnp.float32)
    params = _params(rng, 16, 48, 8, gated, bias)

    def ours(x, *p):
        gate = dict(gate_kernel=p[4], gate_bias=p[5]) if gated else {}
        return efc.fused_mlp(x, *p[:4], activation=activation, **gate)

    def ref(x, *p):
        return _mlp(x, *p, act=act)

    y, pullback = jax.vjp(jax.jit(ours), x, *params)
    y_ref, pullback_ref = jax.vjp(ref, x, *params)
    assert y.shape == (2, 24, 8) and rel_err(y, y_ref) < 1e-5
    ct = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    grads, grads_ref = pullback(ct), pullback_ref(ct)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        if g_ref is None:
            assert g is None
            continue
        assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
        assert rel_err(g, g_ref) < 1e-5, i


@jax.custom_jvp
def _doubled(z):
    return 2.0 * z


@_doubled.defjvp
def _doubled_jvp(primals, tangents):
    """A derivative the kernel cannot fuse (``erf_inv``), whose value is still 2."""
    (z,), (t,) = primals, tangents
    return 2.0 * z, 2.0 * t + 0.0 * jax.lax.erf_inv(0.5 * jnp.tanh(z))


def test_a_derivative_the_kernel_cannot_fuse_runs_unfused(rng, caplog):
    x = jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)
    params = _params(rng, 16, 32, 8, False, True)
    with caplog.at_level(logging.WARNING, logger="jax_efc"):
        loss = lambda *a: efc.fused_mlp(*a, activation=_doubled).sum()  # noqa: E731
        grads = jax.grad(loss, argnums=(0, 1, 2))(x, *params)
    assert any("unfused" in r.getMessage() and "erf_inv" in r.getMessage() for r in caplog.records)
    want = jax.grad(lambda *a: _mlp(*a, act=lambda z: 2.0 * z).sum(), argnums=(0, 1, 2))(x, *params)
    for g, g_ref in zip(grads, want):
        assert rel_err(g, g_ref) < 1e-5


def test_bf16_gradients_keep_their_dtypes(rng):
    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    params = tuple(p.astype(jnp.bfloat16) for p in _params(rng, 16, 32, 16, True, True))
    grads = jax.jit(jax.grad(lambda *a: efc.fused_mlp(*a[:5], activation="silu", gate_kernel=a[5],
                                                      gate_bias=a[6]).astype(jnp.float32).sum(),
                             argnums=tuple(range(7))))(x, *params)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 7
    assert [g.shape for g in grads] == [x.shape] + [p.shape for p in params]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_bias_gradients_are_column_sums_in_the_data_gradients_epilogue(rng, gated):
    """The first layers' bias gradients are reductions of the down projection's data-gradient
    GEMM (no XLA sum reads the hidden cotangent back), and the only ones in the step."""
    from jax_efc.primitive import fused_gemm_eqns

    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    params = tuple(p.astype(jnp.bfloat16) for p in _params(rng, 16, 32, 16, gated, True))

    def loss(*a):
        gate = dict(gate_kernel=a[5], gate_bias=a[6]) if gated else {}
        return efc.fused_mlp(*a[:5], activation="silu", **gate).astype(jnp.float32).sum()

    eqns = fused_gemm_eqns(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(params) + 1))))(x, *params))
    reducing = [e for e in eqns if any(o.reduce for o in e.params["ir"].outputs)]
    assert len(reducing) == 1
    assert sum(bool(o.reduce) for o in reducing[0].params["ir"].outputs) == 1 + gated


@pytest.mark.parametrize("change,message", [
    (dict(up_kernel=np.zeros((15, 32))), r"up_kernel has shape \(15, 32\); expected \(16, N\)"),
    (dict(up_bias=np.zeros(31)), r"up_bias has shape \(31,\); expected \(32,\)"),
    (dict(down_kernel=np.zeros((31, 8))), r"down_kernel has shape \(31, 8\); expected \(32, N\)"),
    (dict(gate_kernel=np.zeros((16, 31))), r"gate_kernel has shape \(16, 31\); expected \(16, 32\)"),
    (dict(gate_bias=np.zeros(32)), "gate_bias given without gate_kernel"),
])
def test_bad_arguments_are_named(change, message):
    args = dict(x=np.zeros((4, 16)), up_kernel=np.zeros((16, 32)), up_bias=np.zeros(32),
                down_kernel=np.zeros((32, 8)), down_bias=np.zeros(8))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        efc.fused_mlp(**args)


@pytest.mark.parametrize("per_example_weights", [False, True], ids=["shared_weights", "per_example_weights"])
def test_vmap(rng, per_example_weights):
    x = jnp.asarray(rng.standard_normal((3, 8, 16)), jnp.float32)
    params = _params(rng, 16, 32, 8, False, True)
    if per_example_weights:
        params = tuple(jnp.stack([p * (1 + i) for i in range(3)]) for p in params)
    axes = (0,) + ((0,) if per_example_weights else (None,)) * 4

    def loss(fn):
        return lambda *a: jnp.sum(jax.vmap(fn, axes)(*a) ** 2)

    ours = loss(lambda *a: efc.fused_mlp(*a, activation="gelu_tanh"))
    ref = loss(lambda *a: _mlp(*a, act=jax.nn.gelu))
    assert abs(float(ours(x, *params)) / float(ref(x, *params)) - 1) < 1e-5
    for g, g_ref in zip(jax.grad(ours, argnums=(0, 1, 4))(x, *params), jax.grad(ref, argnums=(0, 1, 4))(x, *params)):
        assert rel_err(g, g_ref) < 1e-5
