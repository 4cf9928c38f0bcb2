"""8-bit float A and B, and fp16 accumulation, through the Hopper kernel (marked ``gpu``),
against a float64 NumPy oracle of the same 8-bit values: per-tensor scales as dynamic scalars, per-row / per-column
scales as vector operands, partial tiles, 8-bit outputs saturating at their finite range, and
NaN inputs; 8-bit integers exactly; partial sums promoted (the default) against fast
accumulation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc

pytestmark = pytest.mark.gpu

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


def _quantized(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rel(got, want):
    got = _f64(got)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _xla_err(a, b, want, contract=(((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST):
    """The relative error of XLA's FP8 dot (fp32 out) of ``a`` and ``b`` against ``want``: how
    accurate the kernel must be at least. By default XLA's dot at precision HIGHEST, which on
    Hopper promotes partial sums into fp32 as the kernel does; at its default precision XLA
    accumulates fast in the WGMMA (cuBLAS), or exactly where it picks another algorithm (small
    GEMMs)."""
    return _rel(jax.jit(lambda a, b: jax.lax.dot_general(a, b, contract, precision=precision,
                                                         preferred_element_type=jnp.float32))(a, b), want)


# Hopper's 8-bit WGMMA rounds the partial sums of each 128-deep k-tile to fewer bits than fp32:
# about 1e-4 relative error on random data (1.26e-4 measured for e4m3, 0.83e-4 for e5m2 on the
# H200, as XLA's promoting dot gives), whatever K, once they are promoted into fp32
_WGMMA_ERR = 2.5e-4


def _bar(a, b, want, contract=(((1,), (1,)), ((), ()))):
    """How accurate the promoting kernel must be at least: as XLA's promoting FP8 dot, within
    1.5x, or the WGMMA's own rounding where XLA picks an exact algorithm (small GEMMs). Where
    the plan promotes less often than each k-tile by default (``ArchPolicy.default_promotion``),
    both 5/3 as high: 2.5x (every second k-tile: 1.7x at K = 16384 on an H100)."""
    from jax_efc import device
    from jax_efc.kernels import policy

    factor = 1.0 if policy(device.arch()).default_promotion() == 1 else 5 / 3
    return factor * max(1.5 * _xla_err(a, b, want, contract), _WGMMA_ERR)


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m, n, k", [(1000, 776, 4096), (300, 264, 208), (8192, 4096, 4096)])
def test_scaled_bias_gelu_to_bf16(rng, dtype, m, n, k):
    a, b = _quantized(rng, (m, k), dtype), _quantized(rng, (n, k), dtype)  # b stored (N, K)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    sa, sb = jnp.float32(0.5 / math.sqrt(k)), jnp.float32(1.5)
    fn = jax.jit(lambda a, b, bias, sa, sb: efc.gemm(a, b, lambda acc, bias, *, sa, sb: jax.nn.gelu(acc * (sa * sb) + bias),
                                                     bias, transpose_b=True, sa=sa, sb=sb, out_dtypes=jnp.bfloat16))
    assert efc.backends(fn, a, b, bias, sa, sb) == ["kernel (sm_90a)"]
    want = _gelu_tanh(_f64(a) @ _f64(b).T * (float(sa) * float(sb)) + _f64(bias))
    assert _rel(fn(a, b, bias, sa, sb), want) < 1e-2


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_per_token_and_per_channel_scales(rng, dtype):
    m, n, k = 520, 392, 1024
    a, b = _quantized(rng, (m, k), dtype), _quantized(rng, (n, k), dtype)
    row_scale = jnp.asarray(rng.uniform(0.5, 2.0, (m, 1)) / math.sqrt(k), jnp.float32)  # per token
    col_scale = jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.float32)  # per channel
    y = jax.jit(lambda *x: efc.gemm(x[0], x[1], lambda acc, r, c: acc * r * c, x[2], x[3], transpose_b=True,
                                    out_dtypes=jnp.float32))(a, b, row_scale, col_scale)
    want = _f64(a) @ _f64(b).T * _f64(row_scale) * _f64(col_scale)
    assert _rel(y, want) <= _bar(a, b, _f64(a) @ _f64(b).T)


@pytest.mark.parametrize("out", FP8, ids=lambda d: jnp.dtype(d).name)
def test_8bit_outputs_round_and_saturate_like_the_reference(rng, out):
    m, n, k = 384, 256, 512
    a, b = _quantized(rng, (m, k), jnp.float8_e4m3fn), _quantized(rng, (n, k), jnp.float8_e4m3fn)
    top = float(jnp.finfo(out).max)
    # scaled so that a share of the outputs overflow the 8-bit range
    scale = jnp.float32(top / 20)
    got = jax.jit(lambda a, b, s: efc.gemm(a, b, lambda acc, *, s: acc * s, transpose_b=True, s=s,
                                           out_dtypes=out))(a, b, scale)
    acc = _f64(a) @ _f64(b).T * float(scale)
    assert (np.abs(acc) > top).mean() > 0.05
    want = np.asarray(jnp.asarray(np.clip(acc, -top, top), jnp.float32).astype(out).astype(jnp.float32))
    got = np.asarray(got.astype(jnp.float32))
    assert not np.isnan(got).any()
    assert np.array_equal(got[np.abs(acc) > top], want[np.abs(acc) > top])  # saturated, not NaN
    close = np.abs(got - want) <= np.abs(want) * 2.0 ** -(3 if out == jnp.float8_e4m3fn else 2)
    assert close.mean() > 0.999  # round to nearest even, up to fp32 accumulation order


def test_nan_inputs_reach_their_outputs(rng):
    m, n, k = 256, 128, 256
    a = np.array(_quantized(rng, (m, k), jnp.float8_e4m3fn).astype(jnp.float32))
    a[3, 7] = np.nan
    a = jnp.asarray(a).astype(jnp.float8_e4m3fn)
    b = _quantized(rng, (n, k), jnp.float8_e4m3fn)
    y = np.asarray(jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32))(a, b))
    assert np.isnan(y[3]).all() and not np.isnan(np.delete(y, 3, axis=0)).any()


def test_b_stored_k_by_n_is_transposed_once_for_the_kernel(rng):
    m, n, k = 1000, 1024, 2048
    a, b = _quantized(rng, (m, k), jnp.float8_e4m3fn), _quantized(rng, (k, n), jnp.float8_e4m3fn)
    fn = jax.jit(lambda a, b: efc.gemm(a, b, out_dtypes=jnp.float32))
    (line,) = efc.backends(fn, a, b)
    assert line.startswith("kernel (sm_90a): b is transposed once")
    want = _f64(a) @ _f64(b)
    assert _rel(fn(a, b), want) <= _bar(a, b, want, (((1,), (0,)), ((), ())))


def test_mixed_8bit_formats(rng):
    m, n, k = 700, 520, 1024
    a, b = _quantized(rng, (m, k), jnp.float8_e4m3fn), _quantized(rng, (n, k), jnp.float8_e5m2)
    fn = jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32))
    assert efc.backends(fn, a, b) == ["kernel (sm_90a)"]
    want = _f64(a) @ _f64(b).T
    assert _rel(fn(a, b), want) <= _bar(a, b, want)


FAST = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM


@pytest.mark.parametrize("k", [4096, 16384])
def test_long_k_is_as_accurate_as_xlas_fp8_dot(rng, k):
    """At K = 16384 the kernel's fp32 result is as accurate as XLA's FP8 dot of the same
    arithmetic: at precision HIGHEST (partial sums promoted each k-tile) as XLA's there (which
    promotes them too); with fast accumulation as XLA's default (cuBLAS's fast accumulation, at
    these sizes). By default (promoted each k-tile, or every second one where the policy says
    so: 1.7x XLA's promoting dot's error at K = 16384 on an H100) it is the more accurate."""
    m, n = 2048, 2048
    a, b = _quantized(rng, (m, k), jnp.float8_e4m3fn), _quantized(rng, (n, k), jnp.float8_e4m3fn)
    want = _f64(a) @ _f64(b).T
    run = lambda precision: jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32,  # noqa: E731
                                                          precision=precision))(a, b)
    highest, promoted, fast = (_rel(run(p), want) for p in (jax.lax.Precision.HIGHEST, None, FAST))
    assert highest <= 1.5 * _xla_err(a, b, want) + 1e-6
    assert promoted <= 2.5 * _xla_err(a, b, want) + 1e-6
    assert fast <= 1.5 * _xla_err(a, b, want, precision=None) + 1e-6
    assert highest <= promoted < fast


@pytest.mark.parametrize("config", [None, (128, 192, 2, 1, {"swizzle": 8}), (128, 64, 1, 2, {"pingpong": True}),
                                    (128, 128, 2, 1, {})],
                         ids=["heuristic", "cooperative_128x192_c2x1", "pingpong_128x64_c1x2",
                              "cooperative_128x128_c2x1"])
@pytest.mark.parametrize("m, n, k", [(1000, 776, 4480), (2048, 2048, 16384)])
def test_promotion_every_two_k_tiles(rng, config, m, n, k):
    """Partial sums promoted every second k-tile (``Sm90Policy.promotion_k_tiles``, the default),
    an odd k-tile count (35, split by stream-K in 128x128 tiles) among them: within 2.5x XLA's
    promoting dot's error (and at K = 16384 more accurate than its fast one), over partial tiles,
    every value written (the allocator primed with NaN first), each 128x128 block checked; at
    precision HIGHEST the plan promotes each k-tile. A cooperative tile's two warpgroups promote
    at alternate k-tiles."""
    from jax_efc import device
    from jax_efc import ffi as F
    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir
    from jax_efc.plan import plan_kernel

    a, b = _quantized(rng, (m, k), jnp.float8_e4m3fn), _quantized(rng, (n, k), jnp.float8_e4m3fn)
    cfg = None if config is None else GemmConfig(*config[:4], **config[4])

    def plan(precision=None):
        return plan_kernel(identity_ir(jnp.float32, jnp.float32), a, b, [], transpose_a=False, transpose_b=True,
                           acc_dtype=jnp.float32, config=cfg, arch=device.arch(), precision=precision)

    assert plan(jax.lax.Precision.HIGHEST).problem.promote == 1
    p = plan()
    assert p.backend == "kernel" and p.problem.promote == 2, p.reason
    kernel = jax.jit(lambda a, b: F.fused_gemm(a, b, plan=p)[0])
    jax.block_until_ready(kernel(a, b))  # compiled first, so the NaN blocks are the last freed
    poison = jnp.full((m, n), jnp.nan, jnp.float32)
    jax.block_until_ready(poison)
    del poison
    got, want = _f64(kernel(a, b)), _f64(a) @ _f64(b).T
    assert np.isfinite(got).all()
    bar = max(2.5 * _xla_err(a, b, want), _WGMMA_ERR)
    assert _rel(got, want) <= bar
    if k == 16384:
        assert _rel(got, want) < _xla_err(a, b, want, precision=None)
    worst = max(_rel(got[i:i + 128, j:j + 128], want[i:i + 128, j:j + 128])
                for i in range(0, m, 128) for j in range(0, n, 128))
    assert worst <= 2 * bar


def test_fp16_accumulation(rng):
    """fp16 inputs accumulated in fp16 (the f16-accumulating WGMMA): within fp16 accumulation's
    rounding of the float64 oracle."""
    m, n, k = 1000, 776, 1024
    a = jnp.asarray(rng.standard_normal((m, k)) / math.sqrt(k), jnp.float16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.float16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float16)
    fn = jax.jit(lambda a, b, bias: efc.gemm(a, b, lambda acc, bias: jax.nn.gelu(acc + bias), bias,
                                             acc_dtype=jnp.float16, out_dtypes=jnp.float32))
    assert efc.backends(fn, a, b, bias) == ["kernel (sm_90a)"]
    assert _rel(fn(a, b, bias), _gelu_tanh(_f64(a) @ _f64(b) + _f64(bias))) < 3e-2


def test_int8_accumulates_exactly_and_saturates(rng):
    """int8 x uint8 in int32, exactly past fp32's 24 bits; the bare accumulator stored as int32
    exactly and as int8 saturated; a scaled float output beside them."""
    m, n, k = 1000, 1024, 4096
    a = jnp.asarray(rng.integers(90, 128, (m, k)) * rng.choice([-1, 1], (m, 1)), jnp.int8)
    b = jnp.asarray(rng.integers(200, 256, (n, k)), jnp.uint8)  # stored (N, K)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    fn = jax.jit(lambda a, b, bias: efc.gemm(a, b, lambda acc, bias: {"D": acc * 1e-8 + bias, "I": acc, "Q": acc},
                                             bias, transpose_b=True,
                                             out_dtypes={"D": jnp.float32, "I": jnp.int32, "Q": jnp.int8}))
    assert efc.backends(fn, a, b, bias) == ["kernel (sm_90a)"]
    out = fn(a, b, bias)
    want = np.asarray(a, np.int64) @ np.asarray(b, np.int64).T
    assert np.abs(want).max() > 2**24
    assert np.array_equal(np.asarray(out["I"], np.int64), want)
    assert np.array_equal(np.asarray(out["Q"]), np.clip(want, -128, 127))
    assert _rel(out["D"], want * 1e-8 + _f64(bias)) < 1e-6


@pytest.mark.parametrize("transpose_b", [True, False])
def test_float32_runs_as_tf32_as_accurate_as_xlas_default_dot(rng, transpose_b):
    """float32 inputs at JAX's default precision: the TF32 kernel (B stored (K, N) transposed once
    before it), with a bias and gelu over partial tiles, as accurate against the float64 oracle
    as XLA's own default-precision (TF32) dot, and far from fp32 exactness (TF32 ran). At
    precision HIGHEST the kernel does not run (strict mode: an error naming it)."""
    m, n, k = 1000, 776, 2048
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, k) if transpose_b else (k, n)) / math.sqrt(k), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    fn = jax.jit(lambda a, b, bias: efc.gemm(a, b, lambda acc, bias: jax.nn.gelu(acc + bias), bias,
                                             transpose_b=transpose_b))
    (backend,) = efc.backends(fn, a, b, bias)
    assert backend == "kernel (sm_90a)" if transpose_b else backend.startswith("kernel (sm_90a): b is transposed once")
    b_kn = _f64(b).T if transpose_b else _f64(b)
    acc = _f64(a) @ b_kn
    got = fn(a, b, bias)
    assert got.dtype == jnp.float32
    xla_acc = jax.jit(lambda a, b: a @ (b.T if transpose_b else b))(a, b)
    xla = _rel(xla_acc, acc)
    assert 1e-5 < xla < 1e-2  # XLA's default dot is TF32 on Hopper
    assert _rel(got, _gelu_tanh(acc + _f64(bias))) <= 2 * xla
    with pytest.raises(efc.FallbackError, match="precision=HIGHEST"):
        jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=transpose_b, precision="highest"))(a, b)


@pytest.mark.parametrize("transpose_b", [True, False], ids=["b_nk", "b_kn"])
def test_tf32_non_finite_inputs_reach_their_rows(rng, transpose_b):
    """An infinite and a NaN value of A (read in place, truncated to TF32) make their rows infinite
    and NaN as in XLA's dot, over partial tiles; the other rows stay finite."""
    m, n, k = 1000, 1032, 1056
    a = np.asarray(rng.random((m, k)), np.float32)
    a[0, 5], a[1, 7] = np.inf, np.nan
    a = jnp.asarray(a)
    b = jnp.asarray(rng.random((n, k) if transpose_b else (k, n)), jnp.float32)
    fn = jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=transpose_b))
    assert efc.backends(fn, a, b)[0].startswith("kernel (sm_90a)")
    got = np.asarray(fn(a, b))
    xla = np.asarray(jax.jit(lambda a, b: a @ (b.T if transpose_b else b))(a, b))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(xla))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(xla))
    assert np.isposinf(got[0]).all() and np.isnan(got[1]).all() and np.isfinite(got[2:]).all()


def test_tf32_rounds_an_operand_it_transposes(rng):
    """On positive operands, where truncation's errors add up: B stored (K, N), rounded to TF32
    to nearest in the transpose before the kernel, leaves about half the error of B stored
    (N, K), which the WGMMA reads in place and truncates (a NumPy model of the two roundings:
    3.3e-4 against 6.5e-4; XLA's dot, rounding both operands, 1.1e-5)."""
    m, n, k = 1024, 1032, 1024
    a = jnp.asarray(rng.random((m, k)), jnp.float32)
    b = jnp.asarray(rng.random((k, n)), jnp.float32)
    want = _f64(a) @ _f64(b)
    kn = jax.jit(lambda a, b: efc.gemm(a, b))
    nk = jax.jit(lambda a, b: efc.gemm(a, b, transpose_b=True))
    b_nk = jnp.asarray(np.asarray(b).T.copy())
    assert efc.backends(kn, a, b)[0].startswith("kernel (sm_90a): b is transposed once")
    assert efc.backends(nk, a, b_nk) == ["kernel (sm_90a)"]
    rounded, truncated = _rel(kn(a, b), want), _rel(nk(a, b_nk), want)
    assert rounded < 0.7 * truncated, (rounded, truncated)


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("precision", [None, FAST], ids=["promoted", "fast"])
def test_full_range_e4m3_scaled_bias_within_the_outputs_rounding(rng, out, precision):
    """e4m3 inputs spread over the whole finite range (as a quantisation by amax makes them), a
    per-tensor scale and a bias, at 2048 x 2048 x 4096 (128x128 cooperative tiles): within the
    output's own rounding of the float64 oracle, tighter than the other tests' bars."""
    m, n, k = 2048, 2048, 4096
    # clipped: a value past 448 would convert to NaN (e4m3fn has no Inf)
    a, b = (jnp.clip(jnp.asarray(rng.standard_normal(s), jnp.float32) * (448 / 5), -448, 448)
            .astype(jnp.float8_e4m3fn) for s in ((m, k), (n, k)))
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    s = jnp.float32(1 / (448 / 5) ** 2 / math.sqrt(k))
    fn = jax.jit(lambda a, b, bias, s: efc.gemm(a, b, lambda acc, bias, *, s: acc * s + bias, bias, s=s,
                                                transpose_b=True, out_dtypes=out, precision=precision))
    assert efc.backends(fn, a, b, bias, s) == ["kernel (sm_90a)"]
    want = _f64(a) @ _f64(b).T * float(s) + _f64(bias)
    # bf16's rounding alone is 1.7e-3 here; fast accumulation adds about 3e-3 at this K
    bar = {(True, True): 3e-3, (True, False): 6e-3, (False, True): 5e-4, (False, False): 5e-3}[
        out == jnp.bfloat16, precision is None]
    assert _rel(fn(a, b, bias, s), want) < bar
