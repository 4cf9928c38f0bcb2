"""First-use checks on a GPU (marked ``gpu``): a kernel its policy calls unverified (here the
Hopper kernel's epilogue reductions, marked so for the test) is checked by a checking process
the first time a call plans it; the kernel then runs and gives the oracle's answer, and the
verdict is on disk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from jax_efc import self_check
from jax_efc.config import read_record
from jax_efc.kernels.sm90_policy import Sm90Policy

pytestmark = pytest.mark.gpu


def test_reductions_are_checked_on_first_use_then_run_the_kernel(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_EFC_STRICT", "1")  # a failed check would raise, not fall back
    monkeypatch.delenv("JAX_EFC_UNVERIFIED_KERNELS", raising=False)
    monkeypatch.setattr(Sm90Policy, "verified_reductions", False)
    self_check._memo.clear()
    m, n, k = 2296, 2824, 1288
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)

    def epilogue(acc):
        return acc, jnp.max(acc, axis=1), jnp.sum(acc, axis=0)

    f = jax.jit(lambda a, b: efc.gemm(a, b, epilogue, out_dtypes=(jnp.bfloat16, jnp.float32, jnp.float32)))
    y, rows, cols = f(a, b)
    assert efc.backends(lambda a, b: efc.gemm(a, b, epilogue), a, b)[0].startswith("kernel")
    records = [read_record(self_check.folder(), p.stem) for p in (tmp_path / "self_check").glob("*.json")]
    assert records == [{"passed": True, "detail": ""}]
    acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert np.abs(np.asarray(rows) - acc.max(1)).max() <= 2e-2 * np.abs(acc).max()
    assert np.abs(np.asarray(cols) - acc.sum(0)).max() <= 2e-2 * np.abs(acc.sum(0)).max()
    self_check._memo.clear()
