"""The plan of a call (``jax_efc.plan``): computed once per lowering and read by the lowering,
``efc.backends`` and the launch; the architecture registry that supplies its policy."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import pytest

import jax_efc as efc
from conftest import KEEP_LOGS, run_for_sm90
from jax_efc import kernels, plan
from jax_efc.epilogue import identity_ir
from jax_efc.kernels.sm90_policy import Sm90Policy

_S = jax.ShapeDtypeStruct


def _params(config=None):
    return dict(ir=identity_ir(jnp.bfloat16), transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                config=config, precision=None)


def test_the_plan_says_which_backend_and_why(monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv("JAX_EFC_STRICT", raising=False)
    big, small = _S((4096, 4096), jnp.bfloat16), _S((64, 4096), jnp.bfloat16)
    p = plan.plan_call([big, big], _params())
    assert p.backend == "kernel" and p.reason is None and p.arch == "sm_90a"
    assert p.mnkl == (4096, 4096, 4096, 1) and p.config.pingpong and p.schedule.clusters > 0
    handed = plan.plan_call([small, big], _params())  # the heuristic's choice: XLA's GEMM
    assert handed.backend == "reference" and handed.level == logging.INFO and "rows share each B" in handed.reason
    empty = plan.plan_call([_S((0, 64), jnp.bfloat16), _S((64, 64), jnp.bfloat16)], _params())
    assert empty.backend == "reference" and empty.level == 0
    odd = plan.plan_call([_S((256, 1001), jnp.bfloat16), _S((1001, 256), jnp.bfloat16)], _params())
    assert odd.backend == "reference" and odd.level == logging.WARNING and "K=1001" in odd.reason
    monkeypatch.setenv("JAX_EFC_DISABLE", "1")
    assert plan.plan_call([big, big], _params()).reason == "JAX_EFC_DISABLE is set."


def test_a_plan_is_memoised_on_what_decides_it(monkeypatch):
    pytest.importorskip("cutlass")
    calls = []
    choose = Sm90Policy.choose_config
    monkeypatch.setattr(Sm90Policy, "choose_config", lambda self, *a, **k: calls.append(a) or choose(self, *a, **k))
    plan._plan_kernel.cache_clear()
    spec = _S((2048, 4096), jnp.bfloat16)
    kw = dict(transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=None, arch="sm_90a")
    first = plan.plan_kernel(identity_ir(jnp.bfloat16), spec, _S((4096, 4096), jnp.bfloat16), [], **kw)
    again = plan.plan_kernel(identity_ir(jnp.bfloat16), spec, _S((4096, 4096), jnp.bfloat16), [], **kw)
    assert again is first and len(calls) == 1
    # another device set, another N, another dtype: planned anew
    plan.plan_kernel(identity_ir(jnp.bfloat16), spec, _S((4096, 4096), jnp.bfloat16), [], devices=(), **kw)
    plan.plan_kernel(identity_ir(jnp.bfloat16), spec, _S((4096, 2048), jnp.bfloat16), [], **kw)
    f16 = _S((2048, 4096), jnp.float16)
    plan.plan_kernel(identity_ir(jnp.float16), f16, _S((4096, 4096), jnp.float16), [], **kw)
    assert len(calls) == 4


def test_an_sm_margin_shrinks_the_grid_and_is_the_kernels_own(monkeypatch):
    """A call whose results feed a collective plans the heuristic's config for the SMs the
    margin leaves and a grid that fits them; the margin is part of the config (so of every key
    the config is in); a pinned config keeps its own margin, and one that leaves less than a
    cluster falls back with the reason."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    big = _S((8192, 8192), jnp.bfloat16)
    full = plan.plan_call([big, big], _params())
    spared = plan.plan_call([big, big], {**_params(), "feeds_collective": True})
    sms = Sm90Policy.default_sm_count
    assert full.config.sm_margin == 0 and spared.config.sm_margin == plan.COLLECTIVE_SM_MARGIN
    cluster = spared.config.cluster_m * spared.config.cluster_n
    assert spared.schedule.clusters * cluster <= sms - plan.COLLECTIVE_SM_MARGIN < full.schedule.clusters * cluster
    assert spared.problem.compile_key != full.problem.compile_key
    pinned = efc.GemmConfig(128, 256, 2, 1, sm_margin=32)
    kept = plan.plan_call([big, big], {**_params(pinned), "feeds_collective": True})
    assert kept.config.sm_margin == 32 and kept.schedule.clusters * 2 <= sms - 32
    with pytest.raises(ValueError, match="sm_margin=200 leaves fewer than a cluster"):
        plan.plan_call([big, big], _params(efc.GemmConfig(128, 256, 2, 1, sm_margin=200)))
    with pytest.raises(ValueError, match="sm_margin=-1 must be 0 or more"):
        efc.GemmConfig(sm_margin=-1)


def test_an_architecture_is_a_registry_line(monkeypatch):
    """A policy registered for a new architecture decides its calls' plans, and its kernel class
    is the one the launch builds, with nothing else changed."""
    pytest.importorskip("cutlass")
    from jax_efc import ffi

    built = []

    class Kernel:
        def __init__(self, problem, schedule, timeline):
            built.append(problem.arch)
            self.schedule = schedule

    class Policy(Sm90Policy):
        arch = "sm_00x"

        def kernel_class(self):
            return Kernel

        def config_reason(self, config):
            return "sm_00x takes 64-wide tiles only." if config.tile_n != 64 else None

        def choose_config(self, problem, m, n, k, l, sm_count=132):
            return efc.GemmConfig(tile_m=128, tile_n=64)

    monkeypatch.setitem(kernels._ARCHITECTURES, "sm_00x", "fake")
    monkeypatch.setattr(kernels, "policy", lambda arch: Policy() if arch == "sm_00x" else None)
    monkeypatch.setattr(plan, "policy", kernels.policy)
    monkeypatch.setattr(ffi, "policy", kernels.policy)
    spec = _S((4096, 4096), jnp.bfloat16)
    kw = dict(transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, arch="sm_00x")
    p = plan.plan_kernel(identity_ir(jnp.bfloat16), spec, spec, [], config=None, **kw)
    assert p.backend == "kernel" and p.config.tile_n == 64
    refused = plan.plan_kernel(identity_ir(jnp.bfloat16), spec, spec, [], config=efc.GemmConfig(), **kw)
    assert refused.reason == "sm_00x takes 64-wide tiles only."
    ffi._kernel(p, False)
    assert built == ["sm_00x"]
    assert "no jax_efc kernel for sm_89" in plan.plan_kernel(identity_ir(jnp.bfloat16), spec, spec, [], config=None,
                                                              **dict(kw, arch="sm_89")).reason


_LOWERED_ONCE = """
import json
import jax, jax.numpy as jnp
import jax_efc as efc
from jax_efc import device
from jax_efc.kernels.sm90_policy import Sm90Policy
from cutlass.jax import get_export_disabled_safety_checks

counts = {"choose_config": 0, "arch": 0}
choose, arch = Sm90Policy.choose_config, device.arch
def counted_choose(self, *a, **k):
    counts["choose_config"] += 1
    return choose(self, *a, **k)
def counted_arch():
    counts["arch"] += 1
    return arch()
Sm90Policy.choose_config, device.arch = counted_choose, counted_arch
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
loss = lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu").astype(jnp.float32).sum()
exported = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"],
                             disabled_checks=get_export_disabled_safety_checks())(
    S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf))
counts["kernels"] = exported.mlir_module().count("custom_call @CuteDSLRT")
print(json.dumps(counts))
"""


def test_one_lowering_plans_each_call_once():
    """A training step's three GEMMs: the device's architecture is asked and the config chosen
    once per GEMM as it is lowered; the launch reads the same plan."""
    pytest.importorskip("cutlass.jax")
    counts = json.loads(run_for_sm90(_LOWERED_ONCE).strip().splitlines()[-1])
    assert counts == {"choose_config": 3, "arch": 3, "kernels": 3}


_TARGET = KEEP_LOGS + """
import json, logging, os, sys
import jax, jax.numpy as jnp
import jax_efc as efc

S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
specs = S((4096, 4096), bf), S((4096, 4096), bf), S((4096,), bf)
dense = lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu")
out = {}
try:
    efc.set_target_arch("sm_75")
except ValueError as e:
    out["bad arch"] = str(e)
if sys.argv[1] == "target":
    efc.set_target_arch("sm_90a")
out["backends"] = efc.backends(dense, *specs)
exported = jax.export.export(jax.jit(dense), platforms=["cuda"], disabled_checks=efc.export_checks())(*specs)
out["kernels"] = exported.mlir_module().count("custom_call @CuteDSLRT")
out["logged"] = logged
try:
    os.environ.pop("CUTE_DSL_ARCH", None)
    efc.set_target_arch("sm_90a")
    out["late"] = "accepted"
except RuntimeError as e:
    out["late"] = str(e)
print(json.dumps(out))
"""


def _target_run(mode: str) -> dict:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _TARGET, mode], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_exporting_on_a_cpu_takes_an_explicit_target():
    """Without a GPU, an export for CUDA holds the kernel only after set_target_arch; without
    it the reference, with a warning that says how to get the kernel. efc.backends says
    beforehand which the export will hold."""
    pytest.importorskip("cutlass.jax")
    with_target = _target_run("target")
    assert with_target["backends"] == ["kernel (sm_90a)"] and with_target["kernels"] == 1
    assert "has no jax_efc kernel; use one of" in with_target["bad arch"]
    assert "already imported" in with_target["late"]  # the DSL read the arch when it was imported
    without = _target_run("none")
    assert without["backends"] == ["reference: platform cpu has no jax_efc kernel"] and without["kernels"] == 0
    assert any("exporting for CUDA without a target architecture" in m and "set_target_arch" in m
               for m in without["logged"]), without["logged"]


def test_the_launch_refuses_arrays_its_plan_was_not_made_for():
    pytest.importorskip("cutlass.jax")
    from jax_efc import ffi

    spec = _S((256, 256), jnp.bfloat16)
    p = plan.plan_kernel(identity_ir(jnp.bfloat16), spec, spec, [], transpose_a=False, transpose_b=False,
                         acc_dtype=jnp.float32, config=None, arch="sm_90a")
    for a, b in ((_S((256, 512), jnp.bfloat16), _S((512, 256), jnp.bfloat16)),  # another K
                 (_S((256, 256), jnp.float16), _S((256, 256), jnp.float16)),  # another dtype
                 (_S((2, 256, 256), jnp.bfloat16), spec)):  # batched
        with pytest.raises(ValueError, match="not the ones the plan was made for"):
            jax.jit(lambda a, b: ffi.fused_gemm(a, b, plan=p)).trace(a, b)
    refused = plan.plan_kernel(identity_ir(jnp.bfloat16), _S((256, 1001), jnp.bfloat16), _S((1001, 256), jnp.bfloat16),
                               [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=None,
                               arch="sm_90a")
    with pytest.raises(ValueError, match="kernel cannot run this GEMM: .*K=1001"):
        jax.jit(lambda a, b: ffi.fused_gemm(a, b, plan=refused)).trace(spec, spec)


@pytest.mark.parametrize("outputs, k, tile", [(5, 96, (128, 128)), (7, 96, (128, 128)), (12, 96, (64, 128)),
                                              (6, 48, (128, 128)), (12, 48, (64, 128))])
def test_many_wide_outputs_get_subtiles_that_leave_the_ring_two_stages(monkeypatch, outputs, k, tile):
    """Five or more fp32 outputs beside an fp32 TILE operand (what an epilogue split at a
    reduction can ask the GEMM to store) left 128x32 subtiles too little shared memory for two
    stages, and the call went to XLA; the heuristic now narrows the subtiles, then the tile,
    whichever tile it took (K = 48, one k-tile, takes 128x256 first)."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.sm90_policy import pipeline_stages
    from jax_efc.tracing import trace_epilogue

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_STRICT", "1")  # the kernel, though XLA would run 6 tiles faster

    def epilogue(acc, c):
        return tuple(acc * (i + 1) + c for i in range(outputs))

    shape = (3, 138, 104)
    ir, *_ = trace_epilogue(epilogue, shape, [shape], [jnp.float32], {}, {}, [jnp.float32] * outputs,
                            jnp.float32)
    params = dict(_params(), ir=ir)
    p = plan.plan_call([_S((3, 138, k), jnp.bfloat16), _S((3, k, 104), jnp.bfloat16), _S(shape, jnp.float32)],
                       params)
    assert p.backend == "kernel", p.reason
    assert (p.config.tile_m, p.config.tile_n, p.config.epi_n) == (*tile, 16), p.config
    assert pipeline_stages(p.problem) >= 2
