"""Gated GEMMs (``gemm(..., gated=B)``): the interleaved layout's helpers, numerics against a
float64 oracle built from the two separate matrices, autodiff against the two-matrix
formulation, vmap, sharding, and errors naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from conftest import rel_err


def swiglu(g, u, bg, bu):
    return jax.nn.silu(g + bg) * (u + bu)


def geglu(g, u, bg, bu):
    return jax.nn.gelu(g + bg, approximate=False) * (u + bu)


def silu64(v):
    return v / (1 + np.exp(-v))


def gelu64(v):
    return 0.5 * v * (1 + scipy.special.erf(v / np.sqrt(2)))


def oracle(x, wg, wu, bg, bu, act):
    """act(x @ wg + bg) * (x @ wu + bu) in float64 from the separate matrices (``act`` on NumPy
    arrays)."""
    f = lambda v: np.asarray(v, np.float64)  # noqa: E731
    g, u = f(x) @ f(wg) + f(bg), f(x) @ f(wu) + f(bu)
    return act(g) * u


def data(rng, m, k, n, dtype=jnp.float32, lead=()):
    x = jnp.asarray(rng.standard_normal((*lead, m, k)), dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for _ in range(2))
    bg, bu = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(2))
    return x, wg, wu, bg, bu


@pytest.mark.parametrize("block", [8, 64])
def test_interleave_and_split_round_trip(rng, block):
    gate, up = (rng.standard_normal((3, 5, 4 * block)).astype(np.float32) for _ in range(2))
    w = efc.interleave_gated(gate, up, block=block)
    assert w.shape == (3, 5, 8 * block)
    np.testing.assert_array_equal(w[..., :block], gate[..., :block])
    np.testing.assert_array_equal(w[..., block: 2 * block], up[..., :block])
    np.testing.assert_array_equal(w[..., 2 * block: 3 * block], gate[..., block: 2 * block])
    g, u = efc.split_gated(w, block=block)
    np.testing.assert_array_equal(g, gate)
    np.testing.assert_array_equal(u, up)


@pytest.mark.parametrize("call, error, match", [
    (lambda: efc.interleave_gated(np.zeros(16), np.zeros(8), block=8), ValueError, "one shape"),
    (lambda: efc.interleave_gated(np.zeros(12), np.zeros(12), block=8), ValueError, "multiple of block=8"),
    (lambda: efc.interleave_gated(np.zeros(16), np.zeros(16), block=12), ValueError, r"block=12"),
    (lambda: efc.interleave_gated(np.zeros(8, np.float32), np.zeros(8, np.float16), block=8), TypeError, "cast"),
    (lambda: efc.split_gated(np.zeros(24), block=8), ValueError, "multiple of 2 \\* block = 16"),
    (lambda: efc.split_gated(np.zeros(32), block=True), ValueError, "block=True"),
])
def test_helpers_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("act, epi", [(silu64, swiglu), (gelu64, geglu)])
@pytest.mark.parametrize("m, k, n, block", [(100, 48, 128, 32), (33, 40, 192, 64), (7, 16, 16, 8)])
def test_matches_the_two_matrix_oracle(rng, act, epi, m, k, n, block):
    x, wg, wu, bg, bu = data(rng, m, k, n)
    w = efc.interleave_gated(wg, wu, block)
    y = efc.gemm(x, w, epi, bg, bu, gated=block, out_dtypes=jnp.float32)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert rel_err(y, oracle(x, wg, wu, bg, bu, act)) < 1e-5


def test_bf16_batched_and_jitted(rng):
    x, wg, wu, bg, bu = data(rng, 50, 64, 128, jnp.bfloat16, lead=(3,))
    w = efc.interleave_gated(wg, wu)
    y = jax.jit(lambda x, w: efc.gemm(x, w, swiglu, bg, bu, gated=64))(x, w)
    assert y.shape == (3, 50, 128) and y.dtype == jnp.bfloat16
    assert rel_err(y, oracle(x, wg, wu, bg, bu, silu64)) < 1e-2
    # a batched weight: one gated GEMM per batch
    wb = jnp.stack([w, 2 * w, -w])
    yb = efc.gemm(x, wb, lambda g, u: g * u, gated=64, out_dtypes=jnp.float32)
    expect = [oracle(x[i], s * wg, s * wu, 0 * bg, 0 * bu, lambda v: v) for i, s in enumerate((1, 2, -1))]
    assert rel_err(yb, np.stack(expect)) < 1e-2


def test_transposed_weight_and_tile_operands(rng):
    """B stored (2N, K) and read transposed, a tile operand and several outputs."""
    x, wg, wu, bg, _ = data(rng, 40, 32, 64)
    c = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    wt = efc.interleave_gated(wg, wu, 16).T
    out = efc.gemm(x, wt, lambda g, u, c: {"h": jax.nn.relu(g) * u + c, "g": g}, c, gated=16, transpose_b=True,
                   out_dtypes=jnp.float32)
    g = np.asarray(x, np.float64) @ np.asarray(wg, np.float64)
    u = np.asarray(x, np.float64) @ np.asarray(wu, np.float64)
    assert rel_err(out["h"], np.maximum(g, 0) * u + np.asarray(c)) < 1e-5
    assert rel_err(out["g"], g) < 1e-5


def two_matrices(x, wg, wu, bg, bu):
    return jax.nn.silu(x @ wg + bg) * (x @ wu + bu)


@pytest.mark.parametrize("recompute_acc", [False, True])
def test_gradients_match_the_two_matrix_formulation(rng, recompute_acc):
    x, wg, wu, bg, bu = data(rng, 96, 32, 64)
    ct = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)

    def fused(x, w, bg, bu):
        y = efc.gemm(x, w, swiglu, bg, bu, gated=16, out_dtypes=jnp.float32, recompute_acc=recompute_acc)
        return jnp.sum(y * ct)

    def plain(x, wg, wu, bg, bu):
        return jnp.sum(two_matrices(x, wg, wu, bg, bu) * ct)

    dx, dw, dbg, dbu = jax.grad(fused, argnums=(0, 1, 2, 3))(x, efc.interleave_gated(wg, wu, 16), bg, bu)
    ex, ewg, ewu, ebg, ebu = jax.grad(plain, argnums=(0, 1, 2, 3, 4))(x, wg, wu, bg, bu)
    dwg, dwu = efc.split_gated(dw, 16)
    for got, want in ((dx, ex), (dwg, ewg), (dwu, ewu), (dbg, ebg), (dbu, ebu)):
        assert rel_err(got, want) < 1e-5


def test_second_order(rng):
    """The primitive's JVP pairs the tangent's columns too: a Hessian-vector product."""
    x, wg, wu, bg, bu = data(rng, 16, 8, 16)
    w = efc.interleave_gated(wg, wu, 8)
    t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def f(x):
        return jnp.sum(efc.gemm(x, w, swiglu, bg, bu, gated=8, out_dtypes=jnp.float32) ** 2)

    def f_plain(x):
        return jnp.sum(two_matrices(x, wg, wu, bg, bu) ** 2)

    hvp = lambda fn: jax.vjp(jax.grad(fn), x)[1](t)[0]  # noqa: E731 - symmetric Hessian
    assert rel_err(hvp(f), hvp(f_plain)) < 1e-4


def test_vmap(rng):
    x, wg, wu, bg, bu = data(rng, 24, 32, 32, lead=(5,))
    w = efc.interleave_gated(wg, wu, 8)
    y = jax.vmap(lambda x: efc.gemm(x, w, swiglu, bg, bu, gated=8, out_dtypes=jnp.float32))(x)
    assert rel_err(y, oracle(x, wg, wu, bg, bu, silu64)) < 1e-5
    ws = jnp.stack([w] * 5)
    y2 = jax.vmap(lambda x, w: efc.gemm(x, w, swiglu, bg, bu, gated=8, out_dtypes=jnp.float32))(x, ws)
    assert rel_err(y2, y) < 1e-6


@pytest.mark.parametrize("block", [8, 32])
def test_column_sharded_weight(rng, block):
    """Each device's slice of a column-sharded weight holding whole pairs runs its columns; one
    that would split a pair (32-wide blocks over 4 devices of 32 columns) is gathered first."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, wg, wu, bg, bu = data(rng, 64, 32, 64)
    w = efc.interleave_gated(wg, wu, block)
    specs = (P("data", None), P(None, "model"), P("model"), P("model"))
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w, bg, bu), specs)]
    y = jax.jit(lambda x, w, bg, bu: efc.gemm(x, w, swiglu, bg, bu, gated=block, out_dtypes=jnp.float32))(*args)
    assert rel_err(y, oracle(x, wg, wu, bg, bu, silu64)) < 1e-5


@pytest.mark.parametrize("kw, error, match", [
    (dict(gated=0), ValueError, r"gated=0: the gated layout's block width must be a positive multiple of 8"),
    (dict(gated=12), ValueError, r"gated=12"),
    (dict(gated=48), ValueError, r"gated=48: op\(b\) has 128 columns, not a multiple of 96"),
    (dict(gated=32, epilogue=None), ValueError, r"gated: give an epilogue"),
    (dict(gated=32, epilogue=lambda acc: acc), Exception, r"tracing the epilogue failed"),
])
def test_bad_arguments_are_named(kw, error, match):
    x, w = jnp.ones((16, 8)), jnp.ones((8, 128))
    epilogue = kw.pop("epilogue", lambda g, u: g * u)
    with pytest.raises(error, match=match):
        efc.gemm(x, w, epilogue, **kw)


def test_block_width_is_part_of_the_program_key():
    """Two block widths with the same epilogue are different kernels."""
    x = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    irs = []
    for block in (32, 64):
        (eqn,) = efc.primitive.fused_gemm_eqns(jax.make_jaxpr(
            lambda x, w, block=block: efc.gemm(x, w, lambda g, u: g * u, gated=block))(x, w))
        irs.append(eqn.params["ir"])
    assert irs[0].gated == 32 and irs[1].gated == 64
    assert irs[0].fingerprint != irs[1].fingerprint
    assert irs[0] != irs[1]


@pytest.mark.parametrize("bias", [True, False])
def test_fused_mlp_on_interleaved_weights(rng, bias):
    """``fused_mlp(..., gated=B)``: one gated GEMM for gate and up; values and every gradient
    (in the interleaved layout) as the three-matrix formulation's."""
    k, h, d, block = 32, 64, 24, 16
    x = jnp.asarray(rng.standard_normal((2, 40, k)), jnp.float32)
    wg, wu, wd = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for s in ((k, h), (k, h), (h, d)))
    bg, bu, bd = (jnp.asarray(rng.standard_normal(s), jnp.float32) if bias else None for s in ((h,), (h,), (d,)))
    ct = jnp.asarray(rng.standard_normal((2, 40, d)), jnp.float32)

    def plain(x, wg, wu, wd, bg, bu, bd):
        gate, up = x @ wg, x @ wu
        if bias:
            gate, up = gate + bg, up + bu
        y = (jax.nn.silu(gate) * up) @ wd
        return jnp.sum((y + bd if bias else y) * ct)

    def fused(x, w, wd, b, bd):
        return jnp.sum(efc.fused_mlp(x, w, b, wd, bd, activation="silu", gated=block) * ct)

    w = efc.interleave_gated(wg, wu, block)
    b = efc.interleave_gated(bg, bu, block) if bias else None
    assert rel_err(fused(x, w, wd, b, bd), plain(x, wg, wu, wd, bg, bu, bd)) < 1e-5
    argnums = (0, 1, 2, 3, 4) if bias else (0, 1, 2)
    got = jax.grad(fused, argnums=argnums)(x, w, wd, b, bd)
    want = jax.grad(plain, argnums=tuple(range(7)) if bias else (0, 1, 2, 3))(x, wg, wu, wd, bg, bu, bd)
    assert rel_err(got[0], want[0]) < 1e-5
    assert rel_err(got[1], efc.interleave_gated(want[1], want[2], block)) < 1e-5
    assert rel_err(got[2], want[3]) < 1e-5
    if bias:
        assert rel_err(got[3], efc.interleave_gated(want[4], want[5], block)) < 1e-5
        assert rel_err(got[4], want[6]) < 1e-5


@pytest.mark.parametrize("kw, match", [
    (dict(gated=16, gate_kernel=np.zeros((32, 32), np.float32)), "not both"),
    (dict(gated=48), r"gated=48: up_kernel has 64 columns, not a multiple of 96"),
    (dict(gated=4), r"gated=4"),
])
def test_fused_mlp_gated_errors(kw, match):
    x, w, wd = np.zeros((4, 32), np.float32), np.zeros((32, 64), np.float32), np.zeros((32, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        efc.fused_mlp(x, w, None, wd, None, **kw)


def test_flax_modules_with_one_gate_up_layer(rng):
    """``FusedMLP(gated=True, gated_block=B)`` (linen and nnx) keeps gate and up as one
    interleaved layer and computes what the two-layer module computes on the split weights."""
    from flax import nnx

    from jax_efc.flax import nnx as efc_nnx
    from jax_efc.flax.linen import FusedMLP

    x = jnp.asarray(rng.standard_normal((4, 8, 32)), jnp.float32)
    module = FusedMLP(64, activation="silu", gated=True, gated_block=16)
    params = module.init(jax.random.key(0), x)
    gate_up = params["params"]["gate_up"]
    assert gate_up["kernel"].shape == (32, 128) and gate_up["bias"].shape == (128,)
    (gk, uk), (gb, ub) = efc.split_gated(gate_up["kernel"], 16), efc.split_gated(gate_up["bias"], 16)
    two = {"params": {"gate": {"kernel": gk, "bias": gb}, "up": {"kernel": uk, "bias": ub},
                      "down": params["params"]["down"]}}
    want = FusedMLP(64, activation="silu", gated=True).apply(two, x)
    assert rel_err(module.apply(params, x), want) < 1e-6
    grads = jax.grad(lambda p: jnp.sum(module.apply(p, x) ** 2))(params)
    assert grads["params"]["gate_up"]["kernel"].shape == (32, 128)

    mlp = efc_nnx.FusedMLP(32, 64, activation="silu", gated=True, gated_block=16, rngs=nnx.Rngs(0))
    assert mlp.gate_up.kernel[...].shape == (32, 128) and mlp(x).shape == (4, 8, 32)


@pytest.mark.parametrize("kw", [dict(gated_block=16), dict(gated=True, gated_block=16, fp8="delayed"),
                                dict(gated=True, gated_block=12)])
def test_flax_gated_block_is_checked_at_construction(kw):
    from jax_efc.flax.linen import FusedMLP

    with pytest.raises(ValueError, match="gated_block"):
        FusedMLP(64, **kw)


def test_the_benchmark_compares_one_gated_gemm_with_plain_jaxs_two():
    """The gated benchmark's inputs hold the interleaved weight of the two halves plain JAX
    multiplies, so both functions compute the same layer."""
    from jax_efc.bench import bench_problem

    problem = bench_problem("gated:swiglu", (64, 128, 32, 1), jnp.float32)
    x, wg, wu, w, bg, bu = inputs = problem.inputs(jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(efc.interleave_gated(wg, wu, 64)))
    assert rel_err(problem.ours(*inputs), problem.baseline(*inputs)) < 1e-5


def test_the_interleaved_mlp_step_benchmark_matches_plain_jax():
    """The gated MLP's training step on interleaved weights returns what plain JAX's two-GEMM
    step does, gradients split back into the gate's and the up projection's."""
    from jax_efc.bench import bench_problem

    problem = bench_problem("train:interleaved_mlp+silu", (64, 128, 32, 1), jnp.float32)
    inputs = problem.inputs(jax.random.key(4))
    ours, plain = problem.ours(*inputs), problem.baseline(*inputs)
    assert len(ours) == len(plain) == 8
    for got, want in zip(ours, plain):
        assert rel_err(got, want) < 1e-4
