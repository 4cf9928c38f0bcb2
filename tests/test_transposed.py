"""Outputs stored transposed (``transposed_outputs``): (N, M) / (L, N, M) results against NumPy,
under vmap, autodiff and sharding; errors naming what cannot be transposed; the first-use check
such kernels take; and, on a GPU, the kernel against a float64 oracle."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from jax_efc.primitive import fused_gemm_eqns
from conftest import rel_err, run_for_sm90


def _normal(rng, *shapes, dtype=jnp.float32):
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _alpha_beta(acc, c, bias):
    return {"D": jax.nn.gelu(acc * 2.0 + c + bias), "Y": acc}


def _plain_alpha_beta(a, b, c, bias):
    acc = a @ b
    return {"D": jax.nn.gelu(acc * 2.0 + c + bias), "Y": acc}


def test_one_output_transposed(rng):
    a, b, bias = _normal(rng, (96, 40), (40, 72), (72,))
    y = efc.gemm(a, b, lambda acc, bias: jax.nn.relu(acc + bias), bias, transposed_outputs=True)
    want = np.maximum(np.asarray(a, np.float64) @ np.asarray(b, np.float64) + np.asarray(bias), 0).T
    assert y.shape == (72, 96)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    plain = efc.gemm(a, b.T, transpose_b=True, transposed_outputs=np.True_)  # B stored (N, K)
    np.testing.assert_allclose(np.asarray(plain), (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["D", ["D"], ("D",), {"D"}, {"D": 0}.keys()],
                         ids=["str", "list", "tuple", "set", "keys"])
def test_a_dict_with_one_output_transposed(rng, which):
    a, b, c, bias = _normal(rng, (64, 32), (32, 48), (64, 48), (48,))
    out = efc.gemm(a, b, _alpha_beta, c, bias, transposed_outputs=which)
    want = _plain_alpha_beta(*(np.asarray(x, np.float64) for x in (a, b, c, bias)))
    assert out["D"].shape == (48, 64) and out["Y"].shape == (64, 48)
    np.testing.assert_allclose(np.asarray(out["D"]), np.asarray(want["D"]).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["Y"]), np.asarray(want["Y"]), rtol=1e-5, atol=1e-5)


def test_tuple_outputs_by_index(rng):
    a, b = _normal(rng, (40, 24), (24, 56))
    y0, y1 = efc.gemm(a, b, lambda acc: (acc, acc * 3.0), transposed_outputs=1, out_dtypes=jnp.float32)
    acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert y0.shape == (40, 56) and y1.shape == (56, 40)
    np.testing.assert_allclose(np.asarray(y1), 3 * acc.T, rtol=1e-5, atol=1e-5)
    both = efc.gemm(a, b, lambda acc: (acc, acc * 3.0), transposed_outputs=(0, 1))
    assert [x.shape for x in both] == [(56, 40), (56, 40)]


@pytest.mark.parametrize("b_batched", [True, False])
def test_batched(rng, b_batched):
    """(L, N, M) per batch; a batched ``a`` against a shared ``b`` (which otherwise folds L into M)
    too."""
    a, c = _normal(rng, (3, 40, 32), (3, 40, 48))
    (b,) = _normal(rng, (3, 32, 48) if b_batched else (32, 48))
    y = jax.jit(lambda a, b, c: efc.gemm(a, b, lambda acc, c: acc - c, c, transposed_outputs=True))(a, b, c)
    acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert y.shape == (3, 48, 40)
    np.testing.assert_allclose(np.asarray(y), np.swapaxes(acc - np.asarray(c), -1, -2), rtol=1e-5, atol=1e-5)


def test_vmap(rng):
    """Mapped over the M side alone (``a`` and the tile operand), which would fold the mapped
    dimension into M were no output transposed, and over both sides (the kernel's batch)."""
    a, b, c = _normal(rng, (4, 40, 32), (4, 32, 48), (4, 40, 48))

    def f(a, b, c):
        return efc.gemm(a, b, lambda acc, c: {"D": acc * c, "Y": acc}, c, transposed_outputs="D")

    a64, b64, c64 = (np.asarray(x, np.float64) for x in (a, b, c))
    for out, acc in ((jax.vmap(f, in_axes=(0, None, 0))(a, b[0], c), a64 @ b64[0]), (jax.vmap(f)(a, b, c), a64 @ b64)):
        assert out["D"].shape == (4, 48, 40) and out["Y"].shape == (4, 40, 48)
        np.testing.assert_allclose(np.asarray(out["D"]), np.swapaxes(acc * c64, -1, -2), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out["Y"]), acc, rtol=1e-5, atol=1e-5)


def test_gradients_through_a_transposed_output(rng):
    """The cotangent of a transposed output is transposed back before the epilogue's VJP: every
    input's gradient matches plain JAX's, second order too."""
    a, b, c, bias, w = _normal(rng, (64, 32), (32, 48), (64, 48), (48,), (48, 64))

    def loss(fn, a, b, c, bias):
        out = fn(a, b, c, bias)
        return jnp.sum(jnp.tanh(out["D"]) * w) + jnp.sum(out["Y"] ** 2) * 0.1

    def fused(a, b, c, bias):
        return efc.gemm(a, b, _alpha_beta, c, bias, transposed_outputs="D")

    def plain(a, b, c, bias):
        out = _plain_alpha_beta(a, b, c, bias)
        return {"D": out["D"].T, "Y": out["Y"]}

    args = (a, b, c, bias)
    got = jax.jit(jax.grad(lambda *x: loss(fused, *x), argnums=(0, 1, 2, 3)))(*args)
    want = jax.grad(lambda *x: loss(plain, *x), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5
    # reverse over reverse: the primitive's JVP rule and the plain GEMMs' transposes
    second = jax.grad(lambda a: jnp.sum(jax.grad(lambda *x: loss(fused, *x), argnums=1)(a, b, c, bias) ** 2))
    second_plain = jax.grad(lambda a: jnp.sum(jax.grad(lambda *x: loss(plain, *x), argnums=1)(a, b, c, bias) ** 2))
    assert rel_err(second(a), second_plain(a)) < 1e-5
    # an affine epilogue transposed: the backward needs no accumulator, so none is saved
    affine = lambda a: jnp.sum(efc.gemm(a, b, lambda acc, c: acc * 2.0 + c, c, transposed_outputs=True) * w)  # noqa: E731
    g = jax.grad(affine)(a)
    assert rel_err(g, jax.grad(lambda a: jnp.sum((2 * a @ b + c).T * w))(a)) < 1e-5
    (eqn,) = fused_gemm_eqns(jax.make_jaxpr(lambda a: jax.vjp(affine, a)[0])(a))
    assert [o.name for o in eqn.params["ir"].outputs] == ["0"]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("x_spec, w_spec", [(P("data", None), P(None, None)), (P(None, None), P(None, "model")),
                                            (P("data", None), P(None, "model")), (P(None, "model"), P("model", None))],
                         ids=["data-parallel", "tp-column", "dp+tp-column", "tp-row"])
def test_sharded(rng, mesh, x_spec, w_spec):
    """A transposed output's sharding is the transpose of an untransposed one's: (columns, rows)."""
    x, w, bias = _normal(rng, (64, 32), (32, 48), (48,))
    sharded = [jax.device_put(t, NamedSharding(mesh, s)) for t, s in zip((x, w, bias), (x_spec, w_spec, P()))]

    def f(x, w, bias):
        return efc.gemm(x, w, lambda acc, bias: {"D": jax.nn.gelu(acc + bias), "Y": acc}, bias,
                        transposed_outputs="D")

    out = jax.jit(f)(*sharded)
    want = {"D": jax.nn.gelu(x @ w + bias).T, "Y": x @ w}
    assert rel_err(out["D"], want["D"]) < 1e-5 and rel_err(out["Y"], want["Y"]) < 1e-5
    rows, cols = x_spec[0], w_spec[1]
    assert out["Y"].sharding.is_equivalent_to(NamedSharding(mesh, P(rows, cols)), 2)
    assert out["D"].sharding.is_equivalent_to(NamedSharding(mesh, P(cols, rows)), 2)
    g = jax.jit(jax.grad(lambda *t: jnp.sum(f(*t)["D"] ** 2), argnums=(0, 1, 2)))(*sharded)
    r = jax.grad(lambda x, w, b: jnp.sum(jax.nn.gelu(x @ w + b) ** 2), argnums=(0, 1, 2))(x, w, bias)
    for u, v in zip(g, r):
        assert rel_err(u, v) < 1e-5


@pytest.mark.parametrize("kw, error, match", [
    (dict(transposed_outputs=True), TypeError, r"transposed_outputs=True: the epilogue returns 2 outputs"),
    (dict(transposed_outputs="Q"), ValueError, r"transposed_outputs: no output 'Q'; the epilogue returns \['D', 'Y'\]"),
    (dict(transposed_outputs=["D", 1.5]), TypeError, r"transposed_outputs: 1.5 is not an output's name"),
    (dict(transposed_outputs={"D": True}), TypeError, r"transposed_outputs: \{'D': True\} is not an output's name"),
    (dict(transposed_outputs="D", inplace={"D": 0}), ValueError,
     r"transposed_outputs: output 'D' is also written in place \(inplace=\)"),
])
def test_what_cannot_be_transposed_is_named(kw, error, match):
    a, b, c, bias = jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((64, 48)), jnp.ones(48)
    with pytest.raises(error, match=match):
        efc.gemm(a, b, _alpha_beta, c, bias, **kw)


def test_reductions_and_what_follows_them_are_not_transposed():
    a, b = jnp.ones((64, 32)), jnp.ones((32, 48))
    with pytest.raises(ValueError, match="transposed_outputs: output '1' is a reduction, or computed after one"):
        efc.gemm(a, b, lambda acc: (acc, jnp.sum(acc, axis=0)), transposed_outputs=1)
    wide = jnp.ones((32, 300))  # rows wider than a tile: the softmax's exponentials and sum run in XLA
    with pytest.raises(ValueError, match="transposed_outputs: output '0' is a reduction, or computed after one"):
        efc.gemm(a, wide, lambda acc: jax.nn.softmax(acc, axis=-1), transposed_outputs=True)
    # rows a tile spans: the GEMM computes the whole softmax, and stores it transposed
    p = efc.gemm(a, b * jnp.arange(48.0), lambda acc: jax.nn.softmax(acc, axis=-1), transposed_outputs=True)
    np.testing.assert_allclose(np.asarray(p), np.asarray(jax.nn.softmax(a @ (b * jnp.arange(48.0)), axis=-1)).T,
                               rtol=1e-6)
    # the tile beside a reduction may be transposed
    y, s = efc.gemm(a, b, lambda acc: (acc, jnp.sum(acc, axis=0)), transposed_outputs=0)
    assert y.shape == (48, 64) and s.shape == (48,)


def test_the_primitive_refuses_a_transposed_reduction():
    from jax_efc.epilogue import identity_ir
    from jax_efc.primitive import fused_gemm

    ir = identity_ir(jnp.float32)
    ir = ir.with_outputs([dataclasses.replace(ir.outputs[0], reduce="sum", over=("m",), transposed=True)])
    with pytest.raises(ValueError, match="output '0' is a reduction and marked transposed"):
        fused_gemm(jnp.ones((64, 32)), jnp.ones((32, 48)), ir=ir)


def test_transposed_outputs_are_checked_on_first_use_where_they_have_not_run(monkeypatch):
    """Hopper's transposed stores have run on a GPU; Blackwell's have not, and a policy that does
    not mark them verified says so, so a first-use check runs before one (jax_efc.self_check)."""
    pytest.importorskip("cutlass")
    from jax_efc import autotune, self_check
    from jax_efc.config import GemmConfig
    from jax_efc.kernels import policy
    from jax_efc.kernels.problem import KernelProblem
    from jax_efc.kernels.sm90_policy import Sm90Policy
    from jax_efc.tracing import trace_epilogue

    ir, *_ = trace_epilogue(lambda acc: acc, (256, 256), [], [], {}, {}, None, jnp.bfloat16)
    ir = ir.with_outputs([dataclasses.replace(ir.outputs[0], transposed=True)])
    problem = KernelProblem(ir, "bfloat16", "float32", "k", "n", False, False, False, (), "sm_90a", GemmConfig())
    assert policy("sm_90a").unverified_reason(problem) is None
    monkeypatch.setattr(Sm90Policy, "verified_transposed_outputs", False)
    assert policy("sm_90a").unverified_reason(problem) == "the sm_90a kernel's outputs stored transposed"
    assert policy("sm_100a").unverified_reason(dataclasses.replace(problem, arch="sm_100a")) is not None
    untransposed = KernelProblem(ir.untransposed(), "bfloat16", "float32", "k", "n", False, False, False, (),
                                 "sm_90a", GemmConfig())
    assert policy("sm_90a").unverified_reason(untransposed) is None
    # the kernel, its autotuning record and its first-use verdict are each the transposed one's own
    assert problem.compile_key != untransposed.compile_key
    plans = [SimpleNamespace(problem=p, mnkl=(256, 256, 64, 1)) for p in (problem, untransposed)]
    gpu = ("NVIDIA H100 80GB HBM3", 132)
    for key in (autotune.record_key, self_check._key):
        assert key(plans[0], gpu) != key(plans[1], gpu)


_EXPORT = """
import json, re
import jax, jax.numpy as jnp
import jax_efc as efc
efc.set_target_arch("sm_90a")
S = jax.ShapeDtypeStruct
a, b, bias = S((2048, 1024), jnp.bfloat16), S((1024, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16)
f = jax.jit(lambda a, b, bias: efc.gemm(a, b, lambda acc, bias: jax.nn.gelu(acc + bias), bias, transposed_outputs=True))
exported = jax.export.export(f, platforms=["cuda"], disabled_checks=efc.export_checks())(a, b, bias)
print(json.dumps({"backends": efc.backends(f, a, b, bias), "shape": list(exported.out_avals[0].shape),
                  "kernel": "CuteDSLRT" in exported.mlir_module()}))
"""


def test_an_export_from_a_cpu_holds_the_kernel():
    """Hopper's transposed stores have run on a GPU, so an export for sm_90a from a machine
    without one holds the kernel (no first-use check needed), its output (N, M)."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_EXPORT, JAX_EFC_UNVERIFIED_KERNELS="0").strip().splitlines()[-1])
    assert out["shape"] == [4096, 2048]
    assert out["kernel"] and out["backends"] == ["kernel (sm_90a)"], out


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, efc.GemmConfig(128, 128, 1, 2, pingpong=True, epi_m=64),
                                    efc.GemmConfig(128, 256, 2, 1),
                                    efc.GemmConfig(128, 192, 2, 1, pingpong=True, raster="n")],
                         ids=["heuristic", "pingpong", "coop", "pingpong-128x192"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("m, n, k, l", [(4096, 4096, 1024, None), (1008, 3000, 520, None), (528, 776, 264, 3),
                                        (2304, 2824, 1288, None)])
def test_the_kernel_stores_transposed_outputs(rng, monkeypatch, config, out_dtype, m, n, k, l):
    """On the GPU, strict: alpha-beta with D
    transposed (16-bit: the transposing stmatrix; 8-bit: one value per store) and Y not, partial
    tiles along M and N, the CTA's last tile staged in the A/B ring, stream-K (the last shape in
    128x192 tiles), against a float64 oracle."""
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    lead = () if l is None else (l,)
    a = jnp.asarray(rng.standard_normal((*lead, m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((*lead, m, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)

    def f(a, b, c, bias):
        return efc.gemm(a, b, _alpha_beta, c, bias, transposed_outputs="D", config=config,
                        out_dtypes={"D": out_dtype, "Y": jnp.bfloat16})

    assert efc.backends(f, a, b, c, bias)[0].startswith("kernel")
    out = jax.jit(f)(a, b, c, bias)
    want = _plain_alpha_beta(*(np.asarray(x, np.float64) for x in (a, b, c, bias)))
    want_d = np.swapaxes(np.asarray(want["D"]), -1, -2)
    assert out["D"].shape == want_d.shape and out["Y"].shape == (*lead, m, n)
    got_d = np.asarray(out["D"].astype(jnp.float32), np.float64)
    assert np.isfinite(got_d).all()
    tol = {"bfloat16": 1e-2, "float8_e4m3fn": 6e-2}[out_dtype]
    assert rel_err(got_d, want_d) < tol
    assert rel_err(np.asarray(out["Y"], np.float64), want["Y"]) < 1e-2


def test_blackwell_2cta_128_row_tiles_are_not_chosen_for_transposed_outputs(monkeypatch):
    """The heuristic's 2-CTA 128-row tile (subtiles split in column blocks) does not store
    outputs transposed: for such an epilogue the heuristic takes a 1-CTA tile, and a pinned one
    is refused with the reason."""
    pytest.importorskip("cutlass")
    from jax_efc.plan import plan_kernel
    from jax_efc.tracing import trace_epilogue

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    a = jax.ShapeDtypeStruct((112, 4096), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)

    def plan(transposed, config=None):
        ir, *_ = trace_epilogue(lambda acc: {"D": acc}, (112, 8192), [], [], {}, {}, None, jnp.bfloat16)
        ir = ir.with_outputs([dataclasses.replace(o, transposed=transposed) for o in ir.outputs])
        return plan_kernel(ir, a, b, [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                           config=config, arch="sm_100a")

    assert plan(False).config.use_2cta and plan(False).config.tile_m == 128
    chosen = plan(True)
    assert chosen.backend == "kernel" and not (chosen.config.use_2cta and chosen.config.tile_m == 128)
    pinned = plan(True, efc.GemmConfig(128, 256, 2, 1, use_2cta=True))
    assert pinned.backend == "reference" and "stored transposed" in pinned.reason


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1008, 3000, 528), (2048, 2048, 4096)])
def test_promoting_fp8_kernels_store_transposed_outputs(rng, monkeypatch, m, n, k):
    """On the GPU, strict: e4m3 inputs whose partial sums are promoted (every second k-tile, the
    warpgroups at alternate k-tiles) in the tile the heuristic gives a transposed store
    (128x128, as fp8_mlp's GEMMs run), an e4m3 output stored transposed beside a bf16 one,
    partial tiles, the allocator primed with NaN first, against a float64 oracle."""
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)

    def f(a, b, bias):
        return efc.gemm(a, b, lambda acc, bias: (acc * 0.05 + bias, acc), bias, transpose_b=True,
                        transposed_outputs=0, out_dtypes=(jnp.float8_e4m3fn, jnp.bfloat16))

    assert efc.backends(f, a, b, bias)[0].startswith("kernel")
    fn = jax.jit(f)
    jax.block_until_ready(fn(a, b, bias))  # compiled first, so the NaN blocks are the last freed
    poison = jnp.full((2 * m, n), jnp.nan, jnp.float32)
    jax.block_until_ready(poison)
    del poison
    d_t, y = fn(a, b, bias)
    acc = np.asarray(a.astype(jnp.float32), np.float64) @ np.asarray(b.astype(jnp.float32), np.float64).T
    want_d = (acc * 0.05 + np.asarray(bias, np.float64)).T
    got_d = np.asarray(d_t.astype(jnp.float32), np.float64)
    assert d_t.shape == (n, m) and np.isfinite(got_d).all()
    assert rel_err(got_d, want_d) < 6e-2
    assert rel_err(np.asarray(y, np.float64), acc) < 1e-2
