"""Collective matmuls (``efc.all_gather_dense``, ``efc.dense_reduce_scatter``) inside shard_map
on 8 host devices: the same values and gradients as the collective followed by the layer in
plain JAX, for every device's block, with and without a bias, and the errors they raise."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_efc as efc
from conftest import rel_err


@pytest.fixture(params=[1, 4, 8], ids=lambda d: f"{d}dev")
def mesh(request):
    return jax.make_mesh((request.param,), ("model",), devices=jax.devices()[:request.param],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _run(mesh, body, in_specs, out_specs, *args):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*args)


@pytest.mark.parametrize("with_bias", [True, False])
def test_all_gather_dense_matches_the_gather_then_the_layer(rng, mesh, with_bias):
    devices = mesh.shape["model"]
    x = jnp.asarray(rng.standard_normal((8 * devices, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 16 * devices)) / 6, jnp.float32)
    b = jnp.asarray(rng.standard_normal(16 * devices), jnp.float32) if with_bias else None

    def ours(x, w, b):
        return efc.all_gather_dense(x, w, b, axis_name="model", activation="gelu_tanh")

    def plain(x, w, b):
        z = jax.lax.all_gather(x, "model", tiled=True) @ w
        return jax.nn.gelu(z + b if b is not None else z)

    def loss(f, x, w, b):
        return jnp.sum(jnp.sin(f(x, w, b)))

    specs = (P("model"), P(None, "model"), None if b is None else P("model"))
    got, want = (_run(mesh, f, specs, P(None, "model"), x, w, b) for f in (ours, plain))
    assert rel_err(got, want) < 1e-5
    grads = [_run(mesh, lambda x, w, b, f=f: jax.grad(partial(loss, f), (0, 1, 2) if b is not None else (0, 1))(x, w, b),
                  specs, tuple(specs[:2 + (b is not None)]), x, w, b) for f in (ours, plain)]
    for g, h in zip(*grads):
        assert rel_err(g, h) < 1e-5


@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_reduce_scatter_matches_the_layer_then_the_scatter(rng, mesh, with_bias):
    devices = mesh.shape["model"]
    x = jnp.asarray(rng.standard_normal((8 * devices, 16 * devices)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16 * devices, 24)) / 8, jnp.float32)
    b = jnp.asarray(rng.standard_normal(24), jnp.float32) if with_bias else None

    def ours(x, w, b):
        return efc.dense_reduce_scatter(x, w, b, axis_name="model", activation="gelu_tanh")

    def plain(x, w, b):
        part = jnp.matmul(x, w, preferred_element_type=jnp.float32)
        z = jax.lax.psum_scatter(part, "model", scatter_dimension=0, tiled=True)
        return jax.nn.gelu(z + b if b is not None else z).astype(x.dtype)

    specs = (P(None, "model"), P("model"), None if b is None else P())
    got, want = (_run(mesh, f, specs, P("model"), x, w, b) for f in (ours, plain))
    assert got.shape == want.shape == (8 * devices, 24)
    assert rel_err(got, want) < 1e-5
    # bf16 in, bf16 out, the partials summed in float32
    half = [v if v is None else v.astype(jnp.bfloat16) for v in (x, w, b)]
    got, want = (_run(mesh, f, specs, P("model"), *half) for f in (ours, plain))
    assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < 1e-2

    def loss(f, x, w, b):
        return jnp.sum(jnp.sin(f(x, w, b)))

    argnums = (0, 1, 2) if b is not None else (0, 1)
    grads = [_run(mesh, lambda x, w, b, f=f: jax.grad(partial(loss, f), argnums)(x, w, b), specs,
                  tuple(specs[:len(argnums)]), x, w, b) for f in (ours, plain)]
    for g, h in zip(*grads):
        assert rel_err(g, h) < 1e-5


def test_bad_arguments_are_named():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jnp.ones((6, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match="not a mesh axis here"):
        _run(mesh, lambda x, w: efc.all_gather_dense(x, w, axis_name="data"), (P("model"), P()), P(), x, w)
    with pytest.raises(TypeError, match="axis_name must be the name of a mesh axis"):
        _run(mesh, lambda x, w: efc.all_gather_dense(x, w, axis_name=0), (P("model"), P()), P(), x, w)
    with pytest.raises(ValueError, match=r"x must be \(m, K\) and kernel \(K, n\)"):
        _run(mesh, lambda x, w: efc.all_gather_dense(x[None], w, axis_name="model"), (P("model"), P()), P(), x, w)
    with pytest.raises(ValueError, match="not a multiple of the 2 devices"):
        _run(mesh, lambda x, w: efc.dense_reduce_scatter(x[:3], w, axis_name="model"), (P(), P()), P("model"), x, w)
