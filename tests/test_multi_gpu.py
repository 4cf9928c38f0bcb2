"""The sharding scenarios of test_sharding.py on several GPUs, with the kernel path
(JAX_EFC_STRICT makes any fallback an error): sharded jit (data parallel, tensor-parallel
column and row, both, FSDP), shard_map and pmap, forward and backward, and the collective
matmuls, in bf16 against plain JAX in float32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from conftest import rel_err
from test_sharding import CASES, layer, plain_layer

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


def _gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


# (data, model) meshes: each axis alone on two GPUs, and both at once on four or more
MESHES = [(2, 1), (1, 2)] + ([(2, _gpus() // 2)] if _gpus() >= 4 else [])


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


@pytest.fixture(params=MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def mesh(request):
    if _gpus() < 2:
        pytest.skip("needs two or more GPUs")
    return jax.make_mesh(request.param, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices("gpu")[: request.param[0] * request.param[1]])


def bf16(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def f32(x):
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_jit(rng, mesh, case):
    specs, forbidden = CASES[case]
    m, k, n = 512, 256, 384
    args = [bf16(rng, m, k), bf16(rng, k, n, scale=k**-0.5), bf16(rng, n), bf16(rng, m, n)]
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    f = jax.jit(layer)
    y = f(*sharded)
    assert rel_err(f32(y), plain_layer(*map(f32, args))) < BF16_TOL
    hlo = f.lower(*sharded).compile().as_text()
    assert "CuteDSLRT" in hlo
    for op in forbidden:
        assert op not in hlo, f"{case}: the forward pass has an {op}"
    if case.endswith("row") and mesh.shape["model"] > 1:  # partial products travel in bf16, as XLA's do
        reduces = [line.split("all-reduce")[0] for line in hlo.splitlines()
                   if re.search(r" all-reduce(-start)?\(", line)]
        assert reduces and all("bf16[" in r and "f32[" not in r for r in reduces)

    loss = lambda fn: lambda *t: jnp.sum(f32(fn(*t)) ** 2)  # noqa: E731
    g = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*sharded)
    r = jax.grad(loss(plain_layer), argnums=(0, 1, 2, 3))(*map(f32, args))
    for u, v in zip(g, r):
        assert rel_err(f32(u), v) < BF16_TOL


def params_and_batch(rng, m=512, k=256, h=384, n=64):
    params = {"w1": bf16(rng, k, h, scale=k**-0.5), "b1": bf16(rng, h, scale=0.1),
              "w2": bf16(rng, h, n, scale=h**-0.5)}
    return params, bf16(rng, m, k), bf16(rng, m, n)


def loss(dense, params, x, y):
    return jnp.mean((f32(dense(x, params["w1"], params["b1"])) @ f32(params["w2"]) - f32(y)) ** 2)


def ours(x, w, b):
    return efc.fused_dense(x, w, b, activation="silu")


def plain(x, w, b):
    return jax.nn.silu(f32(x) @ f32(w) + f32(b))


def step(dense, axis):
    """A data-parallel training step's loss and gradients, averaged over ``axis``."""
    def run(params, x, y):
        value, grads = jax.value_and_grad(lambda p: loss(dense, p, x, y))(params)
        return jax.lax.pmean(value, axis), jax.lax.pmean(grads, axis)

    return run


def check_steps(parallel, axis, *args):
    """The step on the kernel path against the same step in float32 plain JAX, both run by
    ``parallel`` (shard_map or pmap): the loss and every gradient."""
    (value, grads), (want_value, want) = (parallel(step(dense, axis))(*args) for dense in (ours, plain))
    assert abs(float(value) - float(want_value)) < BF16_TOL * abs(float(want_value))
    for key in want:
        assert rel_err(f32(grads[key]), want[key]) < BF16_TOL, key


def test_shard_map_training_step(rng, mesh):
    def parallel(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                     out_specs=(P(), P())))

    check_steps(parallel, "data", *params_and_batch(rng))


def test_pmap_training_step(rng):
    if _gpus() < 2:
        pytest.skip("needs two or more GPUs")
    n = _gpus()
    params, x, y = params_and_batch(rng, m=256 * n)

    def parallel(fn):  # every device holds the same averages: keep the first's
        mapped = jax.pmap(fn, axis_name="i", in_axes=(None, 0, 0))
        return lambda *args: jax.tree.map(lambda t: t[0], mapped(*args))

    check_steps(parallel, "i", params, x.reshape(n, -1, x.shape[1]), y.reshape(n, -1, y.shape[1]))


def test_collective_matmuls(rng):
    """efc.all_gather_dense and efc.dense_reduce_scatter on every GPU (the kernel path), against
    the collective followed by the layer in plain JAX, in bf16."""
    if _gpus() < 2:
        pytest.skip("needs two or more GPUs")
    n = _gpus()
    mesh = jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu"))
    x, w, b = bf16(rng, 512 * n, 1024), bf16(rng, 1024, 768 * n, scale=1024 ** -0.5), bf16(rng, 768 * n)

    def run(fn, in_specs, out_specs, *args):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*args)

    specs = (P("model"), P(None, "model"), P("model"))
    got = run(lambda x, w, b: efc.all_gather_dense(x, w, b, axis_name="model", activation="gelu_tanh"),
              specs, P(None, "model"), x, w, b)
    want = jax.nn.gelu(f32(x) @ f32(w) + f32(b))
    assert rel_err(f32(got), want) < BF16_TOL
    w2, b2 = bf16(rng, 768 * n, 1024, scale=(768 * n) ** -0.5), bf16(rng, 1024)
    h = bf16(rng, 512 * n, 768 * n)
    got = run(lambda h, w, b: efc.dense_reduce_scatter(h, w, b, axis_name="model", activation="relu"),
              (P(None, "model"), P("model"), P()), P("model"), h, w2, b2)
    want = jax.nn.relu(f32(h) @ f32(w2) + f32(b2))
    assert rel_err(f32(got), want) < BF16_TOL
