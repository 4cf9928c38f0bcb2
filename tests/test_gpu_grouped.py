"""The grouped (ragged) GEMM kernel on a Hopper GPU against a float64 oracle: balanced, skewed
and empty groups, groups smaller than a tile and partial tiles at every group edge, rows past
the groups, per-group biases, a tile operand, both schedules, the lhs gradient, and outputs
poisoned with NaN beforehand (every row must be written, each by its own group's tile); and the
weight gradient's kernel (groups of the contraction) likewise, with NaN in the rows past the
groups."""

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
    "cooperative_256x128_c1x2": dict(tile_m=256, tile_n=128, cluster_n=2),
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


def test_lhs_and_rhs_gradients_run_the_kernel(rng, monkeypatch):
    """d lhs = the grouped GEMM of the cotangent with each group's matrix transposed, d rhs = each
    group's rows of lhs, transposed, times the cotangent's (the weight-gradient kernel, run
    unchecked here); both against float64."""
    import jax
    import jax.numpy as jnp

    import jax_efc as efc

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
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


# The weight gradient's GEMM (groups of the contraction): (G, M, N) from a (T, M) and b (T, N)
WGRAD_SIZES = {
    "balanced": (256, 256, 256, 256),
    "skewed": (900, 3, 0, 121),
    "partial_k_tiles": (65, 63, 64, 1, 191, 256),  # every group's last k-tile cut at its end
    "rows_past_the_groups": (100, 50, 0, 10),  # NaN there: no group may read them
    "empty_groups": (0, 512, 0, 0, 512, 0),
    "more_rows_than_given": (700, 500),  # clamped to the 1024 rows
}
WGRAD_CONFIGS = {
    "heuristic": None,
    "cooperative_256x128_c1x2": dict(tile_m=256, tile_n=128, cluster_n=2),
    "pingpong_128x192_c1x2": dict(tile_m=128, tile_n=192, cluster_n=2, pingpong=True, epi_n=32),
    "cooperative_128x256_c1x2": dict(tile_m=128, tile_n=256, cluster_n=2, epi_n=32),
    "cooperative_128x128": dict(tile_m=128, tile_n=128),
}


def _contraction_oracle(a, b, sizes):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out, start = np.zeros((len(sizes), a.shape[1], b.shape[1])), 0
    for g, size in enumerate(sizes):
        end = min(start + size, a.shape[0])
        out[g] = a[start:end].T @ b[start:end]
        start = end
    return out


def _contraction(config=None):
    import jax
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir
    from jax_efc.grouped_primitive import grouped_contraction_p

    cfg = None if config is None else GemmConfig(**config)

    def run(a, b, sizes, poison):
        del poison  # donated: its buffer becomes the output's
        return grouped_contraction_p.bind(a, b, sizes, ir=identity_ir(jnp.bfloat16), acc_dtype=np.dtype(np.float32),
                                          precision=None, config=cfg, local=False)[0]

    return jax.jit(run, donate_argnums=3)


@pytest.mark.parametrize("config", list(WGRAD_CONFIGS))
@pytest.mark.parametrize("sizes", list(WGRAD_SIZES))
def test_weight_gradient_matches_the_float64_oracle(rng, sizes, config, monkeypatch):
    """Into outputs donated from NaN-filled buffers: every group's product written (an empty
    group's as zeros), none reading another group's rows or the NaN rows past the groups."""
    import jax.numpy as jnp

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    sizes = WGRAD_SIZES[sizes]
    t, m, n = 1024, 384, 320
    a = np.asarray(rng.standard_normal((t, m)), np.float32)
    b = np.asarray(rng.standard_normal((t, n)), np.float32)
    a[sum(sizes):], b[sum(sizes):] = np.nan, np.nan
    a, b = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    run = _contraction(WGRAD_CONFIGS[config])
    for _ in range(2):
        poison = jnp.full((len(sizes), m, n), jnp.nan, jnp.bfloat16)
        got = np.asarray(run(a, b, jnp.asarray(sizes, jnp.int32), poison), np.float64)
        want = _contraction_oracle(a, b, sizes)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(want).max()))


def test_weight_gradient_checked_on_first_use_then_the_kernel_runs(rng, tmp_path, monkeypatch):
    """Unverified, the weight-gradient kernel is checked by a checking process the first time a
    call plans it (jax_efc.checking.check_contraction_call), then runs: the rhs gradient of a
    grouped GEMM against float64."""
    import jax
    import jax.numpy as jnp

    import jax_efc as efc
    from jax_efc import self_check
    from jax_efc.config import read_record
    from jax_efc.kernels.sm90_policy import Sm90Policy

    monkeypatch.setattr(Sm90Policy, "verified_grouped_k", False)
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_EFC_UNVERIFIED_KERNELS", raising=False)
    self_check._memo.clear()
    sizes = (300, 0, 77, 400)
    lhs, rhs, _, _ = _inputs(rng, 900, 256, 384, len(sizes))
    ct = jnp.asarray(rng.standard_normal((900, 384)), jnp.bfloat16)
    s = jnp.asarray(sizes, jnp.int32)
    d_rhs = jax.jit(lambda lhs, rhs: jax.vjp(lambda r: efc.grouped_gemm(lhs, r, s), rhs)[1](ct)[0])(lhs, rhs)
    records = [read_record(self_check.folder(), p.stem) for p in (tmp_path / "self_check").glob("*.json")]
    assert {"passed": True, "detail": ""} in records and all(r["passed"] for r in records), records
    want = _contraction_oracle(lhs, ct, sizes)
    assert np.abs(np.asarray(d_rhs, np.float64) - want).max() <= 2e-2 * np.abs(want).max()
    self_check._memo.clear()
