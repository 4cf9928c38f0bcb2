"""The CUDA lowering on a machine without a GPU (``jax.export`` for CUDA with
``CUTE_DSL_ARCH=sm_90a``): what it does with calls no kernel should run, and with a kernel that
fails to build. One child process runs every case (the DSL reads its settings at import)."""

from __future__ import annotations

import json

import pytest

from conftest import KEEP_LOGS, run_for_sm90

_SCRIPT = KEEP_LOGS + """
import json, logging, os
import jax, jax.numpy as jnp
import jax_efc as efc
import jax_efc.ffi as F
from cutlass.jax import get_export_disabled_safety_checks

S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
out = {}

def kernels(fn, *specs):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=get_export_disabled_safety_checks())(*specs)
    return exported.mlir_module().count("NvJaxCutlassCall")

def strict(fn, *specs):
    os.environ["JAX_EFC_STRICT"] = "1"
    try:
        kernels(fn, *specs)
        return "no error"
    except efc.FallbackError as e:
        return str(e)
    finally:
        del os.environ["JAX_EFC_STRICT"]

def dense(x, w, b):
    return efc.fused_dense(x, w, b, activation="gelu")

def loss(x, w, b):
    return dense(x, w, b).astype(jnp.float32).sum()

# empty problems, forward and backward: the reference, quietly, also under strict mode
for m, k, n in [(0, 256, 256), (256, 0, 256), (256, 256, 0)]:
    specs = S((m, k), bf), S((k, n), bf), S((n,), bf)
    out[f"empty {m}x{k}x{n}"] = [kernels(dense, *specs), kernels(jax.grad(loss, (0, 1, 2)), *specs),
                                 strict(lambda *a: dense(*a), *specs)]
out["empty batch"] = kernels(lambda a, b: efc.gemm(a, b), S((0, 256, 256), bf), S((0, 256, 256), bf))
out["empty warnings"] = len(logged)

# symbolic dimensions: the reference, with the reason; strict mode raises it
specs = S(jax.export.symbolic_shape("m, 256"), bf), S((256, 256), bf), S((256,), bf)
out["symbolic"] = kernels(dense, *specs)
out["symbolic strict"] = strict(lambda *a: dense(*a), *specs)

# an exported program never makes CTAs wait on one another (stream-K): it may run on a GPU
# with fewer SMs than the one it was planned for
cfg = efc.GemmConfig(128, 128, 1, 2, pingpong=True, swizzle=8)
big = S((8192, 8192), bf), S((8192, 8192), bf), S((8192,), bf)
out["stream-K export"] = kernels(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu", config=cfg), *big)
out["stream-K planned"] = [bool(k.schedule.stream_k) for k in F._KERNELS.values()]

# the DSL failing while the call is lowered (it compiles then): the reference, in a module
# that is still whole, forward and backward
import cutlass.cute
compile_kernel = cutlass.cute.compile
def dsl_fails(*args, **kwargs):
    raise RuntimeError("forced DSL failure")
cutlass.cute.compile = dsl_fails
specs = S((1024, 1536), bf), S((1536, 1536), bf), S((1536,), bf)
out["failed compile"] = [kernels(dense, *specs), kernels(jax.grad(loss, (0, 1, 2)), *specs)]
cutlass.cute.compile = compile_kernel

# a kernel that fails to build falls back, with the reason logged once; strict mode raises it
def fail(*args, **kwargs):
    raise RuntimeError("forced build failure")
F._kernel = fail
specs = S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf)
logged.clear()
out["failed build"] = [kernels(dense, *specs), kernels(lambda *a: dense(*a), *specs)]
out["failed build logs"] = logged
out["failed build strict"] = strict(lambda *a: dense(*a), *specs)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lowered():
    pytest.importorskip("cutlass.jax")
    return json.loads(run_for_sm90(_SCRIPT).strip().splitlines()[-1])


def test_empty_problems_lower_to_the_reference_quietly(lowered):
    for shape in ("0x256x256", "256x0x256", "256x256x0"):
        assert lowered[f"empty {shape}"] == [0, 0, "no error"], shape
    assert lowered["empty batch"] == 0
    assert lowered["empty warnings"] == 0


def test_symbolic_dimensions_fall_back_with_the_reason(lowered):
    assert lowered["symbolic"] == 0
    assert "symbolic dimensions" in lowered["symbolic strict"]
    assert "static shapes" in lowered["symbolic strict"]


def test_exported_programs_plan_no_cross_cta_waits(lowered):
    assert lowered["stream-K export"] == 1
    assert lowered["stream-K planned"] == [False]


def test_a_kernel_that_fails_to_build_falls_back(lowered):
    assert lowered["failed compile"] == [0, 0]
    assert lowered["failed build"] == [0, 0]
    logs = [m for m in lowered["failed build logs"] if "forced build failure" in m]
    assert len(logs) == 1 and "building the kernel failed (RuntimeError" in logs[0]
    assert "forced build failure" in lowered["failed build strict"]
    assert "JAX_EFC_STRICT=1" in lowered["failed build strict"]


_WITHOUT_DSL = """
import sys
sys.modules["cutlass"] = sys.modules["cutlass.jax"] = None  # as if jax_efc[cuda13] were not installed
import os
import jax, jax.numpy as jnp
import jax_efc as efc
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
specs = S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf)
exported = jax.export.export(jax.jit(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu")),
                             platforms=["cuda"])(*specs)
print(exported.mlir_module().count("custom_call"))
os.environ["JAX_EFC_STRICT"] = "1"
try:
    jax.export.export(jax.jit(lambda x, w, b: efc.fused_dense(x, w, b)), platforms=["cuda"])(*specs)
except efc.FallbackError as e:
    print(e)
"""


def test_without_the_dsl_the_reference_runs_and_says_why():
    count, reason = run_for_sm90(_WITHOUT_DSL).strip().splitlines()[-2:]
    assert count == "0"
    assert "nvidia-cutlass-dsl" in reason and "not importable" in reason
