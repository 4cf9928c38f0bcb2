"""Shared fixtures; GPU tests skip cleanly where no CUDA device is present."""

import jax
import numpy as np
import pytest


# eight host devices, so the sharding tests run on any machine
jax.config.update("jax_num_cpu_devices", 8)


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

