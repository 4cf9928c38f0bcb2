"""First-use checks (``jax_efc.self_check``) without a GPU: the problems a kernel is checked on, the
comparison, and the plan's screening with the checking process replaced: a pass runs the kernel,
a failure or a checking process that stops runs the reference and says why, verdicts are kept on
disk per GPU model and kernel, and ``JAX_EFC_UNVERIFIED_KERNELS=1`` skips the check."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_efc import checking, device, self_check
from jax_efc.config import GemmConfig, read_record

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("config", [GemmConfig(128, 128, 1, 2, pingpong=True), GemmConfig(256, 128, 2, 1),
                                    GemmConfig(128, 256, 2, 2), GemmConfig(64, 128)])
@pytest.mark.parametrize("tile_k", [32, 64, 128])
def test_the_check_problems_cross_every_edge(config, tile_k):
    m, n, k, l = checking.check_shapes(config, tile_k, batched=True)
    assert l == 2
    for size, tile, cluster in ((m, config.tile_m, config.cluster_m), (n, config.tile_n, config.cluster_n)):
        tiles = -(-size // tile)
        assert size % tile, "a partial last tile"
        assert (cluster == 1 or tiles % cluster) and tiles > 2 * cluster, "a tile count the cluster does not divide"
        assert size % 16 == 0
    assert k % tile_k and k // tile_k > 8, "a partial k-tile, and more k-tiles than the ring has stages"
    assert k % 16 == 0
    assert checking.check_shapes(config, tile_k, batched=False)[3] == 1


def test_the_comparison_catches_misplaced_values_and_nan():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((64, 48))
    tol = checking._tolerance("bfloat16", "bfloat16", fast=False)
    near = want * (1 + 2.0 ** -9 * rng.uniform(-1, 1, want.shape))
    assert checking.compare([near], [want], ["y"], [tol]) is None
    moved = want.copy()
    moved[5] = want[6]  # one row where another belongs
    assert "output 'y' is off by" in checking.compare([moved], [want], ["y"], [tol])
    holed = want.copy()
    holed[3, 3] = np.nan
    assert "NaN" in checking.compare([holed], [want], ["y"], [tol])
    assert "shape" in checking.compare([want[:8]], [want], ["y"], [tol])
    ints = np.arange(12.0).reshape(3, 4)
    assert checking.compare([ints + 1], [ints], ["i"], [checking._tolerance("int32", "int8", False)]) is None
    assert checking.compare([ints + 2], [ints], ["i"], [checking._tolerance("int32", "int8", False)])


def _plan(epilogue=None):
    """The plan of a 4096 x 4096 x 2048 GEMM with ``epilogue`` (default: with a column sum, which
    the ``gpu`` fixture marks unverified), as a process on a GPU makes it."""
    import jax_efc as efc
    from jax_efc.plan import plan_call
    from jax_efc.primitive import fused_gemm_eqns

    epilogue = epilogue or (lambda acc: (acc, jnp.sum(acc, axis=0)))
    a = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    (eqn,) = fused_gemm_eqns(jax.make_jaxpr(lambda a, b: efc.gemm(a, b, epilogue))(a, b))
    return plan_call([v.aval for v in eqn.invars], eqn.params, devices=None)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """An H200 as far as the plan can tell, on which the Hopper kernel's reductions have not
    run, and a checking process whose verdict the test sets."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.sm90_policy import Sm90Policy

    monkeypatch.setattr(Sm90Policy, "verified_reductions", False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAX_EFC_UNVERIFIED_KERNELS", raising=False)
    monkeypatch.setattr(device, "gpu_model", lambda: ("NVIDIA H200", 132))
    monkeypatch.setattr(device, "gpu_arch", lambda: "sm_90a")
    runs = []

    def run_on_gpu(module, avals, params, **env):
        runs.append((module, params["config"], env))
        gpu.groups.append((params["groups"], params["ragged_k"]))
        if gpu.verdict is None:
            return False, "RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS"
        from jax_efc.config import write_record

        write_record(self_check.folder(), env["JAX_EFC_SELF_CHECK_KEY"], {"passed": gpu.verdict[0],
                                                                           "detail": gpu.verdict[1]})
        return True, ""

    monkeypatch.setattr(device, "run_on_gpu", run_on_gpu)
    self_check._memo.clear()
    gpu.runs, gpu.verdict, gpu.groups = runs, (True, ""), []
    yield gpu
    self_check._memo.clear()


def test_a_kernel_that_passes_its_check_runs_and_the_verdict_is_kept(gpu):
    assert _plan().backend == "kernel"
    ((module, config, env),) = gpu.runs
    assert module == "jax_efc.checking" and env["JAX_EFC_UNVERIFIED_KERNELS"] == "1"
    assert isinstance(config, GemmConfig)  # the config the plan chose, pinned for the check
    assert read_record(self_check.folder(), env["JAX_EFC_SELF_CHECK_KEY"]) == {"passed": True, "detail": ""}
    self_check._memo.clear()  # a later process: the record on disk, no second check
    assert _plan().backend == "kernel" and len(gpu.runs) == 1


def test_a_grouped_kernel_is_checked_as_one(gpu, monkeypatch):
    """The checking job says whether the call is a grouped GEMM's (its group count) and whether
    its groups split the contraction (a weight gradient), so the checking process runs the right
    check on it; a dense call's job says 0."""
    from jax_efc.epilogue import identity_ir
    from jax_efc.kernels.sm90_policy import Sm90Policy
    from jax_efc.plan import plan_contraction_call, plan_grouped_call

    monkeypatch.setattr(Sm90Policy, "verified_grouped", False)
    monkeypatch.setattr(Sm90Policy, "verified_grouped_k", False)
    assert _plan().backend == "kernel"
    avals = [jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16),
             jax.ShapeDtypeStruct((4,), jnp.int32)]
    params = dict(ir=identity_ir(jnp.bfloat16, jnp.float32), transpose_b=False, acc_dtype=np.dtype(np.float32),
                  precision=None, config=None)
    assert plan_grouped_call(avals, params, devices=None).backend == "kernel"
    avals[1] = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    del params["transpose_b"]
    assert plan_contraction_call(avals, params, devices=None).backend == "kernel"
    assert gpu.groups == [(0, False), (4, False), (4, True)]


def test_a_kernel_that_fails_its_check_runs_the_reference_and_asks_for_a_report(gpu):
    gpu.verdict = (False, "output '1' is off by 2.38 where the reference's largest is 7.35")
    plan = _plan()
    assert plan.backend == "reference" and plan.level == logging.WARNING  # strict mode: an error
    assert plan.reason.startswith("failed its first-use check on this NVIDIA H200: the sm_90a kernel's "
                                  "epilogue reductions (output '1' is off by 2.38"), plan.reason
    assert "Please report it" in plan.reason


def test_a_checking_process_that_stops_fails_the_kernel_for_this_process_only(gpu):
    gpu.verdict = None
    plan = _plan()
    assert plan.backend == "reference" and "the check stopped: RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS" in plan.reason
    assert read_record(self_check.folder(), gpu.runs[0][2]["JAX_EFC_SELF_CHECK_KEY"]) is None  # nothing kept
    self_check._memo.clear()  # a later process checks again
    gpu.verdict = (True, "")
    assert _plan().backend == "kernel" and len(gpu.runs) == 2


def test_verified_kernels_and_the_switch_skip_the_check(gpu, monkeypatch):
    assert _plan(jax.nn.relu).backend == "kernel"
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    assert _plan().backend == "kernel"
    assert gpu.runs == []


def test_without_a_gpu_of_its_kind_nothing_is_checked_and_the_reference_runs(gpu, monkeypatch):
    monkeypatch.setattr(device, "gpu_arch", lambda: "sm_100a")
    plan = _plan()
    assert plan.backend == "reference" and "there is no sm_90a GPU here to check it on first use" in plan.reason
    assert gpu.runs == []


def test_jax_efc_info_names_the_verdicts(gpu, capsys):
    from jax_efc.cli import main

    gpu.verdict = (False, "output '0' is off by 3.1 where the reference's largest is 5")
    assert _plan().backend == "reference"
    assert [v["passed"] for v in self_check.verdicts()] == [False]
    main(["info"])
    out = capsys.readouterr().out
    assert "1 kernels checked, 1 failed" in out and "failed: output '0' is off by 3.1" in out
