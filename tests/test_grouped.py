"""``efc.grouped_gemm`` (reference path): ``jax.lax.ragged_dot``'s meaning with a fused
epilogue, against a per-group float64 loop; gradients, traced group sizes, vmap, errors."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import run_for_sm90


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _oracle(lhs, rhs, sizes, bias, c, col):
    """epilogue(ragged product) row by row in float64; rows past the groups have product 0 and bias 0."""
    lhs, rhs, bias, c, col = (np.asarray(x, np.float64) for x in (lhs, rhs, bias, c, col))
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows] = _gelu(lhs[rows] @ rhs[g] + bias[g]) * c[rows] + col[rows]
        start += size
    out[start:] = _gelu(np.zeros_like(out[start:])) * c[start:] + col[start:]
    return out


def _epilogue(acc, c, col, bias):
    return jax.nn.gelu(acc + bias) * c + col


@pytest.mark.parametrize("sizes", [(16, 16, 16, 16), (50, 0, 3, 11), (0, 0, 64, 0), (10, 20, 5, 0)],
                         ids=["balanced", "skewed", "one_group", "rows_past_the_groups"])
def test_matches_a_per_group_float64_loop(rng, sizes):
    t, k, n, g = 64, 48, 40, len(sizes)
    lhs = jnp.asarray(rng.standard_normal((t, k)) / math.sqrt(k), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((g, n)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    col = jnp.asarray(rng.standard_normal((t, 1)), jnp.float32)
    y = efc.grouped_gemm(lhs, rhs, jnp.asarray(sizes), _epilogue, c, col, group_operands=[bias])
    assert y.shape == (t, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _oracle(lhs, rhs, sizes, bias, c, col), rtol=2e-5, atol=2e-5)


def test_a_negative_group_size_counts_as_zero(rng):
    """ragged_dot leaves negative sizes undefined (XLA's CPU reference mixed groups for them);
    grouped_gemm counts them as 0 on every backend, as the kernel's walk does."""
    lhs = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 8, 4)), jnp.float32)
    got = efc.grouped_gemm(lhs, rhs, jnp.asarray([3, -2, 9]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(efc.grouped_gemm(lhs, rhs, jnp.asarray([3, 0, 9]))))


def test_bf16_outputs_and_several_of_them(rng):
    t, k, n = 32, 64, 16
    lhs = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((2, k, n)), jnp.bfloat16)
    out = efc.grouped_gemm(lhs, rhs, jnp.array([12, 20]), lambda acc, *, s: {"y": acc * s, "acc": acc}, s=0.5,
                           out_dtypes={"y": jnp.bfloat16, "acc": jnp.float32})
    want = np.concatenate([np.asarray(lhs[:12], np.float64) @ np.asarray(rhs[0], np.float64),
                           np.asarray(lhs[12:], np.float64) @ np.asarray(rhs[1], np.float64)])
    assert out["y"].dtype == jnp.bfloat16 and out["acc"].dtype == jnp.float32
    assert np.abs(np.asarray(out["acc"], np.float64) - want).max() < 1e-3 * np.abs(want).max()
    assert np.abs(np.asarray(out["y"], np.float64) - want / 2).max() < 1e-2 * np.abs(want).max()


def test_gradients_match_plain_jax(rng):
    t, k, n, sizes = 24, 16, 8, jnp.array([10, 0, 14])
    lhs = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, n)), jnp.float32)
    group = jnp.repeat(jnp.arange(3), sizes, total_repeat_length=t)

    def ours(lhs, rhs, bias):
        return (efc.grouped_gemm(lhs, rhs, sizes, lambda acc, b: jnp.tanh(acc + b), group_operands=[bias]) ** 2).sum()

    def plain(lhs, rhs, bias):
        acc = jax.lax.ragged_dot(lhs, rhs, sizes)
        return (jnp.tanh(acc + bias[group]) ** 2).sum()

    for got, want in zip(jax.grad(ours, (0, 1, 2))(lhs, rhs, bias), jax.grad(plain, (0, 1, 2))(lhs, rhs, bias)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_traced_group_sizes_do_not_recompile(rng):
    traces = []
    lhs = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)

    @jax.jit
    def f(lhs, rhs, sizes):
        traces.append(1)
        return efc.grouped_gemm(lhs, rhs, sizes, jax.nn.relu)

    for sizes in ((8, 8, 8, 8), (32, 0, 0, 0), (1, 2, 3, 26)):
        y = f(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        want = jax.nn.relu(jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32)))
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert len(traces) == 1


def test_vmap_over_batches_of_tokens_and_experts(rng):
    lhs = jnp.asarray(rng.standard_normal((3, 20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 2, 8, 4)), jnp.float32)
    sizes = jnp.array([[5, 15], [20, 0], [0, 20]])
    y = jax.vmap(lambda x, w, s: efc.grouped_gemm(x, w, s, jnp.exp))(lhs, rhs, sizes)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(y[i]), np.asarray(jnp.exp(jax.lax.ragged_dot(lhs[i], rhs[i], sizes[i]))),
                                   rtol=1e-5)


def test_vmap_of_the_weight_gradient(rng):
    """Per-batch weight gradients (the weight gradient's GEMM under vmap) against ragged_dot's."""
    lhs = jnp.asarray(rng.standard_normal((3, 20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 2, 8, 4)), jnp.float32)
    sizes = jnp.array([[5, 15], [20, 0], [0, 12]])

    def d_rhs(product):
        return jax.vmap(jax.grad(lambda x, w, s: jnp.sum(jnp.sin(product(x, w, s))), argnums=1))(lhs, rhs, sizes)

    np.testing.assert_allclose(np.asarray(d_rhs(efc.grouped_gemm)), np.asarray(d_rhs(jax.lax.ragged_dot)),
                               rtol=1e-5, atol=1e-5)


def test_arguments_are_checked():
    lhs, rhs, sizes = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4])
    with pytest.raises(ValueError, match=r"lhs must be \(T, K\) and rhs \(G, K, N\)"):
        efc.grouped_gemm(lhs, rhs[0], sizes)
    with pytest.raises(ValueError, match="lhs has K=4 but rhs has K=5"):
        efc.grouped_gemm(lhs, jnp.ones((2, 5, 3)), sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be \(2,\) integers"):
        efc.grouped_gemm(lhs, rhs, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match=r"group operand 0 must be \(2, 3\)"):
        efc.grouped_gemm(lhs, rhs, sizes, lambda acc, b: acc + b, group_operands=[jnp.ones((3,))])
    with pytest.raises(TypeError, match="lhs is float32 but rhs is float16"):
        efc.grouped_gemm(lhs, rhs.astype(jnp.float16), sizes)
    with pytest.raises(efc.EpilogueError):
        efc.grouped_gemm(lhs, rhs, sizes, lambda acc: acc @ acc.T)
    with pytest.raises(ValueError, match="only config named by a string is 'autotune'"):
        efc.grouped_gemm(lhs, rhs, sizes, config="fast")
    with pytest.raises(TypeError, match="config must be a jax_efc.GemmConfig"):
        efc.grouped_gemm(lhs, rhs, sizes, config=(128, 128))


def test_first_use_check_groups_cross_every_edge():
    """The groups a grouped kernel is checked on hold a last tile that reaches into the next
    group, an empty group, one smaller than a tile and whole tiles; rows past them follow."""
    from jax_efc import checking

    for groups, tile_m in ((1, 128), (4, 128), (9, 192)):
        sizes = checking.check_group_sizes(groups, tile_m)
        assert len(sizes) == groups and sizes[0] % tile_m and sizes[0] > tile_m
        if groups >= 4:
            assert 0 in sizes and any(0 < s < tile_m for s in sizes) and 2 * tile_m in sizes


def test_an_unverified_grouped_kernel_is_checked_on_first_use(monkeypatch):
    """Planned without a GPU to check it on (an export for sm_90a from a CPU), an unverified
    grouped kernel (as it was before it ran on a GPU) is refused for its first-use check, saying
    so; with JAX_EFC_UNVERIFIED_KERNELS=1 it is planned; verified, it is planned."""
    pytest.importorskip("cutlass.jax")
    from jax_efc.plan import plan_grouped_call
    from jax_efc.epilogue import identity_ir
    from jax_efc.kernels.sm90_policy import Sm90Policy

    monkeypatch.setattr(Sm90Policy, "verified_grouped", False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    S = jax.ShapeDtypeStruct
    avals = [S((1024, 256), jnp.bfloat16), S((4, 256, 512), jnp.bfloat16), S((4,), jnp.int32)]
    params = dict(ir=identity_ir(jnp.bfloat16, jnp.float32), transpose_b=False, acc_dtype=np.dtype(np.float32),
                  precision=None, config=None)
    plan = plan_grouped_call(avals, params, devices=())
    assert plan.backend != "kernel" and "grouped (ragged) GEMM kernel" in plan.reason, plan.reason
    assert "to check it on first use" in plan.reason, plan.reason
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    assert plan_grouped_call(avals, params, devices=()).backend == "kernel"
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    monkeypatch.setattr(Sm90Policy, "verified_grouped", True)
    assert plan_grouped_call(avals, params, devices=()).backend == "kernel"


def test_backends_reports_grouped_calls(monkeypatch):
    """efc.backends judges a grouped call as its lowering would: the reference on a CPU, the
    grouped kernel for an sm_90a export."""
    pytest.importorskip("cutlass.jax")
    S = jax.ShapeDtypeStruct
    specs = [S((1024, 256), jnp.bfloat16), S((4, 256, 512), jnp.bfloat16), S((4,), jnp.int32)]
    fn = lambda x, w, s: efc.grouped_gemm(x, w, s, jax.nn.silu)  # noqa: E731
    assert efc.backends(fn, *specs) == ["reference: platform cpu has no jax_efc kernel"]
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert efc.backends(fn, *specs) == ["kernel (sm_90a)"]


_PARTITIONED = """
import os, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_efc as efc
efc.set_target_arch("sm_90a")
mesh = jax.make_mesh((4,), ("e",), axis_types=(jax.sharding.AxisType.Auto,))


def S(shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)) if spec else None)


def f(x, w, s):
    return efc.grouped_gemm(x, w, s, jax.nn.silu)


shapes = ((1024, 256), jnp.bfloat16), ((4, 256, 512), jnp.bfloat16), ((4,), jnp.int32)
calls = {
    "one device": (jax.jit(f), [S(*a) for a in shapes]),
    "jit over 4": (jax.jit(f), [S(*shapes[0], "e"), S(*shapes[1], None), S(*shapes[2], None)]),
    "shard_map": (jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("e"),) * 3, out_specs=P("e"))),
                  [S(*a, "e") for a in shapes]),
}
def kernel_runs(name, fn, args):
    # jax.export cannot serialize the partitioner's callback, which builds each device's kernel
    # when XLA compiles the program: there, the call must reach the partitioner whole
    if "jit over" in name:
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return "CustomSPMDPartitioning" in text and "ragged" not in text
    return "CuteDSLRT" in jax.export.export(fn, platforms=["cuda"], disabled_checks=efc.export_checks())(*args).mlir_module()


print(json.dumps({name: kernel_runs(name, fn, args) for name, (fn, args) in calls.items()}))
"""


def test_the_kernel_runs_on_each_device_s_shard():
    """On one device and in shard_map the kernel runs; under jit over several devices the call
    reaches the partitioner whole (not as ragged_dot), which lowers each device's shard as the
    one-device call is lowered (the shards' numerics: test_sharded_jit_partitions_rows_and_columns)."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_PARTITIONED, JAX_EFC_UNVERIFIED_KERNELS="1").strip().splitlines()[-1])
    assert out == {"one device": True, "jit over 4": True, "shard_map": True}, out


@pytest.mark.parametrize("rows", [8, 13])
def test_local_group_sizes_cover_each_slice(rows):
    """Each slice of the rows gets, per group, the count of that group's rows inside it: over
    the slices they add up to the group sizes clipped to the rows."""
    from jax_efc.sharding import local_group_sizes

    slices = 5
    for sizes in ([7, 0, 20, 3], [0, 0, 0, 0], [100, 5], [3, 0, 9], [1] * 9):
        group = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)] + [np.full(rows * slices, -1)])
        for i in range(slices):
            got = np.asarray(local_group_sizes(jnp.asarray(sizes, jnp.int32), rows, i))
            want = [int(np.sum(group[i * rows:(i + 1) * rows] == g)) for g in range(len(sizes))]
            assert got.tolist() == want, (sizes, i)


_SHARDED = {
    # name: lhs, rhs, bias, c specs; collectives the forward must not run
    "rows": ((P("data"), P(), P(), P("data")), ("all-gather",)),
    "columns": ((P(), P(None, None, "model"), P(None, "model"), P(None, "model")), ("all-gather", "all-reduce")),
    "rows_and_columns": ((P("data"), P(None, None, "model"), P(None, "model"), P("data", "model")), ("all-gather",)),
    "rows_over_two_axes": ((P(("data", "model")), P(), P(), P(("data", "model"))), ("all-gather",)),
    # K and the experts are gathered, not split
    "k_and_experts": ((P(None, "model"), P("data", "model"), P(), P()), ()),
}


@pytest.mark.parametrize("case", sorted(_SHARDED))
def test_sharded_jit_partitions_rows_and_columns(rng, case):
    """Sharded jit on 8 host devices: the values and gradients of one device, the output sharded
    as the rows and columns were, with a column sum (over the sharded rows) completed by psum."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs, forbidden = _SHARDED[case]
    t, k, n, sizes = 64, 32, 48, jnp.asarray([20, 0, 30, 5], jnp.int32)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((t, k), (4, k, n), (4, n), (t, n))]

    def f(x, w, b, c):
        return efc.grouped_gemm(x, w, sizes, lambda acc, c, b: (jax.nn.silu(acc + b) + c, jnp.sum(acc, axis=0)), c,
                                group_operands=[b])

    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    want, got = f(*args), jax.jit(f)(*sharded)
    for u, v in zip(got, want):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-4)
    hlo = jax.jit(f).lower(*sharded).compile().as_text()
    for op in forbidden:
        assert op not in hlo, f"{case}: the forward runs an {op}"
    rows, cols = specs[0][0] if specs[0] else None, specs[1][2] if len(specs[1]) == 3 else None
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(rows, cols)), 2)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] ** 2)

    for u, v in zip(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(*sharded), jax.grad(loss(f), argnums=(0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-3 * float(jnp.abs(v).max()))


@pytest.mark.parametrize("specs, out, reduced", [
    ((P("data"), P(), P("data")), P(), True),  # tokens sharded: partial products summed
    ((P("data", "model"), P(), P("data")), P(None, "model"), True),  # and the experts' K
    ((P(), P(), P(None, "model")), P(None, None, "model"), False),  # the experts' N: no communication
])
def test_sharded_weight_gradient_contracts_each_device_s_tokens(rng, specs, out, reduced):
    """The weight gradient under jit on 8 host devices: each device contracts its slice of the
    tokens with that slice's group sizes, the partial products summed by one all-reduce (never an
    all-gather of the tokens); the gradient is sharded as the weight is and equals one device's."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t, k, n, sizes = 64, 32, 48, jnp.asarray([20, 0, 30, 5], jnp.int32)
    x, w, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((t, k), (4, k, n), (t, n)))

    def d_w(x, w, ct):
        return jax.vjp(lambda w: efc.grouped_gemm(x, w, sizes), w)[1](ct)[0]

    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, ct), specs)]
    hlo = jax.jit(d_w).lower(*sharded).compile().as_text()
    assert ("all-reduce" in hlo) == reduced and "all-gather" not in hlo
    got = jax.jit(d_w)(*sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(d_w(x, w, ct)), rtol=1e-5, atol=1e-4)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out), 3), got.sharding


def test_weight_gradient_ignores_rows_past_the_groups_and_has_second_derivatives(rng):
    """d rhs (grouped_contraction_p) against a float64 loop with NaN in the rows past the groups,
    sizes past the rows clamped; its own JVP and transposes (a Hessian-vector product) against
    ragged_dot's."""
    from jax_efc.epilogue import identity_ir
    from jax_efc.grouped_primitive import grouped_contraction_p

    t, m, n = 40, 12, 9
    a = rng.standard_normal((t, m)).astype(np.float32)
    b = rng.standard_normal((t, n)).astype(np.float32)
    for sizes in ([10, 0, 25], [30, 20], [0, 0, 0]):
        a_, b_ = a.copy(), b.copy()
        a_[sum(sizes):], b_[sum(sizes):] = np.nan, np.nan
        (got,) = grouped_contraction_p.bind(jnp.asarray(a_), jnp.asarray(b_), jnp.asarray(sizes, jnp.int32),
                                            ir=identity_ir(jnp.float32), acc_dtype=np.dtype(np.float32),
                                            precision=None, config=None, local=False)
        want, start = np.zeros((len(sizes), m, n)), 0
        for g, size in enumerate(sizes):
            end = min(start + size, t)
            want[g] = a[start:end].astype(np.float64).T @ b[start:end]
            start = end
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    lhs, rhs = jnp.asarray(a), jnp.asarray(rng.standard_normal((3, m, n)), jnp.float32)
    s = jnp.asarray([10, 0, 25], jnp.int32)

    def hvp(product):
        loss = lambda l, r: jnp.sum(jnp.tanh(product(l, r)))  # noqa: E731
        return jax.jvp(jax.grad(loss, (0, 1)), (lhs, rhs), (0.1 * lhs, 0.1 * rhs))[1]

    for u, v in zip(hvp(lambda l, r: efc.grouped_gemm(l, r, s)), hvp(lambda l, r: jax.lax.ragged_dot(l, r, s))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5)


def test_a_config_pinned_for_the_product_leaves_the_weight_gradient_to_the_heuristic(monkeypatch):
    """A config pinned for grouped_gemm is the product's (and its lhs gradient's, the same kind of
    GEMM); the weight gradient's GEMM takes the heuristic's tiles, so a step with a pinned config
    runs three kernels for an sm_90a export."""
    pytest.importorskip("cutlass.jax")
    from jax_efc.config import GemmConfig
    from jax_efc.grouped_primitive import grouped_contraction_p
    from jax_efc.primitive import fused_gemm_eqns

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    cfg = GemmConfig(tile_m=192, tile_n=128, pingpong=True, epi_m=64, epi_n=16)
    S = jax.ShapeDtypeStruct
    specs = [S((1024, 256), jnp.bfloat16), S((4, 256, 512), jnp.bfloat16), S((4,), jnp.int32)]

    def step(x, w, s):
        return jax.grad(lambda x, w: efc.grouped_gemm(x, w, s, jax.nn.silu, config=cfg).astype(jnp.float32).sum(),
                        argnums=(0, 1))(x, w)

    assert efc.backends(step, *specs) == ["kernel (sm_90a)"] * 3
    (eqn,) = [e for e in fused_gemm_eqns(jax.make_jaxpr(step)(*specs)) if e.primitive is grouped_contraction_p]
    assert eqn.params["config"] is None
