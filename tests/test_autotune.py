"""Autotuning's parts that need no GPU: the argument, the candidates, the choice within the
noise, the records."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jax_efc as efc
from jax_efc import autotune
from jax_efc.config import GemmConfig


def test_config_takes_autotune_and_names_the_string_it_refuses():
    a = jnp.ones((16, 8))
    assert efc.gemm(a, a.T, config="autotune").shape == (16, 16)  # the reference here: no GPU
    with pytest.raises(ValueError, match="only config named by a string is 'autotune'"):
        efc.gemm(a, a.T, config="fast")


def test_a_candidate_replaces_the_heuristic_only_beyond_the_noise():
    h, c = GemmConfig(), GemmConfig(128, 256, 2, 1)
    assert autotune.choose([h, c], [1.0, 1.0 - autotune.NOISE / 2]) == h
    assert autotune.choose([h, c], [1.0, 0.9]) == c
    assert autotune.choose([h, c], [1.0, 1.2]) == h


def test_a_lead_must_hold_in_a_second_sitting():
    h, c, d = GemmConfig(), GemmConfig(128, 256, 2, 1), GemmConfig(256, 128, 1, 2)
    asked = []

    def retime(i, result):
        asked.append(i)
        return result

    assert autotune.choose([h, c, d], [1.0, 0.95, 0.9], lambda i: retime(i, (1.0, 0.9))) == d
    assert autotune.choose([h, c, d], [1.0, 0.95, 0.9], lambda i: retime(i, (1.0, 1.0 - autotune.NOISE / 2))) == h
    assert asked == [2, 2]
    assert autotune.choose([h, c, d], [1.0, 1.1, 1.2], lambda i: retime(i, (1.0, 0.5))) == h
    assert asked == [2, 2]  # nothing to confirm: no second sitting


@pytest.mark.parametrize("sm_count", [132, 114, 78, 144])  # H100/H200 SXM, H100 PCIe, smaller and larger parts
@pytest.mark.parametrize("m, n, k", [(8192, 8192, 8192), (1000, 4096, 4096), (16384, 14336, 4096)])
def test_candidates_start_with_the_heuristic_and_all_run(m, n, k, sm_count):
    """On a GPU of any SM count, what autotuning times starts with the heuristic's own config,
    and every candidate is one the kernel runs."""
    from jax_efc.kernels import policy
    from jax_efc.plan import plan_kernel
    from jax_efc.tracing import trace_epilogue

    ir, *_ = trace_epilogue(lambda acc: acc, (m, n), [], [], {}, {}, None, jnp.bfloat16)
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    plan = plan_kernel(ir, a, b, [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                       config=None, arch="sm_90a")
    pol = policy("sm_90a")
    configs = pol.candidate_configs(plan.problem, *plan.mnkl, sm_count=sm_count)
    assert configs[0] == pol.choose_config(plan.problem, *plan.mnkl, sm_count=sm_count)
    assert len(set(configs)) == len(configs) > 1
    assert all(pol.unsupported_reason(dataclasses.replace(plan.problem, config=c), plan.mnkl) is None for c in configs)


def test_records_round_trip_and_a_torn_one_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    c = GemmConfig(128, 256, 2, 1)
    autotune.store("k", (8192, 8192, 8192, 1), c, [GemmConfig(), c], [1.0, 0.8])
    assert autotune.load("k") == c
    assert autotune.records()["k"]["mnkl"] == [8192, 8192, 8192, 1]
    (tmp_path / "autotune" / "k.json").write_text("{not json")
    assert autotune.load("k") is None and "k" not in autotune.records()


def test_a_tuning_process_that_fails_leaves_the_heuristic_with_a_warning(tmp_path, monkeypatch, caplog):
    """Forced here by a GPU that is not there: the tuning process finds no device to time on."""
    from jax_efc import primitive
    from jax_efc.plan import plan_kernel

    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "gpu", lambda: ("NVIDIA H200", 132))
    a = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda a, b: efc.gemm(a, b, config="autotune"))(a, b)
    (eqn,) = primitive.fused_gemm_eqns(jaxpr)
    plan = plan_kernel(eqn.params["ir"], a, b, [], transpose_a=False, transpose_b=False,
                       acc_dtype=eqn.params["acc_dtype"], config=None, arch="sm_90a")
    with caplog.at_level("WARNING", logger="jax_efc"):
        assert autotune.tuned_config(plan, [a, b], eqn.params, devices=None) is None
    assert "autotuning failed; the heuristic's config runs" in caplog.text
    assert autotune.records() == {}


def test_a_kept_config_runs_and_backends_say_what_it_changed(tmp_path, monkeypatch):
    """A record on disk (as a tuning process leaves it) decides an export's config, and
    ``efc.backends`` names the fields it changed in the heuristic's."""
    pytest.importorskip("cutlass")
    from jax_efc import primitive
    from jax_efc.plan import plan_call

    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(autotune, "gpu", lambda: ("NVIDIA H200", 132))
    autotune._memo.clear()
    spec = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
    fn = lambda a, b: efc.gemm(a, b, config="autotune")  # noqa: E731
    (eqn,) = primitive.fused_gemm_eqns(jax.make_jaxpr(fn)(spec, spec))
    heuristic = plan_call([spec, spec], eqn.params, devices=())
    assert heuristic.note is None  # no record: the heuristic's config
    kept = dataclasses.replace(heuristic.config, tile_n=128 if heuristic.config.tile_n != 128 else 256)
    autotune.store(autotune.record_key(heuristic, autotune.gpu()), heuristic.mnkl, kept,
                   [heuristic.config, kept], [1.0, 0.9])
    autotune._memo.clear()
    plan = plan_call([spec, spec], eqn.params, devices=())
    assert plan.config == kept
    assert efc.backends(fn, spec, spec) == [f"kernel (sm_90a): autotuned to the heuristic's config but "
                                            f"tile_n={kept.tile_n}"]
    autotune._memo.clear()


def test_tune_needs_a_gpu_and_says_so(capsys):
    from jax_efc.cli import main

    with pytest.raises(SystemExit) as e:
        main(["tune", "--shapes", "256,256,256"])
    assert e.value.code == 2 and "tuning times kernels on a GPU" in capsys.readouterr().err
