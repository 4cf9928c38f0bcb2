"""Shared fixtures; GPU tests skip cleanly where no CUDA device is present."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest


# eight host devices, so the sharding tests run on any machine
jax.config.update("jax_num_cpu_devices", 8)

# Tests count on kernels being compiled (their PTX, forced compile failures): the on-disk kernel
# cache is off for them unless a test turns it on, and jax_efc's caches live in a directory of
# this run's, not the user's.
os.environ.setdefault("JAX_EFC_KERNEL_CACHE", "0")
if "JAX_EFC_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_EFC_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_efc-tests-")
    atexit.register(shutil.rmtree, os.environ["JAX_EFC_CACHE_DIR"], ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """Fresh random data per test: a NumPy generator seeded from the test's name."""
    import zlib
    import os

    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    return np.random.default_rng(seed)


def rel_err(x, ref) -> float:
    """Relative Frobenius error, computed in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))



# a child script's first lines: jax_efc's log messages collected into ``logged``
KEEP_LOGS = """
import logging
logged = []
class Keep(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("jax_efc").addHandler(Keep())
"""


def run_for_sm90(script: str, *args: str, **env: str) -> str:
    """Runs ``script`` in a fresh CPU-only process that compiles kernels for sm_90a, with the
    project on its path; returns its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu", **env,
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
