"""8-bit float inputs and outputs on the reference path (any machine): the numerics the kernel
is held to in ``test_gpu_low_precision.py``, the 8-bit stores' rounding and saturation, and the plan."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from jax_efc.epilogue import store_as

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_scaled_8bit_gemm_with_bias_matches_the_float64_oracle(rng, dtype):
    m, n, k = 96, 80, 256
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(dtype)
    b = jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(dtype)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    y = efc.gemm(a, b, lambda acc, bias, *, s: jax.nn.relu(acc * s + bias), bias, transpose_b=True,
                 s=jnp.float32(1 / math.sqrt(k)), out_dtypes=jnp.float32)
    want = np.maximum(_f64(a) @ _f64(b).T / math.sqrt(k) + _f64(bias), 0)
    assert y.dtype == jnp.float32
    assert np.abs(_f64(y) - want).max() < 1e-5 * np.abs(want).max()
    assert efc.gemm(a, b, transpose_b=True).dtype == dtype  # outputs default to the input dtype


@pytest.mark.parametrize("out", FP8, ids=lambda d: jnp.dtype(d).name)
def test_8bit_stores_round_to_nearest_and_saturate(out):
    top = float(jnp.finfo(out).max)
    x = jnp.array([1e9, -1e9, jnp.inf, -jnp.inf, jnp.nan, top, 0.3, -0.3], jnp.float32)
    got = np.asarray(store_as(x, out).astype(jnp.float32))
    assert got[:4].tolist() == [top, -top, top, -top] and np.isnan(got[4])
    assert got[5] == top and got[6:].tolist() == np.asarray(x[6:].astype(out).astype(jnp.float32)).tolist()
    # through the op: the scaled accumulator overflows the 8-bit range and saturates, no NaN
    a = jnp.full((16, 32), 2.0, jnp.float8_e4m3fn)
    y = efc.gemm(a, a, lambda acc, *, s: acc * s, transpose_b=True, s=jnp.float32(top), out_dtypes=out)
    assert np.all(np.asarray(y.astype(jnp.float32)) == top)


def test_8bit_operands_stored_otherwise_are_transposed_once_for_the_kernel(monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from jax_efc.plan import plan_call
    from jax_efc.primitive import fused_gemm_eqns

    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.float8_e4m3fn)

    def plan(transpose_b):
        (eqn,) = fused_gemm_eqns(jax.make_jaxpr(lambda a, b: efc.gemm(a, b, transpose_b=transpose_b,
                                                                      out_dtypes=jnp.bfloat16))(spec, spec))
        return plan_call([v.aval for v in eqn.invars], eqn.params)

    assert plan(True).backend == "kernel" and plan(True).problem.tile_k == 128
    assert plan(True).transposes == (False, False)
    assert plan(False).transposes == (False, True) and "b is transposed once" in plan(False).note


# exports a GEMM of A (4096, 2048) in the dtype named by argv[1] with B stored (N, K) and
# (K, N), and counts its kernels, transposes and TF32 rounding masks (0xFFFFE000)
_EXPORT = """
import json, sys
import jax, jax.numpy as jnp
import jax_efc as efc
S = jax.ShapeDtypeStruct
dtype = jnp.dtype(sys.argv[1])
out = {}
for name, transpose_b, b_shape in (("nk", True, (1024, 2048)), ("kn", False, (2048, 1024))):
    specs = S((4096, 2048), dtype), S(b_shape, dtype)
    f = jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=transpose_b, out_dtypes=jnp.bfloat16))
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=efc.export_checks())(*specs).mlir_module()
    out[name] = {"kernels": text.count("custom_call @CuteDSLRT"), "transposes": text.count("stablehlo.transpose"),
                 "tf32_masks": text.count("4294959104"), "backends": efc.backends(f, *specs)}
print(json.dumps(out))
"""


def _export(dtype: str) -> dict:
    pytest.importorskip("cutlass.jax")
    import json

    from conftest import run_for_sm90

    return json.loads(run_for_sm90(_EXPORT, dtype).strip().splitlines()[-1])


def test_an_8bit_export_holds_the_kernel_and_the_one_transpose():
    out = _export("float8_e4m3fn")
    assert out["nk"] == {"kernels": 1, "transposes": 0, "tf32_masks": 0, "backends": ["kernel (sm_90a)"]}
    assert out["kn"]["kernels"] == 1 and out["kn"]["transposes"] == 1 and out["kn"]["tf32_masks"] == 0
    (line,) = out["kn"]["backends"]
    assert line.startswith("kernel (sm_90a): b is transposed once before the kernel")


def test_a_float32_operand_transposed_for_the_kernel_is_rounded_to_tf32_in_that_pass():
    """The pass that transposes B (K, N) for the TF32 kernel also rounds it to TF32 (the mask of
    its 19 kept bits, 0xFFFFE000, beside the transpose); B stored (N, K) has neither."""
    out = _export("float32")
    assert out["nk"] == {"kernels": 1, "transposes": 0, "tf32_masks": 0, "backends": ["kernel (sm_90a)"]}
    assert out["kn"]["kernels"] == 1 and out["kn"]["transposes"] == 1 and out["kn"]["tf32_masks"] == 1


def test_tf32_rounding_is_to_nearest_ties_away_from_zero(rng):
    """``tf32_rounded`` keeps 10 mantissa bits, rounding to nearest with ties away from zero (as
    ``cvt.rna.tf32.f32`` and XLA's TF32 GEMMs do), within half a TF32 step of every finite input
    over the whole exponent range; non-finite values pass, past the largest TF32 value gives
    infinity."""
    from jax_efc.ffi import tf32_rounded

    f32 = np.finfo(np.float32)
    cases = {1 + 2**-11: 1 + 2**-10, 1 + 3 * 2**-11: 1 + 2**-9, 1 + 2**-12: 1.0, -(1 + 2**-11): -(1 + 2**-10),
             1 + 2**-11 - 2**-23: 1.0, 0.0: 0.0, 2.0**-149: 0.0, float(f32.max): np.inf, -float(f32.max): -np.inf,
             np.inf: np.inf, -np.inf: -np.inf}
    got = np.asarray(tf32_rounded(jnp.asarray(list(cases), jnp.float32)))
    np.testing.assert_array_equal(got, np.asarray(list(cases.values()), np.float32))
    assert np.isnan(np.asarray(tf32_rounded(jnp.float32(np.nan))))
    x = (rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 38, 4000)).astype(np.float32)
    x = x[np.abs(x) < 3.4e38]
    r = np.asarray(tf32_rounded(jnp.asarray(x)))
    assert not (r.view(np.uint32) & 0x1FFF).any()  # 13 low bits dropped
    step = np.spacing(np.abs(x)) * 2.0**13  # a TF32 step at x (subnormals: their own)
    assert (np.abs(r.astype(np.float64) - x) <= step / 2).all()


def test_the_two_8bit_formats_mix_and_nothing_else_does(rng):
    a = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((48, 128)), jnp.float32).astype(jnp.float8_e5m2)
    y = efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32)
    assert np.abs(_f64(y) - _f64(a) @ _f64(b).T).max() < 1e-4
    with pytest.raises(TypeError, match="only the two 8-bit float formats mix"):
        efc.gemm(a, b.astype(jnp.bfloat16), transpose_b=True)
    with pytest.raises(TypeError, match="a is bfloat16 but b is float16"):
        efc.gemm(a.astype(jnp.bfloat16), b.astype(jnp.float16), transpose_b=True)


def test_fp16_accumulation_is_never_split(monkeypatch):
    pytest.importorskip("cutlass")
    from jax_efc.epilogue import identity_ir
    from jax_efc.plan import plan_kernel

    spec = jax.ShapeDtypeStruct((1024, 8192), jnp.float16)
    kw = dict(transpose_a=False, transpose_b=True, config=efc.GemmConfig(128, 128), arch="sm_90a")
    b = jax.ShapeDtypeStruct((512, 8192), jnp.float16)
    f16 = plan_kernel(identity_ir(jnp.float16), spec, b, [], acc_dtype=jnp.float16, **kw)
    f32 = plan_kernel(identity_ir(jnp.float16), spec, b, [], acc_dtype=jnp.float32, **kw)
    # 32 tiles on 132 SMs: fp32 accumulation splits every tile's k-iterations; fp16 does not
    assert f32.schedule.stream_k is not None
    assert f16.backend == "kernel" and f16.schedule.stream_k is None
    bf16 = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16)
    assert "takes float16 inputs" in plan_kernel(identity_ir(jnp.bfloat16), bf16, bf16, [], acc_dtype=jnp.float16,
                                                 **kw).reason


def test_8bit_integers_accumulate_exactly_in_int32(rng):
    """int8 and uint8 (mixed too) accumulate in int32 exactly, past float32's 24 bits; the bare
    accumulator is stored exactly, narrower integer outputs saturate, and an epilogue with a
    float scale computes in float32; gradients reach the float operands and scalars."""
    k = 4096
    a = jnp.asarray(rng.integers(90, 128, (64, k)) * rng.choice([-1, 1], (64, 1)), jnp.int8)  # sums past 2^24
    b = jnp.asarray(rng.integers(200, 256, (k, 32)), jnp.uint8)
    want = np.asarray(a, np.int64) @ np.asarray(b, np.int64)
    assert np.abs(want).max() > 2**24
    y = efc.gemm(a, b)
    assert y.dtype == jnp.int32 and np.array_equal(np.asarray(y, np.int64), want)
    y8 = efc.gemm(a, b, out_dtypes=jnp.int8)
    assert np.array_equal(np.asarray(y8), np.clip(want, -128, 127))
    c = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    scaled = efc.gemm(a, b, lambda acc, c, *, s: jnp.tanh(acc * s) * c, c, s=jnp.float32(1e-8),
                      out_dtypes=jnp.float32)
    assert np.abs(np.asarray(scaled) - np.tanh(want * 1e-8) * np.asarray(c)).max() < 1e-5

    def loss(fn):
        return lambda s, c: (fn(s, c) ** 2).sum()

    ours = loss(lambda s, c: efc.gemm(a, b, lambda acc, c, *, s: jnp.tanh(acc * s) * c, c, s=s,
                                      out_dtypes=jnp.float32))
    plain = loss(lambda s, c: jnp.tanh(jnp.matmul(a, b, preferred_element_type=jnp.int32) * s) * c)
    for got, ref in zip(jax.grad(ours, (0, 1))(jnp.float32(1e-8), c), jax.grad(plain, (0, 1))(jnp.float32(1e-8), c)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="cannot accumulate int8 inputs; allowed: int32"):
        efc.gemm(a, a.T, acc_dtype=jnp.float32)
    with pytest.raises(TypeError, match="int8 with uint8"):
        efc.gemm(a, b.astype(jnp.float16))


def test_precision_takes_jax_dot_algorithm_presets(rng):
    """``precision=`` takes ``jax.lax.DotAlgorithmPreset`` values and their names, as
    ``lax.dot_general`` does; the FP8 ones choose promotion (the kernel's default) or fast
    accumulation, and the reference maps them to the precision XLA's GPU dot gives the same
    arithmetic. Anything else is refused, naming the argument."""
    from jax_efc import arguments

    preset = jax.lax.DotAlgorithmPreset
    a = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32).astype(jnp.float8_e4m3fn)
    want = _f64(a) @ _f64(b).T
    for p in (None, preset.ANY_F8_ANY_F8_F32, preset.ANY_F8_ANY_F8_F32_FAST_ACCUM, "ANY_F8_ANY_F8_F32_FAST_ACCUM"):
        y = efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32, precision=p)
        assert np.abs(_f64(y) - want).max() < 1e-5 * np.abs(want).max(), p
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    assert efc.fused_dense(x, x[:32].T, precision=preset.ANY_F8_ANY_F8_F32_FAST_ACCUM).shape == (64, 32)

    assert arguments.reference_precision(None, jnp.float8_e5m2) == jax.lax.Precision.HIGHEST
    assert arguments.reference_precision(preset.ANY_F8_ANY_F8_F32_FAST_ACCUM, jnp.float8_e4m3fn) == \
        jax.lax.Precision.DEFAULT
    assert arguments.reference_precision(preset.ANY_F8_ANY_F8_F32_FAST_ACCUM, jnp.bfloat16) is None
    assert arguments.reference_precision(preset.BF16_BF16_F32_X3, jnp.float32) is preset.BF16_BF16_F32_X3
    assert arguments.kernel_precision_reason(preset.ANY_F8_ANY_F8_F32, jnp.float8_e4m3fn) is None
    assert "TF32_TF32_F32" in arguments.kernel_precision_reason(preset.TF32_TF32_F32, jnp.bfloat16)
    with pytest.raises(TypeError, match="precision must be"):
        efc.gemm(a, b, transpose_b=True, precision="FASTEST")
    with pytest.raises(TypeError, match="one precision for the whole dot"):
        efc.gemm(a, b, transpose_b=True, precision=(preset.DEFAULT, "highest"))


def test_float32_runs_as_tf32_where_jax_would_use_tf32(monkeypatch):
    """float32 inputs plan the kernel (TF32, K-major A and B) at JAX's default precision, at
    DEFAULT, HIGH ("tensorfloat32") and TF32_TF32_F32, whether given per call or by
    ``jax.default_matmul_precision`` (resolved when the call is made, so a jitted function keeps
    the precision it was traced with); HIGHEST, float32, F32_F32_F32 and 3xTF32 run on the
    reference, which says why."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from jax_efc.plan import plan_call
    from jax_efc.primitive import fused_gemm_eqns

    a = jax.ShapeDtypeStruct((4096, 2048), jnp.float32)
    b = jax.ShapeDtypeStruct((4096, 2048), jnp.float32)

    def plan(precision=None):
        (eqn,) = fused_gemm_eqns(jax.make_jaxpr(lambda a, b: efc.gemm(a, b, transpose_b=True,
                                                                      precision=precision))(a, b))
        return plan_call([v.aval for v in eqn.invars], eqn.params)

    for p in (None, "default", "high", "tensorfloat32", jax.lax.DotAlgorithmPreset.TF32_TF32_F32):
        got = plan(p)
        assert got.backend == "kernel" and got.problem.ab_dtype == "float32" and got.problem.tile_k == 32, p
        assert got.transposes == (False, False)
    for p in ("highest", "float32", "F32_F32_F32", "TF32_TF32_F32_X3"):
        reason = plan(p).reason
        assert reason.startswith("float32 inputs at precision=") and "no 3xTF32 mode" in reason, p
    with jax.default_matmul_precision("float32"):
        assert plan().backend == "reference"
    with jax.default_matmul_precision("tensorfloat32"):
        assert plan().backend == "kernel"
