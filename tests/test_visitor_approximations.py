"""The kernels' fast erf/erfc (rational fits in ``kernels/fragment_math.py``), evaluated in float32
as the kernel does, against float64 ``math.erf``/``math.erfc``. The GPU tests check the
compiled kernels themselves against the XLA reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("cutlass")

from jax_efc.kernels import fragment_math as V  # noqa: E402

f32 = np.float32


def _horner(t, coefficients):
    result = np.full_like(t, f32(coefficients[-1]))
    for c in reversed(coefficients[:-1]):
        result = result * t + f32(c)
    return result


def _erf(x):
    x = np.clip(x, f32(-V._ERF_CLAMP), f32(V._ERF_CLAMP))
    t = x * x
    return x * _horner(t, V._ERF_P) * (f32(1) / _horner(t, V._ERF_Q))


def _erfc(z):
    a = np.abs(z)
    c = np.minimum(a, f32(V._ERFC_CLAMP))
    tail = np.exp2(a * (a * f32(-V._LOG2_E))) * _horner(c, V._ERFC_P) * (f32(1) / _horner(c, V._ERFC_Q))
    return np.where(z < 0, f32(2) - tail, tail)


def test_erf_fit_is_accurate_in_float32():
    x = np.linspace(-6, 6, 200_001, dtype=f32)
    ref = np.array([math.erf(float(v)) for v in x])
    assert np.abs(_erf(x) - ref).max() < 6e-7
    tiny = np.geomspace(1e-30, 1e-3, 200).astype(f32)  # erf keeps its relative accuracy near 0
    ref = np.array([math.erf(float(v)) for v in tiny])
    assert (np.abs(_erf(tiny) / ref - 1)).max() < 1e-6


def test_erfc_fit_keeps_relative_accuracy_in_the_tail():
    z = np.linspace(0, 9, 100_001, dtype=f32)
    ref = np.array([math.erfc(float(v)) for v in z])
    assert (np.abs(_erfc(z) / ref - 1)).max() < 1e-5
    z = np.linspace(-9, 0, 100_001, dtype=f32)
    ref = np.array([math.erfc(float(v)) for v in z])
    assert np.abs(_erfc(z) - ref).max() < 3e-7
    edges = _erfc(np.array([np.inf, -np.inf, 40.0, np.nan], dtype=f32))
    assert edges[0] == 0 and edges[1] == 2 and edges[2] == 0 and np.isnan(edges[3])
