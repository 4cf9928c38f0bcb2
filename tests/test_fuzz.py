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


@settings(max_examples=400, **_SETTINGS)
@given(fuzzing.cases(kernel=True))
def test_kernel_cases_plan_the_kernel(case):
    """Every case the kernel runs is planned for it, as an export for sm_90a is, without a GPU: a
    heuristic choice that leaves it no room (too few ring stages for its outputs) sends the call
    to XLA, not wrong but needlessly slow, and no GPU test would see it."""
    pytest.importorskip("cutlass")
    import jax
    import jax_efc as efc

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    a, b, ops, dyn = (jax.tree.map(spec, v) for v in fuzzing.inputs_of(case))
    out_dtypes = dict(case.out_dtypes) if case.as_dict else list(case.out_dtypes.values())

    def call(a, b, ops, dyn):
        return efc.gemm(a, b, fuzzing.epilogue_of(case), *ops, out_dtypes=out_dtypes, transpose_a=case.transpose_a,
                        transpose_b=case.transpose_b, **case.static, **dyn)

    with fuzzing.strict(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUTE_DSL_ARCH", "sm_90a")
        found = efc.backends(call, a, b, ops, dyn)
    assert found and all(f.startswith("kernel") for f in found), found
