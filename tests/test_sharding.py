"""Partitioning like a dot: sharded jit, shard_map and pmap on 8 host devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from conftest import rel_err


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def layer(x, w, bias, r):
    return efc.fused_dense(x, w, bias, activation="gelu", residual=r)


def plain_layer(x, w, bias, r):
    return jax.nn.gelu(x @ w + bias, approximate=False) + r


def data(rng, m=64, k=32, n=48):
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(m, k), (k, n), (n,), (m, n)]]


CASES = {
    # name: (x, w, bias, residual) specs, collectives that must not appear in the forward HLO
    "data-parallel": ((P("data", None), P(None, None), P(None), P("data", None)), ("all-gather", "all-reduce")),
    "tp-column": ((P(None, None), P(None, "model"), P("model"), P(None, "model")), ("all-gather", "all-reduce")),
    "dp+tp-column": ((P("data", None), P(None, "model"), P("model"), P("data", "model")), ("all-gather", "all-reduce")),
    "tp-row": ((P(None, "model"), P("model", None), P(None), P(None, None)), ("all-gather",)),
    "dp+tp-row": ((P("data", "model"), P("model", None), P(None), P("data", None)), ("all-gather",)),
    # FSDP: rows and the weight's K both over "data"; the weight is gathered, nothing summed
    "fsdp": ((P("data", None), P("data", None), P(None), P("data", None)), ("all-reduce",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_jit(rng, mesh, case):
    specs, forbidden = CASES[case]
    args = data(rng)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    f = jax.jit(layer)
    y = f(*sharded)
    assert rel_err(y, plain_layer(*args)) < 1e-5
    hlo = f.lower(*sharded).compile().as_text()
    for op in forbidden:
        assert op not in hlo, f"{case}: the forward pass has an {op}"
    if case.endswith("row"):
        assert "all-reduce" in hlo  # partial products are summed before the epilogue
    if case == "fsdp":
        assert "all-gather" in hlo  # the weight, gathered for the layer
    # the output keeps the rows' and the columns' sharding: nothing was replicated
    x_spec, w_spec = specs[0], specs[1]
    want = P(x_spec[0], w_spec[1])
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, want), 2)

    loss = lambda fn: lambda *t: jnp.sum(fn(*t) ** 2)  # noqa: E731
    g = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*sharded)
    r = jax.grad(loss(plain_layer), argnums=(0, 1, 2, 3))(*args)
    for u, v in zip(g, r):
        assert rel_err(u, v) < 1e-5


@pytest.mark.parametrize("out_dtype, partials", [("bfloat16", "bf16"), ("float16", "f16"), ("float32", "f32"),
                                                 ("int8", "f32"), ("float8_e4m3fn", "f32")])
def test_row_parallel_partials_travel_in_the_output_dtype(rng, mesh, out_dtype, partials, tmp_path):
    """K sharded on both sides: the partial products are summed in a 16-bit float output's
    dtype, as XLA sums a dot's (bf16 outputs send half the bytes of fp32 partials), and in fp32
    for wider, narrower or integer outputs. Read from the program as partitioned: the CPU
    compiler widens 16-bit all-reduces afterwards."""
    x, w, bias = (jnp.asarray(rng.standard_normal(s) * f, jnp.bfloat16)
                  for s, f in (((64, 32), 1.0), ((32, 48), 32**-0.5), ((48,), 1.0)))
    specs = (P(None, "model"), P("model", None), P(None))
    sharded = [jax.device_put(t, NamedSharding(mesh, s)) for t, s in zip((x, w, bias), specs)]
    f = jax.jit(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu_tanh", out_dtype=out_dtype))
    y = f(*sharded)
    assert y.dtype == out_dtype
    as32 = [np.asarray(t, np.float32) for t in (x, w, bias)]
    want = jax.nn.gelu(as32[0] @ as32[1] + as32[2]).astype(out_dtype)
    if partials != "f32" or out_dtype == "float32":
        assert rel_err(np.asarray(y, np.float32), want) < 1e-2
    else:  # rounded to int8 or fp8 from fp32 sums: equal to the reference rounded, but where
        # the two sums' last bits straddle a rounding boundary
        assert np.mean(np.asarray(y, np.float32) != np.asarray(want, np.float32)) < 0.01
    f.lower(*sharded).compile({"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "spmd-partitioning"})
    (dump,) = tmp_path.glob("*after_spmd-partitioning*.txt")
    reduces = [line for line in dump.read_text().splitlines() if re.search(r" all-reduce\(", line)]
    assert len(reduces) == 1
    assert re.findall(r"\b(bf16|f16|f32)\[", reduces[0].split("all-reduce(")[0]) == [partials]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "gated_silu"])
def test_sharded_fused_mlp(rng, mesh, gated):
    """A tensor-parallel MLP (up and gate split by columns, down by rows) on a data-parallel
    batch: the output and every gradient match the unsharded plain MLP."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    x, up_k, up_b, down_k, down_b = normal(64, 32), normal(32, 48), normal(48), normal(48, 16), normal(16)
    gate = [normal(32, 48), normal(48)] if gated else []
    specs = [P("data", None), P(None, "model"), P("model"), P("model", None), P(None)] + \
        [P(None, "model"), P("model")] * gated
    act = "silu" if gated else "gelu_tanh"

    def ours(x, up_k, up_b, down_k, down_b, *g):
        return efc.fused_mlp(x, up_k, up_b, down_k, down_b, activation=act,
                             **dict(zip(("gate_kernel", "gate_bias"), g)))

    def plain(x, up_k, up_b, down_k, down_b, *g):
        up = x @ up_k + up_b
        hidden = jax.nn.silu(x @ g[0] + g[1]) * up if gated else jax.nn.gelu(up)
        return hidden @ down_k + down_b

    args = [x, up_k, up_b, down_k, down_b, *gate]
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    argnums = tuple(range(len(args)))
    y, g = jax.jit(lambda *a: (ours(*a), jax.grad(lambda *b: jnp.sum(ours(*b) ** 2), argnums)(*a)))(*sharded)
    assert rel_err(y, plain(*args)) < 1e-5
    for u, v in zip(g, jax.grad(lambda *b: jnp.sum(plain(*b) ** 2), argnums)(*args)):
        assert rel_err(u, v) < 1e-5


def test_batched_gemm_sharded_over_l(rng, mesh):
    a, b, c = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(4, 16, 8), (4, 8, 24), (4, 16, 24)])
    spec = NamedSharding(mesh, P("data", None, "model"))
    f = jax.jit(lambda a, b, c: efc.gemm(a, b, lambda acc, c: jnp.tanh(acc) * c, c))
    args = (jax.device_put(a, NamedSharding(mesh, P("data"))), jax.device_put(b, spec), jax.device_put(c, spec))
    y = f(*args)
    assert rel_err(y, np.tanh(np.asarray(a) @ np.asarray(b)) * np.asarray(c)) < 1e-5
    assert "all-gather" not in f.lower(*args).compile().as_text()


def sgd_step(fn):
    def step(params, x, y):
        def loss(params):
            h = fn(x, params["w1"], params["b1"])
            return jnp.mean((h @ params["w2"] - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def params_and_batch(rng):
    p = {"w1": rng.standard_normal((16, 32)) * 0.3, "b1": rng.standard_normal(32) * 0.1,
         "w2": rng.standard_normal((32, 4)) * 0.3}
    p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(64, 16), (64, 4)])
    return p, x, y


ours = sgd_step(lambda x, w, b: efc.fused_dense(x, w, b, activation="silu"))
plain = sgd_step(lambda x, w, b: jax.nn.silu(x @ w + b))


def test_shard_map_training_step(rng, mesh):
    """A data-parallel step in shard_map: our layer and plain JAX give the same losses and
    parameters, and the first loss equals the unsharded one."""
    params, x, y = params_and_batch(rng)

    def sharded(step):
        def body(params, x, y):
            loss, new = step(params, x, y)
            return jax.lax.pmean(loss, "data"), new

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                     out_specs=(P(), P())))

    ours_step, plain_step = sharded(ours), sharded(plain)
    got, want = params, params
    for i in range(3):
        loss, got = ours_step(got, x, y)
        want_loss, want = plain_step(want, x, y)
        assert abs(float(loss) - float(want_loss)) < 1e-5 * max(1.0, abs(float(want_loss)))
        if i == 0:
            assert abs(float(loss) - float(plain(params, x, y)[0])) < 1e-5
    for k in got:
        assert rel_err(got[k], want[k]) < 1e-5


def test_shard_map_gradient_of_an_epilogue_that_does_not_keep_the_accumulator(rng, mesh):
    """Under shard_map an epilogue linear in the accumulator (which the backward does not keep)
    differentiates with cotangents that vary over the mesh axis, as plain JAX's does."""
    a = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)

    def grads(f):
        body = jax.grad(lambda a, b, c: jnp.sum(jnp.sin(f(a, b, c))), (0, 1, 2))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                     out_specs=(P("data"), P(), P("data")), check_vma=True))(a, b, c)

    ours = grads(lambda a, b, c: efc.gemm(a, b, lambda acc, c: 2 * acc + c, c))
    plain = grads(lambda a, b, c: 2 * (a @ b) + c)
    for g, h in zip(ours, plain):
        assert rel_err(g, h) < 1e-5


def test_shard_map_program_exports(rng):
    """A shard_map program holding the op goes through jax.export and runs from it (a sharded
    jit that leaves the op to the partitioner does not: custom_partitioning's rule is a
    Python callback)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    specs = (P("data", None), P(None, "model"), P("model"), P("data", "model"))
    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P("data", "model")))
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(data(rng), specs)]
    exported = jax.export.export(f)(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in args))
    assert exported.nr_devices == 8
    y = exported.call(*args)
    assert rel_err(y, plain_layer(*args)) < 1e-5


def test_shard_map_tensor_parallel_local_shapes(rng, mesh):
    x, w, bias, r = data(rng)
    f = jax.shard_map(layer, mesh=mesh, in_specs=(P("data"), P(None, "model"), P("model"), P("data", "model")),
                      out_specs=P("data", "model"))
    assert rel_err(jax.jit(f)(x, w, bias, r), plain_layer(x, w, bias, r)) < 1e-5
    g = jax.grad(lambda *t: jnp.sum(f(*t) ** 2), argnums=(0, 1, 2, 3))(x, w, bias, r)
    want = jax.grad(lambda *t: jnp.sum(plain_layer(*t) ** 2), argnums=(0, 1, 2, 3))(x, w, bias, r)
    for u, v in zip(g, want):
        assert rel_err(u, v) < 1e-5


def test_pmap_training_step(rng):
    params, x, y = params_and_batch(rng)
    n = jax.local_device_count()

    def body(params, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((efc.fused_dense(x, p["w1"], p["b1"], activation="silu") @ p["w2"] - y) ** 2)
        )(params)
        return jax.lax.pmean(loss, "i"), jax.lax.pmean(grads, "i")

    loss, grads = jax.pmap(body, axis_name="i", in_axes=(None, 0, 0))(
        params, x.reshape(n, -1, 16), y.reshape(n, -1, 4))
    want_loss, want_grads = jax.value_and_grad(
        lambda p: jnp.mean((jax.nn.silu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2))(params)
    assert abs(float(loss[0]) - float(want_loss)) < 1e-5
    for k in grads:
        assert rel_err(grads[k][0], want_grads[k]) < 1e-5


def test_sharded_training_example():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "sharded_training.py"), "--cpu-devices", "8",
         "--steps", "2", "--batch", "32", "--width", "64", "--hidden", "128"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "forward all-gathers an activation: False" in out.stdout


def test_row_parallel_partial_products_leave_sms_to_the_all_reduce(rng, mesh, monkeypatch):
    """The GEMM of the partial products a psum adds up is bound with ``feeds_collective``, whose
    plan leaves ``COLLECTIVE_SM_MARGIN`` SMs free; the column-parallel GEMM (no collective after
    it) takes every SM."""
    from jax_efc import plan, sharding

    seen = []
    local = sharding._local

    def spy(primitive, params, a, b, ops):
        seen.append(params["feeds_collective"])
        return local(primitive, params, a, b, ops)

    monkeypatch.setattr(sharding, "_local", spy)
    args = data(rng, m=48, k=64, n=24)  # shapes no other test compiles: the partitioner runs anew
    for specs, want in (((P(None, "model"), P("model", None), P(None), P(None, None)), True),
                        ((P(None, None), P(None, "model"), P("model"), P(None, "model")), False)):
        seen.clear()
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        jax.jit(layer).lower(*sharded).compile()
        assert (True in seen) == want, (specs, seen)
        assert plan.sm_margin({"feeds_collective": want}) == (plan.COLLECTIVE_SM_MARGIN if want else 0)
