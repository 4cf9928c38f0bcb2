"""On an SM90 GPU: the kernel's own fast math against float64, empty and mixed calls through
the CUDA lowering, the persistent grid beyond the GPU's residency, and compute-sanitizer over
the kernel's variants."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc

pytestmark = pytest.mark.gpu

_ERF = np.vectorize(math.erf, otypes=[np.float64])
_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


def _inputs(rng, m, n, k, scale=1.0):
    a = jnp.asarray(rng.standard_normal((m, k)) * scale / math.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return a, b, acc


def test_erf_and_erfc_fits_through_the_kernel(rng):
    # accumulators spread over [-6, 6]: the fits' whole range, their clamps included
    a, b, acc = _inputs(rng, 1024, 512, 256, scale=3.0)
    cfg = efc.GemmConfig(128, 128)
    out = jax.jit(lambda a, b: efc.gemm(a, b, lambda acc: (jax.lax.erf(acc), jax.lax.erfc(acc)),
                                        out_dtypes=jnp.float32, config=cfg))(a, b)
    assert efc.backends(lambda a, b: efc.gemm(a, b, jax.lax.erf, config=cfg), a, b) == ["kernel (sm_90a)"]
    erf, erfc = (np.asarray(o, np.float64) for o in out)
    # the fits' error (about 3e-6) is far below the 16-bit outputs' rounding
    assert np.abs(erf - _ERF(acc)).max() < 5e-6
    # erfc is judged relative to itself too: its tail is what erfc is for
    assert (np.abs(erfc - _ERFC(acc)) <= 5e-6 + 1e-5 * _ERFC(acc)).all()


@pytest.mark.parametrize("m, k, n", [(0, 256, 256), (256, 0, 256), (256, 256, 0)])
def test_empty_problems_run(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    y = jax.jit(lambda *t: efc.fused_dense(*t, activation="gelu"))(x, w, bias)
    want = jax.nn.gelu(np.zeros((m, n)) + np.asarray(bias, np.float64), approximate=False)
    np.testing.assert_allclose(np.asarray(y, np.float64), want if k == 0 else np.zeros((m, n)), atol=1e-2)
    grads = jax.jit(jax.grad(lambda *t: efc.fused_dense(*t, activation="gelu").astype(jnp.float32).sum(),
                             (0, 1, 2)))(x, w, bias)
    assert [g.shape for g in grads] == [x.shape, w.shape, bias.shape]


def test_the_product_path_plans_stream_k_on_a_measured_gpu(rng):
    """jit on the GPU knows its device: the schedule may split the last rounds (stream-K)."""
    from jax_efc import ffi

    cfg = efc.GemmConfig(128, 128)  # 32 tiles on 132 SMs: every tile's k-iterations are split
    a, b, acc = _inputs(rng, 1024, 512, 8192)
    before = set(ffi._KERNELS)
    y = jax.jit(lambda a, b: efc.gemm(a, b, out_dtypes=jnp.float32, config=cfg))(a, b)
    new = [ffi._KERNELS[k] for k in set(ffi._KERNELS) - before]
    assert new and all(k.schedule.stream_k is not None for k in new)
    assert np.abs(np.asarray(y, np.float64) - acc).max() < 1e-3


def test_a_grid_beyond_the_gpus_residency_runs_in_waves(rng, monkeypatch):
    """Where residency is unknown the grid may exceed what the GPU holds at once: with no CTA
    waiting on another, the surplus runs as a second wave and the answer is right."""
    from jax_efc import device, ffi, plan

    measured = device.residency(2, None, 0)[0]
    monkeypatch.setattr(device, "residency", lambda size, devices, assumed: (2 * measured, False))
    plan._plan_kernel.cache_clear()  # plans made before the patch
    cfg = efc.GemmConfig(128, 128, 1, 2, pingpong=True, swizzle=8)
    a, b, acc = _inputs(rng, 4096, 4096, 4096)
    before = set(ffi._KERNELS)
    y = jax.jit(lambda a, b: efc.gemm(a, b, jnp.tanh, out_dtypes=jnp.float32, config=cfg))(a, b)
    (kernel,) = [ffi._KERNELS[k] for k in set(ffi._KERNELS) - before]
    assert kernel.schedule.clusters == 2 * measured and kernel.schedule.stream_k is None
    assert np.abs(np.asarray(y, np.float64) - np.tanh(acc)).max() < 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_finds_nothing(tool):
    """memcheck and racecheck over the kernel's variants on partial-tile shapes
    (``sanitize_variants.py``): ping-pong and cooperative, stream-K, clusters 1/2/4, several
    outputs and TILE operands."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    script = os.path.join(os.path.dirname(__file__), "sanitize_variants.py")
    # device-side errors only: a host API call returning an error code (as the driver's
    # occupancy query does for a cluster shape it rejects) is the caller's to handle
    # racecheck instruments every shared-memory access, so it watches only jax_efc's kernels
    # (the DSL names them kernel_cutlass_kernel_<module path>...); memcheck watches all
    only_ours = ["--kernel-name", "kns=kernel_cutlass_kernel_jax_efc"] if tool == "racecheck" else []
    proc = subprocess.run([sanitizer, f"--tool={tool}", "--error-exitcode=99", "--target-processes=all",
                           "--report-api-errors=no", *only_ours, sys.executable, script], capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    summary = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert summary in proc.stdout + proc.stderr, tail
    assert "variants ok" in proc.stdout, tail
