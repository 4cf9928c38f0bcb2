"""``fp8_dense``: its numerics against a float64 oracle of the same quantisation, its delayed
scaling against Flax's FP8 ops step by step, its errors, and its three GEMMs on the Hopper
kernel (compiled for sm_90a on the CPU)."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_efc as efc
from conftest import run_for_sm90


def _q(x, dtype, scale):
    """The oracle's quantisation: saturate, round to ``dtype``, back to float64."""
    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float64) / scale, -top, top).astype(dtype).astype(np.float64) * scale


def _scale(x, dtype):
    amax = np.abs(np.asarray(x, np.float64)).max()
    return float(np.float32(np.float32(amax) / np.float32(ml_dtypes.finfo(dtype).max))) if amax else 1.0


def _gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def _gelu_tanh_grad(z):
    u = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z * z)


ACTS = {None: (lambda z: z, lambda z: np.ones_like(z)), "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad),
        "relu": (lambda z: np.maximum(z, 0), lambda z: (z > 0).astype(np.float64))}


def _inputs(rng, lead, k, n, dtype):
    x = jnp.asarray(rng.standard_normal((*lead, k)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal(n), dtype)
    g = jnp.asarray(rng.standard_normal((*lead, n)), dtype)
    return x, w, b, g


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
# 111 rows: the gradient pass stores e5m2 once and XLA pads and transposes it; 128: the pass also
# stores the transposed copy
@pytest.mark.parametrize("lead", [(3, 37), (2, 64)], ids=["M111", "M128"])
def test_forward_and_gradients_against_the_quantised_oracle(rng, activation, dtype, lead):
    x, w, b, g = _inputs(rng, lead, 96, 80, dtype)
    y, pullback = jax.vjp(lambda x, w, b: efc.fp8_dense(x, w, b, activation=activation), x, w, b)
    dx, dw, db = pullback(g)
    act, act_grad = ACTS[activation]
    x2 = np.asarray(x, np.float64).reshape(-1, 96)
    w2 = np.asarray(w, np.float64)
    sx, sw = _scale(x2, ml_dtypes.float8_e4m3fn), _scale(w2, ml_dtypes.float8_e4m3fn)
    xq, wq = _q(x2, ml_dtypes.float8_e4m3fn, sx), _q(w2, ml_dtypes.float8_e4m3fn, sw)
    z = xq @ wq + np.asarray(b, np.float64)
    # the backward reads the pre-activation as the forward stored it, in the layer's dtype
    gz = np.asarray(g, np.float64).reshape(-1, 80) * act_grad(np.asarray(jnp.asarray(z, dtype), np.float64))
    sg = _scale(gz, ml_dtypes.float8_e5m2)
    gq = _q(gz, ml_dtypes.float8_e5m2, sg)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    for name, got, want in (("y", y.reshape(-1, 80), act(z)), ("dx", dx.reshape(-1, 96), gq @ wq.T),
                            ("dw", dw, xq.T @ gq), ("db", db, gz.sum(0))):
        got = np.asarray(got, np.float64)
        assert got.shape == want.shape and got.dtype == np.float64, name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= tol, (name, err)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype and y.shape == (*lead, 80)


def test_it_is_an_fp8_approximation_of_the_dense_layer(rng):
    """Against the unquantised layer: within what e4m3 (and e5m2 for gradients) allow, and not
    equal to it (the quantisation happened)."""
    x, w, b, g = _inputs(rng, (256,), 512, 256, jnp.float32)
    y, pullback = jax.vjp(lambda x, w: efc.fp8_dense(x, w, b, activation="gelu_tanh"), x, w)
    want, ref_pullback = jax.vjp(lambda x, w: jax.nn.gelu(x @ w + b), x, w)
    rel = float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))
    assert 1e-3 < rel < 5e-2
    for got, ref in zip(pullback(g), ref_pullback(g)):
        assert 1e-3 < float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-1


def test_non_finite_inputs_give_nan_not_finite_values_scaled_wrongly(rng):
    x, w, b, _ = _inputs(rng, (64,), 128, 64, jnp.float32)
    for bad in (jnp.inf, jnp.nan):
        y = efc.fp8_dense(x.at[3, 5].set(bad), w, b)
        assert bool(jnp.isnan(y).all()), bad
    assert bool(jnp.isfinite(efc.fp8_dense(jnp.zeros_like(x), w, b)).all())


class _FlaxMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(128, dot_general_cls=nn.Fp8DirectDotGeneralOp, name="up")(x))
        return nn.Dense(64, dot_general_cls=nn.Fp8DirectDotGeneralOp, name="down")(h)


def _meta(flax_meta):
    f = flax_meta["Fp8DirectDotGeneralOp_0"]
    return efc.Fp8Meta(**{k: f[k] for k in efc.Fp8Meta._fields})


def test_delayed_scaling_follows_flax_step_by_step(rng):
    """A two-layer MLP trained four SGD steps with Flax's FP8 Dense and with fp8_dense from the
    same start: the same scales and amax histories (the meta's gradient overwrites it, as
    Flax's collection does), the same losses."""
    x = jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    model = _FlaxMlp()
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params", "_overwrite_with_gradient"}

    def flax_loss(v):
        return jnp.mean((model.apply(v, x) - t) ** 2)

    def ours_loss(p, metas):
        h = efc.fp8_dense(x, p["up"]["kernel"], p["up"]["bias"], activation="gelu_tanh", meta=metas[0])
        return jnp.mean((efc.fp8_dense(h, p["down"]["kernel"], p["down"]["bias"], meta=metas[1]) - t) ** 2)

    params = variables["params"]
    metas = [_meta(variables["_overwrite_with_gradient"][name]) for name in ("up", "down")]
    lr = 0.05
    for step in range(4):
        want, grads = jax.value_and_grad(flax_loss)(variables)
        got, (g_params, g_metas) = jax.value_and_grad(ours_loss, (0, 1))(params, metas)
        assert abs(float(got) - float(want)) <= 1e-4 * float(want), step
        for name, meta in zip(("up", "down"), g_metas):
            flax_new = _meta(grads["_overwrite_with_gradient"][name])
            for field, a, b in zip(efc.Fp8Meta._fields, meta, flax_new):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=0, err_msg=f"{step} {name}.{field}")
        variables = {"params": jax.tree.map(lambda p, g: p - lr * g, variables["params"], grads["params"]),
                     "_overwrite_with_gradient": grads["_overwrite_with_gradient"]}
        params = jax.tree.map(lambda p, g: p - lr * g, params, g_params)
        metas = list(g_metas)
    assert int((metas[0].input_amax_history > 0).sum()) == 4 and float(metas[0].input_scale[0]) != 1.0


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w: efc.fp8_dense(x.astype(jnp.int8), w), TypeError, "x is int8; fp8_dense quantises"),
    (lambda x, w: efc.fp8_dense(x, w[None]), ValueError, "kernel must be 2-D"),
    (lambda x, w: efc.fp8_dense(x, w.T), ValueError, r"x has shape \(4, 32\) but kernel is \(16, 32\): its first "
                                                     "dimension must be 32"),
    (lambda x, w: efc.fp8_dense(x, w, jnp.ones(3)), ValueError, r"bias has shape \(3,\); expected \(16,\)"),
    (lambda x, w: efc.fp8_dense(x, w, meta=(1, 2)), TypeError, "meta must be a jax_efc.Fp8Meta"),
    (lambda x, w: efc.fp8_dense(x, w, meta=efc.Fp8Meta.init(8)._replace(kernel_scale=jnp.ones(2))),
     ValueError, r"meta.kernel_scale has shape \(2,\); expected \(1,\)"),
    (lambda x, w: efc.Fp8Meta.init(0), ValueError, "history_length must be a positive int"),
])
def test_bad_arguments_name_what_is_wrong(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.ones((4, 32)), jnp.ones((32, 16)))


_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import jax_efc as efc

S = jax.ShapeDtypeStruct
m, k, n = int(sys.argv[1]), 2048, 2048
def loss(x, w, b):
    return efc.fp8_dense(x, w, b, activation="gelu_tanh").astype(jnp.float32).sum()
specs = S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16), S((n,), jnp.bfloat16)
exported = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"],
                             disabled_checks=efc.export_checks())(*specs)
text = exported.mlir_module()
print(json.dumps({"kernels": text.count("NvJaxCutlassCall"), "transposes": text.count("stablehlo.transpose"),
                  "backends": efc.backends(jax.grad(loss, (0, 1, 2)), *specs)}))
"""


@pytest.mark.parametrize("m", [1000, 1024])  # 1000: not a multiple of 16, the weight gradient pads its rows
def test_its_three_gemms_are_fp8_kernels_on_hopper(m):
    """Forward, data and weight gradients each an FP8 kernel for sm_90a, none reading an
    operand the plan must transpose first (the quantisations write the K-major copies), and the
    output gradient's pass a fourth (its transposed copy stored by the kernel where M allows)."""
    out = json.loads(run_for_sm90(_SCRIPT, str(m)).strip().splitlines()[-1])
    assert out["kernels"] == 4, out
    # a plan that transposes an operand first says so after the backend
    assert out["backends"] == ["kernel (sm_90a)"] * 4, out


_FAST = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM


@pytest.mark.parametrize("precision", [None, _FAST], ids=["promoted", "fast"])
def test_precision_reaches_every_fp8_gemm(rng, precision):
    """fp8_dense's and fp8_mlp's ``precision`` is each of their GEMMs' (forward and backward),
    through the Flax layer too; by default none asks for fast accumulation."""
    from jax_efc.arguments import fast_accumulation
    from jax_efc.flax import FusedMLP
    from jax_efc.primitive import fused_gemm_eqns

    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    metas = _metas(rng)

    def gemms(fn, *args):
        eqns = fused_gemm_eqns(jax.make_jaxpr(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(),
                                                         range(len(args))))(*args))
        # the 8-bit GEMMs (the output gradient's pass is a 16-bit one, nothing to accumulate)
        return [fast_accumulation(e.params["precision"]) for e in eqns if e.invars[0].aval.dtype.itemsize == 1]

    dense = gemms(lambda x, w: efc.fp8_dense(x, w, precision=precision), x, w)
    mlp = gemms(lambda x, u, d: efc.fp8_mlp(x, u, None, d, None, up_meta=metas[0], down_meta=metas[1],
                                            precision=precision), x, w, w.T)
    layer = FusedMLP(32, fp8="delayed", precision=precision)
    variables = layer.init(jax.random.key(0), x)
    flax_mlp = gemms(lambda p: layer.apply({**variables, "params": p}, x), variables["params"])
    want = precision is not None
    assert dense == [want] * 3 and mlp == [want] * 6 and flax_mlp == [want] * 6


def _metas(rng, length=4):
    """Two layers' delayed-scaling state mid-training: histories of plausible amaxes."""
    def one(x_amax, w_amax, g_amax):
        return efc.Fp8Meta(*(jnp.asarray(v, jnp.float32) for v in (
            [0.01], rng.uniform(0.5, 1, length) * x_amax, [0.001], rng.uniform(0.5, 1, length) * w_amax,
            [1e-4], rng.uniform(0.5, 1, length) * g_amax)))
    return one(12.0, 0.4, 0.05), one(5.0, 0.3, 2.0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [200, 208])  # 208: the GEMMs store the hidden tensors' transposed copies
def test_the_fused_fp8_mlp_is_two_fp8_dense_layers(rng, bias, m):
    """With delayed scaling, fp8_mlp quantises the hidden value in the up GEMM's epilogue and the
    up layer's output gradient in the down layer's data-gradient epilogue: the same output,
    gradients and meta updates as the two fp8_dense layers composed, up to where the composition
    rounds the hidden tensors to bf16 before quantising them."""
    x = jnp.asarray(rng.standard_normal((m, 64)) * 3, jnp.bfloat16)
    up, down = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.bfloat16) for s in ((64, 128), (128, 48)))
    bu, bd = (jnp.asarray(rng.standard_normal(n), jnp.bfloat16) if bias else None for n in (128, 48))
    g = jnp.asarray(rng.standard_normal((m, 48)), jnp.bfloat16)
    mu, md = _metas(rng)

    def fused(x, up, bu, down, bd, mu, md):
        return efc.fp8_mlp(x, up, bu, down, bd, activation="gelu_tanh", up_meta=mu, down_meta=md)

    def composed(x, up, bu, down, bd, mu, md):
        return efc.fp8_dense(efc.fp8_dense(x, up, bu, activation="gelu_tanh", meta=mu), down, bd, meta=md)

    outs = []
    for fn in (fused, composed):
        y, pullback = jax.vjp(fn, x, up, bu, down, bd, mu, md)
        outs.append((y, pullback(g)))
    (y1, g1), (y2, g2) = outs
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))  # noqa: E731
    assert y1.dtype == y2.dtype == jnp.bfloat16 and rel(y1, y2) < 2e-2
    for i, (a, b) in enumerate(zip(g1[:5], g2[:5])):
        if b is None:
            assert a is None, i
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and rel(a, b) < 5e-2, (i, rel(a, b))
    for new1, new2 in zip(g1[5:], g2[5:]):  # the metas' updates: scales equal, amaxes close
        for field, a, b in zip(efc.Fp8Meta._fields, new1, new2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, err_msg=field)
    assert float(g1[6].input_amax_history[0]) != float(md.input_amax_history[0])  # the hidden amax entered


def test_fp8_mlp_without_metas_composes_two_fp8_dense_layers(rng):
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    up, down = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32), jnp.asarray(rng.standard_normal((48, 16)), jnp.float32)
    got = efc.fp8_mlp(x, up, None, down, None, activation="relu")
    want = efc.fp8_dense(efc.fp8_dense(x, up, activation="relu"), down)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    meta = efc.Fp8Meta.init(4)
    with pytest.raises(ValueError, match="give both up_meta and down_meta"):
        efc.fp8_mlp(x, up, None, down, None, up_meta=meta)
    with pytest.raises(ValueError, match=r"up_kernel has shape \(32, 48\) but down_kernel is \(16, 48\)"):
        efc.fp8_mlp(x, up, None, down.T, None)
    with pytest.raises(ValueError, match=r"up_bias has shape \(3,\); expected \(48,\)"):
        efc.fp8_mlp(x, up, jnp.ones(3), down, None)


_MLP_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import jax_efc as efc

S = jax.ShapeDtypeStruct
m, k, h, d = int(sys.argv[1]), 1024, 2048, 1024
meta = efc.Fp8Meta.init(16)
def loss(x, u, bu, w, bw, mu, md):
    y = efc.fp8_mlp(x, u, bu, w, bw, activation="gelu_tanh", up_meta=mu, down_meta=md)
    return jnp.square(y.astype(jnp.float32)).sum()  # (a plain sum's gradient would not need y)
specs = (S((m, k), jnp.bfloat16), S((k, h), jnp.bfloat16), S((h,), jnp.bfloat16), S((h, d), jnp.bfloat16),
         S((d,), jnp.bfloat16), meta, meta)
step = jax.grad(loss, range(7))
text = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=efc.export_checks())(*specs).mlir_module()
print(json.dumps({"kernels": text.count("CuteDSLRT"), "transposes": text.count("stablehlo.transpose"),
                  "backends": efc.backends(step, *specs)}))
"""


@pytest.mark.parametrize("m", [2008, 2048])  # 2008: not a multiple of 16, the weight gradients pad
def test_the_fused_fp8_mlps_six_gemms_are_fp8_kernels_on_hopper(m):
    """Its forward's two GEMMs and its backward's four each a Hopper FP8 kernel (the two with
    epilogue reductions too), and the output gradient's pass a seventh. Where M allows, the
    kernels that quantise the hidden value and its gradient also store their transposed copies
    (the weight gradients' operands): XLA transposes only x and the weights."""
    out = json.loads(run_for_sm90(_MLP_SCRIPT, str(m)).strip().splitlines()[-1])
    assert out["kernels"] == 7 and out["backends"] == ["kernel (sm_90a)"] * 7, out
    # x and the two weights; unaligned, also the hidden value, its gradient and the output gradient
    assert out["transposes"] == (3 if m % 16 == 0 else 6), out


def test_sharded_amaxes_are_the_whole_tensors(rng):
    """Rows sharded over the 8 host devices (data parallel, sharded jit): every amax a step enters
    into its history is the whole tensor's (XLA's max over the mesh for the quantisations', the
    reductions' completion across devices for those out of fp8_mlp's epilogues), so the metas'
    updates equal the unsharded step's."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.asarray(rng.standard_normal((256, 64)) * 3, jnp.float32)
    up, down = (jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for s in ((64, 96), (96, 32)))
    mu, md = _metas(rng)

    def loss(x, up, down, mu, md):
        y = efc.fp8_mlp(x, up, None, down, None, activation="gelu_tanh", up_meta=mu, down_meta=md)
        return jnp.square(efc.fp8_dense(y, down.T, meta=md)).mean()

    grad = jax.jit(jax.grad(loss, (3, 4)))
    want = grad(x, up, down, mu, md)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    got = grad(jax.device_put(x, rows), up, down, mu, md)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
