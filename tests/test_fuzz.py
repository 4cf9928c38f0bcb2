"""Differential fuzzing against a float64 oracle (``fuzzing.py``): on the reference path here,
through the SM90 kernel on a GPU. Fixed seeds and a bounded budget, so a run is reproducible."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

import fuzzing  # noqa: E402

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **_SETTINGS)
@given(fuzzing.cases())
def test_reference_matches_the_float64_oracle(case):
    fuzzing.run(case)


@settings(max_examples=30, **_SETTINGS)
@given(fuzzing.cases(floats32=True))
def test_gradients_match_float64_autodiff(case):
    fuzzing.run_grad(case)


@pytest.mark.gpu
@settings(max_examples=40, **_SETTINGS)
@given(fuzzing.cases(kernel=True))
def test_kernel_matches_the_float64_oracle(case):
    with fuzzing.strict():  # every call runs the kernel: none handed to XLA, none falling back
        fuzzing.run(case, kernel=True)
