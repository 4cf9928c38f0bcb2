"""What this process can run kernels on: the GPU's architecture and SM count, how many
clusters of a persistent grid it keeps resident, and whether the CuTe DSL is importable.
Nothing here imports cutlass at import time; the queries run once and are remembered."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence

from jax_efc.log import log_once

__all__ = ["arch", "gpu_arch", "set_target_arch", "gpu_model", "driver_version", "sm_count", "residency", "dsl_reason", "use_private_dsl_cache",
           "run_on_gpu", "read_job"]


def set_target_arch(target: str) -> None:
    """Build kernels for ``target`` (``"sm_90a"``; ``"sm_100a"`` for a B200, ``"sm_103a"`` for a
    B300, ``"sm_100f"`` for either) whatever GPU this process has, or none: what ``jax.export(..., platforms=["cuda"])`` on a CPU machine needs to hold the kernels
    rather than the XLA reference. Call it before the first kernel is built; it sets
    ``CUTE_DSL_ARCH``, which the CuTe DSL reads once, when it is imported.

    >>> import jax_efc as efc
    >>> efc.set_target_arch("sm_75")
    Traceback (most recent call last):
    ...
    ValueError: set_target_arch: 'sm_75' has no jax_efc kernel; use one of ('sm_90a', 'sm_100a', 'sm_103a', 'sm_100f').
    """
    from jax_efc.kernels import SUPPORTED_ARCHS

    if target not in SUPPORTED_ARCHS:
        raise ValueError(f"set_target_arch: {target!r} has no jax_efc kernel; use one of {SUPPORTED_ARCHS}.")
    current = os.environ.get("CUTE_DSL_ARCH")
    if current == target:
        return
    if "cutlass" in sys.modules:
        raise RuntimeError(f"set_target_arch({target!r}): the CuTe DSL is already imported, building for "
                           f"{current or 'the GPU it found'}; call set_target_arch before the first kernel "
                           "is built (or set CUTE_DSL_ARCH in the environment).")
    os.environ["CUTE_DSL_ARCH"] = target


def arch() -> str | None:
    """The architecture kernels are built for: :func:`set_target_arch`'s (``CUTE_DSL_ARCH``)
    if set, else the first CUDA device's (``"sm_90a"``, ``"sm_100a"``), else ``None``."""
    return os.environ.get("CUTE_DSL_ARCH") or gpu_arch()


def gpu_arch() -> str | None:
    """The first CUDA device's architecture (``"sm_90a"``, ``"sm_100a"``), or ``None``."""
    try:
        import jax

        dev = jax.devices("cuda")[0]
        major, minor = str(dev.compute_capability).split(".")
    except Exception:  # no CUDA backend, or a device without a compute capability
        return None
    return f"sm_{major}{minor}a" if major in ("9", "10") else f"sm_{major}{minor}"


def driver_version() -> str:
    """The CUDA runtime and driver the first CUDA device runs under, as its JAX client reports
    them ("" without one): a first-use check's verdict is kept for it."""
    try:
        import jax

        return str(jax.devices("cuda")[0].client.platform_version)
    except Exception:  # no CUDA backend
        return ""


def gpu_model() -> tuple[str, int] | None:
    """(model, SM count) of the first CUDA device, or None: what timings and checks made on one
    GPU are kept for."""
    try:
        import jax

        dev = jax.devices("cuda")[0]
    except Exception:  # no CUDA backend
        return None
    return dev.device_kind, sm_count(0)


@functools.cache
def sm_count(default: int) -> int:
    """SMs of the first CUDA device (it sizes the tile heuristic and the persistent grid);
    ``default`` without one."""
    try:
        import jax

        return int(jax.devices("cuda")[0].core_count)
    except Exception:
        return default


def _query_max_active_clusters(cluster_size: int, ordinal: int = 0) -> int:
    """Clusters of ``cluster_size`` one-CTA-per-SM blocks CUDA device ``ordinal`` runs at once,
    asked of the driver's occupancy calculator in the device's primary context (which JAX
    shares). Raises without a driver or a device."""
    from cuda.bindings import driver
    from cutlass.utils import HardwareInfo

    def check(result):  # cuda-bindings return (CUresult, *values)
        err, *value = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err}")
        return value[0] if value else None

    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(ordinal))
    check(driver.cuCtxPushCurrent(check(driver.cuDevicePrimaryCtxRetain(device))))
    try:
        return int(HardwareInfo().get_max_active_clusters(cluster_size))
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)


@functools.cache
def _measured_clusters(cluster_size: int, ordinal: int) -> int | None:
    try:
        return _query_max_active_clusters(cluster_size, ordinal)
    except Exception:  # no driver, or no such device
        return None


def residency(cluster_size: int, devices: Sequence[int] | None, assumed: int) -> tuple[int, bool]:
    """The persistent grid's size in clusters, and whether all of it is known to be resident at
    once on the devices the call runs on: ``devices`` lists their ordinals; empty means
    unknown (an exported program may run on any GPU: a smaller one, a MIG slice); None means
    the process's first CUDA device or, with none (compiling on a CPU for a test), the GPU
    the architecture's policy assumes (``assumed`` clusters).

    Measured, the grid is the smallest of the devices' answers. Unknown, or with MPS limiting
    the SMs a process may use, it is the assumed one, and not resident: a grid larger than the
    GPU then runs in two waves, which only costs time, but the schedule must not make CTAs
    wait on one another (stream-K), since a waiting CTA can hold the SM a waited-for one needs."""
    mps = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    if mps and mps not in ("100", "100.0"):
        return assumed, False
    if devices is None:
        measured = _measured_clusters(cluster_size, 0)
        return (assumed, True) if measured is None else (measured, True)
    answers = [_measured_clusters(cluster_size, d) for d in devices]
    if not answers or None in answers:
        return assumed, False
    return min(answers), True


def use_private_dsl_cache() -> None:
    """Point the DSL's on-disk cache (else a predictable path under /tmp) into jax_efc's
    per-user cache directory, made owner-only; a ``CUTE_DSL_CACHE_DIR`` the user set wins.
    Must run before cutlass is first imported: the DSL reads the variable then."""
    if "CUTE_DSL_CACHE_DIR" in os.environ:
        return
    from jax_efc.config import private_cache_dir

    try:
        os.environ["CUTE_DSL_CACHE_DIR"] = private_cache_dir("cute_dsl")
    except OSError as e:
        log_once(logging.WARNING, f"the CuTe DSL keeps its default cache directory: {e}")


@functools.cache
def dsl_reason() -> str | None:
    """Why the kernels cannot be built in this process (``None``: they can)."""
    use_private_dsl_cache()
    try:
        import cutlass.jax as cjax
    except Exception as e:  # not installed, or broken
        return f"the CuTe DSL (nvidia-cutlass-dsl) is not importable ({type(e).__name__}: {e}); install it to use the kernels."
    if not cjax.is_available():
        return "cutlass.jax is not available with this JAX version; upgrade JAX or nvidia-cutlass-dsl."
    return None


@functools.cache
def build_versions() -> tuple:
    """jax_efc's, the DSL's and JAX's versions, and a digest of the sources that generate kernel
    code (``ffi/`` and ``kernels/``): what a stored kernel or a timing record was made with."""
    import hashlib
    import importlib.metadata

    import jax

    import jax_efc

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(jax_efc.__file__))
    for root in (os.path.join(here, "ffi"), os.path.join(here, "kernels")):
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read())
    return (jax_efc.__version__, version("nvidia-cutlass-dsl"), jax.__version__, digest.hexdigest())


def run_on_gpu(module: str, avals: Sequence, params: dict, **env: str) -> tuple[bool, str]:
    """Run ``python -m module JOB`` in a fresh interpreter on this process's GPU, JOB holding a
    fused-GEMM call's input specs and parameters (what autotuning and first-use checks time or
    check, outside the program being traced or lowered); returns (whether it exited 0, the last
    line it wrote to stderr)."""
    import pickle
    import subprocess
    import tempfile

    specs = [(tuple(a.shape), str(a.dtype)) for a in avals]
    with tempfile.TemporaryDirectory(prefix="jax_efc-job-") as tmp:
        job = os.path.join(tmp, "job.pickle")
        with open(job, "wb") as f:
            pickle.dump((specs, {k: v for k, v in params.items() if k != "local"}), f)
        # the parent holds most of the GPU's memory (JAX preallocates); the child takes what it uses
        full_env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_EFC_AUTOTUNE="0",
                        JAX_EFC_COMPILE_AHEAD="0", **env)
        proc = subprocess.run([sys.executable, "-m", module, job], env=full_env, capture_output=True, text=True)
    return proc.returncode == 0, (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]


def read_job(path: str) -> tuple[list, dict]:
    """The (input specs, parameters) :func:`run_on_gpu` wrote."""
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)

