"""The grouped (ragged) GEMM kernel on a Hopper GPU against a float64 oracle: balanced, skewed
and empty groups, groups smaller than a tile and partial tiles at every group edge, rows past
the groups, per-group biases, a tile operand, both schedules, the lhs gradient, and outputs
poisoned with NaN beforehand (every row must be written, each by its own group's tile)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    """The kernel, or an error: not the reference."""
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


def _oracle(lhs, rhs, sizes, bias, c):
    """silu(lhs @ rhs[g] + bias[g]) + c per row in float64; rows past the groups: silu(0) + c."""
    lhs, rhs, bias, c = (np.asarray(x, np.float64) for x in (lhs, rhs, bias, c))
    acc = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        acc[start:start + size] = lhs[start:start + size] @ rhs[g] + bias[g]
        start += size
    return acc / (1 + np.exp(-acc)) + c


def _inputs(rng, t, k, n, g):
    import jax.numpy as jnp

    lhs = jnp.asarray(rng.standard_normal((t, k)) / math.sqrt(k), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((g, n)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
    return lhs, rhs, bias, c


SIZES = {
    "balanced": (256, 256, 256, 256),
    "skewed": (900, 3, 0, 121),
    "empty_groups": (0, 512, 0, 0, 512, 0),
    "smaller_than_a_tile": (5, 7, 1, 2, 100, 3),
    "partial_edges": (129, 127, 128, 1, 383, 256),
    "rows_past_the_groups": (100, 50, 0, 10),
    "no_rows_in_any_group": (0, 0, 0),
}
CONFIGS = {
    "heuristic": None,
    "pingpong_128x128_c1x2": dict(tile_m=128, tile_n=128, cluster_n=2, pingpong=True, epi_n=64),
    "cooperative_128x256": dict(tile_m=128, tile_n=256),
    "pingpong_192x128_epi64x16": dict(tile_m=192, tile_n=128, pingpong=True, epi_m=64, epi_n=16),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("sizes", list(SIZES))
def test_matches_the_float64_oracle(rng, sizes, config):
    import jax
    import jax.numpy as jnp

    import jax_efc as efc
    from jax_efc.config import GemmConfig

    sizes = SIZES[sizes]
    t, k, n, g = 1024, 256, 384, len(sizes)
    lhs, rhs, bias, c = _inputs(rng, t, k, n, g)
    cfg = None if CONFIGS[config] is None else GemmConfig(**CONFIGS[config])

    @jax.jit  # (JAX_EFC_STRICT=1: the kernel, or an error)
    def run(lhs, rhs, sizes, bias, c):
        return efc.grouped_gemm(lhs, rhs, sizes, lambda acc, c, b: jax.nn.silu(acc + b) + c, c, group_operands=[bias],
                                out_dtypes=jnp.bfloat16, config=cfg)

    y = np.asarray(run(lhs, rhs, jnp.asarray(sizes, jnp.int32), bias, c), np.float64)
    want = _oracle(lhs, rhs, sizes, bias, c)
    assert not np.isnan(y).any()
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_routing_changes_do_not_recompile(rng):
    """The group sizes are read by the kernel: other sizes reuse the compiled program."""
    import jax
    import jax.numpy as jnp

    import jax_efc as efc

    t, k, n, g = 512, 128, 256, 4
    lhs, rhs, bias, c = _inputs(rng, t, k, n, g)
    run = jax.jit(lambda lhs, rhs, s, b: efc.grouped_gemm(lhs, rhs, s, lambda acc, b: jax.nn.silu(acc + b),
                                                          group_operands=[b], out_dtypes=jnp.float32))
    for sizes in ((128, 128, 128, 128), (500, 0, 12, 0), (0, 0, 0, 100)):
        y = np.asarray(run(lhs, rhs, jnp.asarray(sizes, jnp.int32), bias), np.float64)
        np.testing.assert_allclose(y, _oracle(lhs, rhs, sizes, bias, np.zeros((t, n))), rtol=2e-2, atol=2e-2)
    assert run._cache_size() == 1


def test_outputs_are_written_over_poisoned_buffers(rng):
    """Outputs donated from NaN-filled buffers of the same shape (XLA reuses them): every row,
    the rows past the groups included, is written."""
    import jax
    import jax.numpy as jnp

    import jax_efc as efc

    t, k, n, sizes = 640, 128, 256, (1, 300, 0, 77)
    lhs, rhs, bias, c = _inputs(rng, t, k, n, len(sizes))

    def run(lhs, rhs, s, b, poison):
        del poison  # donated: its buffer becomes the output's
        return efc.grouped_gemm(lhs, rhs, s, lambda acc, b: jax.nn.silu(acc + b), group_operands=[b],
                                out_dtypes=jnp.float32)

    run = jax.jit(run, donate_argnums=4)
    for _ in range(3):
        y = np.asarray(run(lhs, rhs, jnp.asarray(sizes, jnp.int32), bias, jnp.full((t, n), jnp.nan, jnp.float32)))
        assert not np.isnan(y).any()
        np.testing.assert_allclose(y, _oracle(lhs, rhs, sizes, bias, np.zeros((t, n))), rtol=2e-2, atol=2e-2)


def test_lhs_gradient_runs_the_kernel(rng):
    """d lhs = the grouped GEMM of the cotangent with each group's matrix transposed (the kernel);
    d rhs by XLA; both against float64."""
    import jax
    import jax.numpy as jnp

    import jax_efc as efc

    t, k, n, sizes = 768, 256, 128, (300, 0, 200, 100)
    lhs, rhs, _, _ = _inputs(rng, t, k, n, len(sizes))
    ct = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)

    def loss(lhs, rhs):
        return jnp.sum(efc.grouped_gemm(lhs, rhs, s, out_dtypes=jnp.float32) * ct)

    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    l64, r64, c64 = (np.asarray(x, np.float64) for x in (lhs, rhs, ct))
    want_lhs, want_rhs = np.zeros_like(l64), np.zeros_like(r64)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        want_lhs[rows] = c64[rows] @ r64[g].T
        want_rhs[g] = l64[rows].T @ c64[rows]
        start += size
    np.testing.assert_allclose(np.asarray(d_lhs, np.float64), want_lhs, atol=3e-2 * np.abs(want_lhs).max())
    np.testing.assert_allclose(np.asarray(d_rhs, np.float64), want_rhs, atol=3e-2 * np.abs(want_rhs).max())


def test_checked_on_first_use_then_the_kernel_runs(rng, tmp_path, monkeypatch):
    """Without JAX_EFC_UNVERIFIED_KERNELS an unverified grouped kernel (as it was before it ran on
    a GPU) is checked by a checking process the first time a call plans it
    (jax_efc.checking.check_grouped_call), then runs; the verdict is on disk."""
    import jax

    import jax_efc as efc
    from jax_efc import self_check
    from jax_efc.config import read_record
    from jax_efc.kernels.sm90_policy import Sm90Policy

    monkeypatch.setattr(Sm90Policy, "verified_grouped", False)
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_EFC_UNVERIFIED_KERNELS", raising=False)
    self_check._memo.clear()
    sizes = [300, 0, 77, 400]
    lhs, rhs, bias, c = _inputs(rng, 900, 256, 384, len(sizes))

    def call(lhs, rhs, c):
        return efc.grouped_gemm(lhs, rhs, np.asarray(sizes, np.int32), lambda acc, c, b: jax.nn.silu(acc + b) + c, c,
                                group_operands=[bias], out_dtypes=np.float32)

    out = jax.jit(call)(lhs, rhs, c)  # under JAX_EFC_STRICT=1 a failed check raises
    records = [read_record(self_check.folder(), p.stem) for p in (tmp_path / "self_check").glob("*.json")]
    assert records == [{"passed": True, "detail": ""}]
    want = _oracle(lhs, rhs, sizes, bias, c)
    assert np.abs(np.asarray(out, np.float64) - want).max() <= 2e-2 * np.abs(want).max()
    self_check._memo.clear()
