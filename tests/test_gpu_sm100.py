"""Numerics of the Blackwell (sm_100a) kernel against a float64 NumPy oracle, on a GPU of compute
capability 10.x (marked ``gpu``; skipped everywhere else, which so far is everywhere: no
Blackwell GPU has run these).

Every call runs under ``JAX_EFC_UNVERIFIED_KERNELS=1`` (unchecked: these tests are the check) and
``JAX_EFC_STRICT=1`` (a fallback to XLA is an error), and ``efc.backends`` must name the
kernel. Shapes leave partial tiles along M and N; before each call the allocator is primed with
NaN blocks of the outputs' sizes, so an element the kernel never wrote shows up as non-finite.
1-CTA and 2-CTA tiles, clusters, both majors, a batch, every input type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc


def _blackwell() -> bool:
    try:
        return str(jax.devices("cuda")[0].compute_capability).split(".")[0] == "10"
    except Exception:  # no CUDA backend
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell GPU (compute capability 10.x)")]

# the heuristic's choice, 1-CTA tiles alone and in clusters, 2-CTA tiles in clusters of one pair and more
CONFIGS = [None, efc.GemmConfig(128, 128), efc.GemmConfig(64, 128, 1, 2), efc.GemmConfig(128, 256, 2, 2),
           efc.GemmConfig(256, 256, 2, 1, use_2cta=True), efc.GemmConfig(256, 128, 4, 1, use_2cta=True),
           efc.GemmConfig(256, 256, 2, 2, use_2cta=True, swizzle=8)]


def _label(config) -> str:
    if config is None:
        return "heuristic"
    return f"{config.tile_m}x{config.tile_n}_{config.cluster_m}x{config.cluster_n}{'_2cta' if config.use_2cta else ''}"


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")


def _run(fn, *args, outputs):
    """``fn(*args)`` jitted on the kernel: compiled first, then called on an allocator primed with
    NaN blocks of each of ``outputs`` ((shape, dtype) pairs)."""
    assert all(b.startswith(("kernel (sm_100a)", "kernel (sm_103a)")) for b in efc.backends(fn, *args)), \
        efc.backends(fn, *args)
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    poison = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in outputs]
    jax.block_until_ready(poison)
    del poison
    return jax.block_until_ready(f(*args))


def _close(got, want, tol: float, what: str = "") -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert np.isfinite(got).all(), f"{what}: {got.size - np.isfinite(got).sum()} elements never written"
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: error {err:.3g} > {tol}"


def _inputs(rng, m, n, k, dtype=jnp.bfloat16, transpose_a=False, transpose_b=False, batch=None):
    lead = () if batch is None else (batch,)
    a = rng.standard_normal(lead + ((k, m) if transpose_a else (m, k))) / np.sqrt(k)
    b = rng.standard_normal(lead + ((n, k) if transpose_b else (k, n)))
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def _product(a, b, transpose_a=False, transpose_b=False):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b)


@pytest.mark.parametrize("config", CONFIGS, ids=_label)
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, True), (False, True)])
def test_gemm(rng, config, transpose_a, transpose_b):
    m, n, k = 1000, 1016, 520
    a, b = _inputs(rng, m, n, k, transpose_a=transpose_a, transpose_b=transpose_b)
    got = _run(lambda a, b: efc.gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, config=config), a, b,
               outputs=[((m, n), jnp.bfloat16)])
    _close(got, _product(a, b, transpose_a, transpose_b), 1e-2, _label(config))


def _gelu(x):
    import math

    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


@pytest.mark.parametrize("config", CONFIGS, ids=_label)
def test_fused_dense_bias_gelu(rng, config):
    m, n, k = 1288, 776, 1032
    x, w = _inputs(rng, m, n, k)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    got = _run(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu", config=config), x, w, bias,
               outputs=[((m, n), jnp.bfloat16)])
    _close(got, _gelu(_product(x, w) + np.asarray(bias, np.float64)), 1.5e-2, _label(config))


@pytest.mark.parametrize("config", CONFIGS, ids=_label)
def test_alpha_beta_two_tile_operands_two_outputs(rng, config):
    """D = 2 acc + c + 3 x and Y = acc: two TILE operands through TMA, two outputs (one fp32)."""
    m, n, k = 1000, 1032, 264
    a, b = _inputs(rng, m, n, k)
    c, x = (jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16) for _ in range(2))
    got = _run(lambda a, b, c, x: efc.gemm(a, b, lambda acc, c, x: {"D": acc * 2.0 + c + x * 3.0, "Y": acc}, c, x,
                                           out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32}, config=config),
               a, b, c, x, outputs=[((m, n), jnp.bfloat16), ((m, n), jnp.float32)])
    acc = _product(a, b)
    _close(got["D"], 2 * acc + np.asarray(c, np.float64) + 3 * np.asarray(x, np.float64), 1e-2, "D")
    _close(got["Y"], acc, 1e-4, "Y")


@pytest.mark.parametrize("config", [None, efc.GemmConfig(128, 128, 1, 2), efc.GemmConfig(256, 256, 2, 1, use_2cta=True),
                                    efc.GemmConfig(256, 128, 4, 1, use_2cta=True)], ids=_label)
def test_reductions(rng, config):
    """Column sums, row maxes and the amax, with tiles wholly past the M edge (M = 1288 leaves a
    2-CTA pair's second tile, or a cluster's last, empty): those must write no partial."""
    m, n, k, batch = 1288, 1000, 512, 2
    a, b = _inputs(rng, m, n, k, batch=batch)

    def epilogue(acc):
        return acc, jnp.sum(acc, axis=-2), jnp.max(acc, axis=-1), jnp.max(jnp.abs(acc), axis=(-2, -1))

    got = _run(lambda a, b: efc.gemm(a, b, epilogue, out_dtypes=jnp.float32, config=config), a, b,
               outputs=[((batch, m, n), jnp.float32)] * 2)
    acc = _product(a, b)
    for g, w, what in zip(got, (acc, acc.sum(-2), acc.max(-1), np.abs(acc).max((-2, -1))),
                          ("acc", "cols", "rows", "amax")):
        _close(g, w, 2e-3, what)
    again = jax.jit(lambda a, b: efc.gemm(a, b, epilogue, out_dtypes=jnp.float32, config=config))(a, b)
    for g, h in zip(got, again):  # no atomics: the same bits on every run
        assert np.array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("dtype, acc_dtype, precision", [
    (jnp.float16, jnp.float16, None), (jnp.float8_e4m3fn, None, None), (jnp.float8_e5m2, None, None),
    (jnp.int8, None, None), (jnp.uint8, None, None), (jnp.float32, None, jax.lax.DotAlgorithmPreset.TF32_TF32_F32)])
@pytest.mark.parametrize("config", [None, efc.GemmConfig(256, 128, 2, 1, use_2cta=True)], ids=_label)
def test_input_types(rng, dtype, acc_dtype, precision, config):
    m, n, k = 776, 1040, 1024
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        a = jnp.asarray(rng.integers(max(info.min, -8), 8, (m, k)), dtype)
        b = jnp.asarray(rng.integers(max(info.min, -8), 8, (k, n)), dtype)
        out, tol = jnp.int32, 0.0  # exact
    else:
        a, b = _inputs(rng, m, n, k, dtype)
        out = jnp.float32
        # fp16 accumulation keeps 11 bits over K = 1024; TF32 rounds each input to 11 bits; fp8
        # products are exact in fp32
        tol = {jnp.float16: 3e-2, jnp.float32: 5e-3}.get(dtype, 1e-4)
    got = _run(lambda a, b: efc.gemm(a, b, acc_dtype=acc_dtype, precision=precision, out_dtypes=out, config=config),
               a, b, outputs=[((m, n), out)])
    _close(got, _product(a, b), tol, str(jnp.dtype(dtype)))
