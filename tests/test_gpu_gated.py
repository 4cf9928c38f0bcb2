"""Gated GEMMs on a Hopper GPU: the kernel (run unchecked, ``JAX_EFC_UNVERIFIED_KERNELS=1``,
and strict) against a float64 oracle built from the separate gate and up matrices, over outputs
primed with NaN, partial tiles along M and N, both schedules, clusters, stream-K, a batch, a
TILE operand and the first-use check itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import rel_err

pytestmark = pytest.mark.gpu


def _silu64(v):
    return v / (1 + np.exp(-v))


def _oracle(x, wg, wu, bg, bu):
    f = lambda v: np.asarray(v, np.float64)  # noqa: E731
    return _silu64(f(x) @ f(wg) + f(bg)) * (f(x) @ f(wu) + f(bu))


def _poisoned_call(fn, *args, shape, dtype):
    """``fn(*args)`` jitted, after NaN blocks of the output's size were allocated and freed, so
    that an element the kernel does not write reads NaN."""
    jax.block_until_ready(fn(*args))
    poison = jnp.full(shape, jnp.nan, dtype)
    jax.block_until_ready(poison)
    del poison
    return jax.block_until_ready(fn(*args))


@pytest.mark.parametrize("config", [
    None,  # the heuristic's
    efc.GemmConfig(128, 128, 1, 2, pingpong=True, swizzle=8, epi_n=64),
    efc.GemmConfig(128, 256, 1, 1),
    efc.GemmConfig(128, 256, 2, 1, epi_n=64),
    efc.GemmConfig(128, 128, 2, 1, swizzle=8, stream_k=True),
    # what the heuristic takes for SwiGLU's up projection from 4096 tokens
    efc.GemmConfig(192, 128, 1, 2, pingpong=True, swizzle=8, epi_m=64, epi_n=16),
])
@pytest.mark.parametrize("m, h, k, block, lead", [(1000, 1088, 1000, 64, ()), (2304, 4096, 4096, 64, ()),
                                                  (520, 576, 264, 32, (3,))])
def test_swiglu_against_the_oracle(monkeypatch, rng, config, m, h, k, block, lead):
    if config is not None and block % config.epi_n:
        pytest.skip(f"{config.epi_n}-column subtiles do not divide a block of {block}")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    x = jnp.asarray(rng.standard_normal((*lead, m, k)) / np.sqrt(k), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((k, h)), jnp.bfloat16) for _ in range(2))
    bg, bu = (jnp.asarray(rng.standard_normal(h), jnp.bfloat16) for _ in range(2))
    w = efc.interleave_gated(wg, wu, block)

    def f(x, w, bg, bu):
        return efc.gemm(x, w, lambda g, u, bg, bu: jax.nn.silu(g + bg) * (u + bu), bg, bu, gated=block,
                        config=config)

    assert efc.backends(f, x, w, bg, bu)[0].startswith("kernel")
    y = _poisoned_call(jax.jit(f), x, w, bg, bu, shape=(*lead, m, h), dtype=jnp.bfloat16)
    assert y.shape == (*lead, m, h)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{np.size(got) - np.isfinite(got).sum()} elements not written"
    assert rel_err(got, _oracle(x, wg, wu, bg, bu)) < 1e-2


def test_tile_operand_and_two_outputs(monkeypatch, rng):
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    m, h, k = 1064, 832, 512
    x = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((k, h)), jnp.bfloat16) for _ in range(2))
    c = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    out = jax.jit(lambda x, w, c: efc.gemm(x, w, lambda g, u, c: {"D": jax.nn.relu(g) * u + c, "G": g}, c,
                                           gated=32, config=efc.GemmConfig(128, 256, 2, 1)))(
        x, efc.interleave_gated(wg, wu, 32), c)
    g = np.asarray(x, np.float64) @ np.asarray(wg, np.float64)
    u = np.asarray(x, np.float64) @ np.asarray(wu, np.float64)
    assert rel_err(np.asarray(out["D"], np.float64), np.maximum(g, 0) * u + np.asarray(c, np.float64)) < 1e-2
    assert rel_err(np.asarray(out["G"], np.float64), g) < 1e-2


def test_first_use_check_passes(monkeypatch, rng):
    """Without the switch, the first call checks the kernel against the reference and runs it."""
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    x = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1024, 8192)) / 32, jnp.bfloat16)
    backends = efc.backends(lambda x, w: efc.gemm(x, w, lambda g, u: jax.nn.silu(g) * u, gated=64), x, w)
    assert backends == ["kernel (sm_90a)"], backends
