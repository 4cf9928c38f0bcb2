"""The Blackwell (sm_100a) kernel, compiled on the CPU: no Blackwell GPU has run it.

Every variant is exported for CUDA in one child process with ``CUTE_DSL_ARCH=sm_100a`` (the
helpers of ``test_kernel_compile.py``, which this module shares), and its PTX is checked for the
tcgen05 MMA of its input type (and the 2-CTA form where its tiles take one), TMEM loads, TMA
loads and stores, multicast in clusters and the programmatic-dependent-launch wait; ptxas
assembles each for sm_100a with no spills; and, from the kernel's own index mappings, the
subtile walk stores every output element exactly once. Those run with the other compile
matrices (``-m matrix``); the policy's refusals, heuristic and dispatch run by default.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from test_kernel_compile import _config, _epilogue, assemble_all, compile_variants

# name -> (dtype, transpose_a, transpose_b, batch, (tile_m, tile_n, cluster_m, cluster_n[, GemmConfig
# fields and "acc"]), epilogue[, (M, N, K)]); without a shape M = 128 * (i + 2) + 8,
# N = 512, K = 256 (partial tiles along M), as in test_kernel_compile.py
SM100_VARIANTS = {
    # 1-CTA tiles, both majors, clusters that multicast A, B or both
    "bf16_kn_128x128": ("bfloat16", False, False, None, (128, 128, 1, 1), "identity"),
    "fp16_mk_128x256": ("float16", True, True, None, (128, 256, 1, 1), "identity"),
    "bf16_64x128_bias_gelu": ("bfloat16", False, False, None, (64, 128, 1, 1), "bias_gelu"),
    "bf16_128x256_c2x2_bias_gelu": ("bfloat16", False, True, None, (128, 256, 2, 2, {"swizzle": 8}), "bias_gelu"),
    "bf16_128x128_c4x1_alpha_beta": ("bfloat16", False, False, None, (128, 128, 4, 1), "alpha_beta"),
    "fp16_64x128_c1x2_alpha_beta_epi64": ("float16", True, False, None, (64, 128, 1, 2, {"epi_n": 64}),
                                          "alpha_beta"),
    # every operand role (TILE, ROW, COL, SCALAR) and three output dtypes, batched
    "bf16_multi_batched_128x128_c2x1": ("bfloat16", True, True, 3, (128, 128, 2, 1), "multi"),
    "bf16_f32tile_batched_128x192": ("bfloat16", False, False, 2, (128, 192, 1, 1), "f32_tile"),
    # 2-CTA tiles: a CTA pair along M shares each MMA
    "bf16_2cta_256x256_c2x1": ("bfloat16", False, False, None, (256, 256, 2, 1, {"use_2cta": True}), "identity"),
    "bf16_2cta_256x128_c2x1_bias_gelu": ("bfloat16", False, False, None,
                                         (256, 128, 2, 1, {"use_2cta": True}), "bias_gelu"),
    "fp16_2cta_256x256_c2x2_alpha_beta_mk": ("float16", True, False, None,
                                             (256, 256, 2, 2, {"use_2cta": True, "swizzle": 8}), "alpha_beta"),
    "bf16_2cta_256x128_c4x1_bias_silu_epi16": ("bfloat16", False, True, None,
                                               (256, 128, 4, 1, {"use_2cta": True, "epi_n": 16}), "bias_silu"),
    "bf16_2cta_256x256_c2x1_partial": ("bfloat16", False, False, None, (256, 256, 2, 1, {"use_2cta": True}),
                                       "bias_gelu", (1000, 1000, 520)),
    # 2-CTA 128-row tiles: each CTA's 64 rows lie in TMEM as two column blocks, which every
    # epilogue subtile spans (partial tiles along M and N)
    "bf16_2cta_128x128_c2x1_bias_gelu_partial": ("bfloat16", False, False, None,
                                                 (128, 128, 2, 1, {"use_2cta": True}), "bias_gelu",
                                                 (1064, 1000, 520)),
    "fp8e4m3_nk_2cta_128x256_c2x2": ("float8_e4m3fn", False, True, None,
                                     (128, 256, 2, 2, {"use_2cta": True}), "identity", (1160, 1008, 512)),
    "bf16_2cta_128x256_c2x1_alpha_beta_partial": ("bfloat16", True, False, None,
                                                  (128, 256, 2, 1, {"use_2cta": True}), "alpha_beta",
                                                  (904, 1000, 256)),
    "bf16_2cta_128x128_c4x1_bias_gelu_colsum": ("bfloat16", False, True, None,
                                                 (128, 128, 4, 1, {"use_2cta": True}), "bias_gelu_colsum",
                                                 (1000, 3000, 1024)),
    "bf16_2cta_128x192_c2x1_row_stats_epi16": ("bfloat16", False, False, None,
                                               (128, 192, 2, 1, {"use_2cta": True, "epi_n": 16}), "row_stats",
                                               (1000, 1000, 512)),
    # fp16 accumulation
    "fp16_acc16_128x256_bias_gelu": ("float16", False, False, None, (128, 256, 1, 1, {"acc": "float16"}),
                                     "bias_gelu"),
    "fp16_acc16_2cta_256x128_c2x1": ("float16", False, True, None,
                                     (256, 128, 2, 1, {"use_2cta": True, "acc": "float16"}), "alpha_beta"),
    # 8-bit floats, either major (tcgen05 reads 8-bit inputs MN-major too), and the two mixed
    "fp8e4m3_nk_128x128_bias_gelu": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "bias_gelu"),
    "fp8e5m2_kn_2cta_256x256_c2x1": ("float8_e5m2", False, False, None, (256, 256, 2, 1, {"use_2cta": True}),
                                     "identity"),
    "fp8mixed_mk_128x256_alpha_beta": ("float8_e4m3fn+float8_e5m2", True, True, None, (128, 256, 1, 1),
                                       "alpha_beta", (2048, 1024, 512)),
    # 8-bit integers, int32 accumulation: the bare accumulator stored exactly, and a float epilogue
    "int8_nk_128x128": ("int8", False, True, None, (128, 128, 1, 1, {"acc": "int32"}), "identity"),
    # int8 x uint8: the UMMA's descriptor takes each operand's signedness (kernels/sm100_int8.py)
    "int8xuint8_nk_128x256_c2x1_multi": ("int8+uint8", False, True, None, (128, 256, 2, 1, {"acc": "int32"}),
                                         "int_multi"),
    "uint8_kn_2cta_256x128_c2x1_multi": ("uint8", False, False, None,
                                         (256, 128, 2, 1, {"use_2cta": True, "acc": "int32"}), "int_multi"),
    # TF32 (float32 inputs, where the precision asks for it)
    "tf32_kn_128x128": ("float32", False, False, None, (128, 128, 1, 1), "identity"),  # float32 runs as TF32
    "tf32_mk_2cta_256x128_c2x1_bias_gelu": ("float32", True, True, None,
                                            (256, 128, 2, 1, {"use_2cta": True}), "bias_gelu"),
    # reductions (run only under JAX_EFC_UNVERIFIED_KERNELS=1, as every sm_100a kernel)
    "bf16_128x128_c1x2_bias_gelu_colsum": ("bfloat16", False, False, None, (128, 128, 1, 2), "bias_gelu_colsum",
                                           (1000, 3000, 1024)),
    "bf16_2cta_256x256_c2x1_row_stats": ("bfloat16", False, True, None, (256, 256, 2, 1, {"use_2cta": True}),
                                         "row_stats", (2296, 2824, 1288)),
    "bf16_2cta_256x128_all_reductions_batched": ("bfloat16", False, False, 2,
                                                 (256, 128, 2, 1, {"use_2cta": True}), "all_reductions"),
    "fp8e4m3_64x128_scaled_amax": ("float8_e4m3fn", False, True, None, (64, 128, 1, 1), "scaled_amax"),
    # a row softmax, norm and sum finished in tiles that span the rows (two walks before the stores)
    "bf16_128x128_softmax_norm_stream_k": ("bfloat16", False, True, None, (128, 128, 1, 1), "softmax_norm",
                                           (2296, 128, 4104)),
    "bf16_2cta_256x128_c2x1_softmax_norm": ("bfloat16", False, False, None, (256, 128, 2, 1, {"use_2cta": True}),
                                            "softmax_norm", (1000, 120, 1024)),
}

# the tcgen05 MMA kind of each input type
_KIND = {"bfloat16": "f16", "float16": "f16", "float8_e4m3fn": "f8f6f4", "float8_e5m2": "f8f6f4",
         "int8": "i8", "uint8": "i8", "float32": "tf32"}


def _extras(variant) -> dict:
    cfg = variant[4]
    return cfg[4] if len(cfg) > 4 else {}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_sm100.SM100_VARIANTS", arch="sm_100a",
                            unverified=True)


@pytest.fixture(scope="module")
def assembled(compiled, tmp_path_factory):
    return assemble_all(compiled, tmp_path_factory.mktemp("sass"), arch="sm_100a")


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(SM100_VARIANTS))
def test_variant_compiles_to_tcgen05(compiled, name):
    """The export holds the custom call; the PTX the tcgen05 MMA of the variant's input type (the
    2-CTA form where its tiles take one), TMEM loads (and their waits), TMA loads into the A/B
    ring (2-CTA ones signalling the pair's leader) and TMA stores of the epilogue, multicast where
    the cluster shares A or B, and the programmatic-dependent-launch wait before the first global
    access."""
    variant = SM100_VARIANTS[name]
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["custom_call"]
    ptx = result["ptx"]
    two_cta = _extras(variant).get("use_2cta", False)
    group = 2 if two_cta else 1
    kind = _KIND[variant[0].split("+")[0]]
    mmas = set(re.findall(r"tcgen05\.mma\.cta_group::(\d)\.kind::(\w+)", ptx))
    assert mmas == {(str(group), kind)}, mmas
    assert "wgmma" not in ptx
    assert f"tcgen05.alloc.cta_group::{group}" in ptx and f"tcgen05.dealloc.cta_group::{group}" in ptx
    assert re.search(r"tcgen05\.ld\.sync\.aligned\.\d+x\d+b", ptx) and "tcgen05.wait::ld" in ptx
    assert f"tcgen05.commit.cta_group::{group}" in ptx
    # TMA loads (A and B, TILE operands): a pair's A and B loads signal the leader's barrier
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.\S+", ptx)
    assert loads and any("cta_group::2" in op for op in loads) == two_cta, set(loads)
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.\S*bulk_group", ptx)  # stores
    cfg = variant[4]
    if cfg[2] * cfg[3] > group:
        assert "multicast::cluster" in ptx
    wait = ptx.find("griddepcontrol.wait;")
    assert 0 <= wait < ptx.find("cp.async.bulk.tensor") and "griddepcontrol.launch_dependents;" in ptx
    assert all(wait < i for i in (ptx.find(op) for op in ("ld.global", "st.global", "prefetch.global")) if i >= 0)
    if variant[5] in ("alpha_beta", "f32_tile", "multi"):
        # TILE operands come in by TMA and are read back from shared memory
        assert re.search(r"\bld(?:matrix)?\.shared|ldmatrix", ptx)


@pytest.mark.matrix
def test_variants_assemble_without_spills(compiled, assembled):
    """ptxas assembles every variant for sm_100a with no local-memory spills, within the 255
    registers a thread may use; with ``JAX_EFC_SM100_REGISTERS`` set, each variant's registers
    are written to the JSON file it names."""
    table = {}
    for name, report in assembled.items():
        (stores, loads), = [tuple(map(int, m)) for m in
                            re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
        registers = max(int(r) for r in re.findall(r"Used (\d+) registers", report))
        table[name] = {"registers": registers, "spill_stores": stores, "spill_loads": loads}
        assert stores == 0 and loads == 0, (name, stores, loads)
        # 192 threads a CTA (six warps) leave each up to 255 registers
        assert registers <= 255, (name, registers)
    assert set(table) == set(SM100_VARIANTS)
    out = os.environ.get("JAX_EFC_SM100_REGISTERS")
    if out:
        with open(out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)


# the same kernel built for the B300 (sm_103a) and for the 10.x family (sm_100f, one build for
# both): a 2-CTA bf16 tile and a 1-CTA fp8 one each
OTHER_TARGET_VARIANTS = {
    "bf16_2cta_256x256_c2x1_bias_gelu": ("bfloat16", False, False, None, (256, 256, 2, 1, {"use_2cta": True}),
                                         "bias_gelu"),
    "fp8e4m3_nk_128x128_alpha_beta": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "alpha_beta"),
}


@pytest.mark.matrix
@pytest.mark.parametrize("arch", ["sm_103a", "sm_100f"])
def test_the_kernel_builds_for_the_b300_and_the_family_target(arch, tmp_path_factory):
    """The registry's other Blackwell targets plan the same kernel (the plan names them), its PTX
    targets them with the same tcgen05 MMAs, and ptxas assembles it for them without spills."""
    built = compile_variants(tmp_path_factory, "test_kernel_compile_sm100.OTHER_TARGET_VARIANTS", arch=arch,
                             unverified=True)
    for name, result in built.items():
        assert "error" not in result, result.get("error")
        assert result["custom_call"] and f".target {arch}" in result["ptx"], name
        kind = _KIND[OTHER_TARGET_VARIANTS[name][0]]
        assert re.search(rf"tcgen05\.mma\.cta_group::\d\.kind::{kind}", result["ptx"]), name
    for name, report in assemble_all(built, tmp_path_factory.mktemp(f"sass_{arch}"), arch=arch).items():
        assert "0 bytes spill stores, 0 bytes spill loads" in report, (name, report)


@pytest.mark.matrix
def test_accumulator_types(compiled):
    """fp16 accumulators come out of TMEM two to a 32-bit lane column (``.pack::16b``) and are
    widened to fp32 for the epilogue; 8-bit integers accumulate in int32, whose int8 output is
    clamped to [-128, 127] (then packed four to a register for the smem store)."""
    for name in ("fp16_acc16_128x256_bias_gelu", "fp16_acc16_2cta_256x128_c2x1"):
        ptx = compiled[name]["ptx"]
        assert re.search(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x\d+\.pack::16b", ptx), name
        assert "cvt.f32.f16" in ptx, name
    ptx = compiled["uint8_kn_2cta_256x128_c2x1_multi"]["ptx"]
    assert "max.s32" in ptx and "min.s32" in ptx and "prmt.b32" in ptx


@pytest.mark.matrix
def test_output_shapes(compiled):
    assert compiled["bf16_2cta_256x256_c2x1_partial"]["out_shapes"] == [[1000, 1000]]
    assert compiled["bf16_2cta_256x256_c2x1_row_stats"]["out_shapes"] == [[2296, 2824], [2296, 1], [2296, 1]]
    m = compiled["bf16_2cta_256x128_all_reductions_batched"]["out_shapes"][0][1]
    assert compiled["bf16_2cta_256x128_all_reductions_batched"]["out_shapes"] == [
        [2, m, 512], [2, 1, 512], [2, m, 1], [2, 1, 1]]


# ---------------------------------------------------------------- the policy
def _plan(change: dict, monkeypatch):
    """The sm_100a plan of a 1024 x 1024 x 512 GEMM (bf16 identity, 1-CTA 128x128) with ``change``."""
    import jax
    import jax.numpy as jnp

    import jax_efc.plan as P

    if change.get("unverified", True):
        monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    else:
        monkeypatch.delenv("JAX_EFC_UNVERIFIED_KERNELS", raising=False)
    if "switch" in change:
        monkeypatch.setenv("JAX_EFC_SM100", change["switch"])
    m, n, k = change.get("mnk", (1024, 1024, 512))
    a_dtype, b_dtype = (jnp.dtype(d) for d in (change.get("dtype", "bfloat16").split("+") * 2)[:2])
    ir, ops = _epilogue(change.get("epilogue", "identity"), m, n, None, a_dtype)
    precision = jax.lax.Precision[change["precision"]] if "precision" in change else None
    cfg = change.get("config", (128, 128, 1, 1))
    return P.plan_kernel(ir, jax.ShapeDtypeStruct((m, k), a_dtype), jax.ShapeDtypeStruct((k, n), b_dtype), ops,
                         transpose_a=False, transpose_b=False, acc_dtype=change.get("acc", "float32"),
                         config=None if cfg is None else _config(cfg), arch=change.get("arch", "sm_100a"),
                         precision=precision)


@pytest.mark.parametrize("change, needle", [
    (dict(config=(256, 128, 2, 1)), "tile_m=256 is not supported on SM100; a 1-CTA tcgen05 MMA covers 64 or 128 "
                                    "rows (or use_2cta=True"),
    (dict(dtype="float8_e4m3fn", config=(128, 128, 2, 1, {"use_2cta": True, "epi_n": 16})),
     "epi_n=16 with a 2-CTA 128-row tile: each subtile is two column blocks of 8 float8_e4m3fn values, fewer "
     "than the 16 bytes a TMA copy's row takes; use epi_n=32 or more"),
    (dict(config=(64, 128, 2, 1, {"use_2cta": True})), "tile_m=64 with use_2cta=True is not supported"),
    (dict(config=(128, 288, 1, 1)), "tile_n=288 is not supported on SM100; use a multiple of 32 from 32 to 256"),
    (dict(config=(128, 128, 8, 4)), "cluster 8x4 has more than 16 CTAs"),
    (dict(config=(128, 128, 1, 32)), "cluster_n=32 must be a power of two up to 16"),
    (dict(config=(128, 128, 1, 2, {"pingpong": True})), "pingpong=True is Hopper's schedule"),
    (dict(config=(128, 128, 1, 1, {"epi_m": 64})), "each epilogue subtile spans the CTA tile's 128 rows"),
    (dict(dtype="float32", precision="HIGHEST"), "float32 inputs at precision=HIGHEST"),
    (dict(dtype="bfloat16", acc="float16"), "float16 accumulation takes float16 inputs, not bfloat16"),
    (dict(dtype="int8"), "int8 inputs accumulate in int32"),
    (dict(switch="0"), "JAX_EFC_SM100=0 turns the sm_100a kernel off"),
    (dict(epilogue="alpha_beta", config=(128, 256, 1, 1, {"epi_n": 64, "stages": 2}), dtype="float32"),
     "leaves too little shared memory for 2 A/B pipeline stages"),
    (dict(arch="sm_90a", config=(128, 128, 2, 1, {"use_2cta": True})), "use_2cta=True asks for Blackwell's 2-CTA"),
])
def test_refusals_name_the_value(change, needle, monkeypatch):
    pytest.importorskip("cutlass.jax")
    plan = _plan(change, monkeypatch)
    assert plan.backend == "reference" and needle in plan.reason, plan.reason


def test_every_sm100_kernel_is_unverified_and_checks_itself_first(monkeypatch):
    """No Blackwell GPU has run the kernel: its policy says so for every input type, and a call
    planned without such a GPU (an export) runs the reference, saying there is none to check
    it on; JAX_EFC_UNVERIFIED_KERNELS=1 runs it unchecked."""
    pytest.importorskip("cutlass.jax")
    import jax
    import jax.numpy as jnp

    import jax_efc as efc
    from jax_efc.kernels import policy

    plan = _plan(dict(unverified=False), monkeypatch)
    assert plan.backend == "kernel"
    assert policy("sm_100a").unverified_reason(plan.problem) == "the sm_100a kernel with bfloat16 inputs"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    (why,) = efc.backends(lambda a, b: efc.gemm(a, b), spec, spec)
    assert why.startswith("reference: not yet run on a GPU of its kind: the sm_100a kernel with bfloat16 inputs; "
                          "there is no sm_100a GPU here to check it on first use"), why
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    assert efc.backends(lambda a, b: efc.gemm(a, b), spec, spec) == ["kernel (sm_100a)"]


def test_2cta_needs_an_even_cluster_m():
    from jax_efc.config import GemmConfig

    with pytest.raises(ValueError, match="use_2cta=True pairs the CTAs of a cluster along M; cluster_m=1"):
        GemmConfig(256, 256, use_2cta=True)
    with pytest.raises(ValueError, match="use_2cta=1 must be True or False"):
        GemmConfig(256, 256, 2, 1, use_2cta=1)


def test_accepted_kernels(monkeypatch):
    """What the policy runs: TF32 where the precision asks for it, 8-bit floats in either major
    (no transpose before the kernel), 2-CTA tiles in clusters, every dtype once opted in."""
    pytest.importorskip("cutlass.jax")
    assert _plan(dict(dtype="float32"), monkeypatch).backend == "kernel"
    plan = _plan(dict(dtype="float8_e4m3fn+float8_e5m2"), monkeypatch)
    assert plan.backend == "kernel" and plan.transposes == (False, False) and plan.problem.b_major == "n"
    plan = _plan(dict(config=(256, 256, 4, 2, {"use_2cta": True})), monkeypatch)
    assert plan.backend == "kernel" and plan.schedule.stream_k is None
    for dtype, epi_n in (("bfloat16", 16), ("float8_e4m3fn", 32)):
        plan = _plan(dict(dtype=dtype, config=(128, 256, 2, 2, {"use_2cta": True, "epi_n": epi_n})), monkeypatch)
        assert plan.backend == "kernel", plan.reason
    assert _plan(dict(dtype="float16", acc="float16"), monkeypatch).backend == "kernel"


def test_heuristic(monkeypatch):
    """2-CTA 256x256 tiles in 2x1 clusters once they fill the SM pairs, else 2-CTA 256x128 with
    more than 128 rows, else 1-CTA 128x256 where they fill the SMs, 2-CTA 128x256, or 1-CTA
    tiles for at most 64 rows or 128 columns; every choice keeps 4 or more A/B stages and 512 or
    fewer TMEM columns, and the autotuner's candidates start with it."""
    import dataclasses

    import jax.numpy as jnp

    from jax_efc.kernels.problem import KernelProblem
    from jax_efc.kernels.sm100_policy import POLICY, pipeline_stages, tmem_columns

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")

    def chosen(epilogue, m, n, k, dtype="bfloat16"):
        ir, ops = _epilogue(epilogue, m, n, None, jnp.dtype(dtype))
        problem = KernelProblem(ir, dtype, "float32", "k", "n", False, False, False, (False,) * len(ops), "sm_100a",
                                _config((128, 128, 1, 1)))
        cfg = POLICY.choose_config(problem, m, n, k, 1, 148)
        placed = dataclasses.replace(problem, config=cfg)
        assert POLICY.unsupported_reason(placed, (m, n, k, 1)) is None
        assert pipeline_stages(placed) >= 4 and tmem_columns(placed) <= 512
        candidates = POLICY.candidate_configs(problem, m, n, k, 1, 148)
        assert candidates[0] == cfg and len(set(candidates)) == len(candidates) > 1
        return cfg

    big = chosen("identity", 8192, 8192, 8192)
    assert (big.tile_m, big.tile_n, big.cluster_m, big.use_2cta, big.swizzle) == (256, 256, 2, True, 8)
    assert pipeline_stages(KernelProblem(*_problem_fields("identity", big))) == 6
    narrow = chosen("bias_gelu", 8192, 512, 4096)  # 64 tiles of 256x256, 128 of 256x128 for 74 pairs
    assert (narrow.tile_m, narrow.tile_n, narrow.use_2cta) == (256, 128, True)
    # 4096^3: 256x256 tiles fill 86% of 4 rounds of the pairs, 256x128 ones 99% of 7
    square = chosen("identity", 4096, 4096, 4096)
    assert (square.tile_m, square.tile_n, square.use_2cta, square.swizzle) == (256, 128, True, 8)
    # 2-CTA alpha-beta: four epilogue buffers still leave 4 stages (in 16-wide subtiles if need be)
    ab = chosen("alpha_beta", 8192, 8192, 4096)
    assert ab.use_2cta and ab.tile_m == 256
    # fewer tiles than a round of 2-CTA 256x256 pairs: 256x128 (128x128 CTA tiles)
    mid = chosen("identity", 512, 4096, 4096)
    assert (mid.tile_m, mid.tile_n, mid.use_2cta, mid.swizzle) == (256, 128, True, 1)
    # at most 128 rows: 1-CTA 128x256 where they fill the SMs, else 2-CTA 128x256 (64x256 CTA tiles)
    wide = chosen("identity", 128, 65536, 4096)
    assert (wide.tile_m, wide.tile_n, wide.use_2cta) == (128, 256, False)
    few = chosen("bias_gelu", 128, 4096, 4096)
    assert (few.tile_m, few.tile_n, few.cluster_m, few.use_2cta) == (128, 256, 2, True)
    assert chosen("bias_gelu", 64, 4096, 4096).tile_m == 64
    assert chosen("identity", 96, 128, 4096).use_2cta is False


def _problem_fields(epilogue, cfg):
    import jax.numpy as jnp

    ir, ops = _epilogue(epilogue, 8192, 8192, None, jnp.bfloat16)
    return ir, "bfloat16", "float32", "k", "n", False, False, False, (False,) * len(ops), "sm_100a", cfg


_BACKENDS = """
import os, sys
import jax, jax.numpy as jnp
import jax_efc as efc
if sys.argv[1] == "set":
    efc.set_target_arch("sm_100a")
from cutlass.jax import get_export_disabled_safety_checks
specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(4096, 2048), (2048, 4096), (4096,)]]
layer = lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu")
print(efc.backends(layer, *specs))
exported = jax.export.export(jax.jit(layer), platforms=["cuda"],
                             disabled_checks=get_export_disabled_safety_checks())(*specs)
print(exported.mlir_module().count("NvJaxCutlassCall"))
"""


def test_backends_and_export_for_sm100():
    """``efc.backends`` reports the sm_100a kernel under CUTE_DSL_ARCH=sm_100a (or after
    ``set_target_arch("sm_100a")``) with the opt-in set, and the reason without it; a
    ``jax.export`` for CUDA then holds the kernel's custom call."""
    pytest.importorskip("cutlass.jax")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(mode, **env):
        env = dict({k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}, JAX_PLATFORMS="cpu", **env,
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-c", _BACKENDS, mode], env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout.strip().splitlines()

    assert run("env", CUTE_DSL_ARCH="sm_100a", JAX_EFC_UNVERIFIED_KERNELS="1") == ["['kernel (sm_100a)']", "1"]
    assert run("set", JAX_EFC_UNVERIFIED_KERNELS="1") == ["['kernel (sm_100a)']", "1"]
    held, count = run("env", CUTE_DSL_ARCH="sm_100a", JAX_EFC_UNVERIFIED_KERNELS="0")
    assert "not yet run on a GPU of its kind" in held and "no sm_100a GPU here" in held and count == "0"

# ---------------------------------------------------------------- the subtile walk's coverage
# (tile_m, tile_n, cluster_m, cluster_n, GemmConfig fields, output dtype, accumulator, (M, N, L))
_WALKS = {
    "128x128": (128, 128, 1, 1, {}, "bfloat16", "float32", (1000, 1000, 1)),
    "64x128_16_lanes": (64, 128, 1, 2, {}, "bfloat16", "float32", (1000, 1000, 2)),
    "64x128_fp8_out": (64, 128, 1, 1, {"epi_n": 64}, "float8_e4m3fn", "float32", (200, 384, 1)),
    "128x256_epi64_c2x2": (128, 256, 2, 2, {"epi_n": 64}, "float32", "float32", (1000, 1100, 1)),
    "fp16_acc_128x128": (128, 128, 1, 1, {}, "float16", "float16", (520, 264, 3)),
    "2cta_256x256_c2x1": (256, 256, 2, 1, {"use_2cta": True}, "bfloat16", "float32", (1000, 1000, 1)),
    "2cta_256x128_c4x1_epi16": (256, 128, 4, 1, {"use_2cta": True, "epi_n": 16}, "bfloat16", "float32",
                                (1288, 520, 2)),
    "2cta_256x128_c2x2": (256, 128, 2, 2, {"use_2cta": True}, "bfloat16", "float32", (600, 700, 1)),
    # 2-CTA 128-row tiles: every subtile spans the two column blocks of a CTA's 64 rows in TMEM
    "2cta_128x128_c2x1": (128, 128, 2, 1, {"use_2cta": True}, "bfloat16", "float32", (1000, 1000, 1)),
    "2cta_128x256_c4x2_f32_out": (128, 256, 4, 2, {"use_2cta": True}, "float32", "float32", (1160, 1100, 2)),
    "2cta_128x192_epi16": (128, 192, 2, 1, {"use_2cta": True, "epi_n": 16}, "bfloat16", "float32",
                           (520, 1000, 1)),
    "2cta_128x128_fp8_out_epi64": (128, 128, 2, 2, {"use_2cta": True, "epi_n": 64}, "float8_e4m3fn", "float32",
                                   (328, 384, 1)),
    "fp16_acc_2cta_128x256": (128, 256, 2, 1, {"use_2cta": True}, "float16", "float16", (264, 520, 3)),
}

def _walk_maps(walks: dict) -> dict:
    """Child process: per walk, per epilogue thread, the kernel's own index mappings
    (``Sm100FusedGemm._tmem_load`` and ``_fragment_coords``, and the r2s copy
    ``_consumer_epilogue`` builds): for every subtile, the tile (m, n) of each fragment value,
    and the subtile (m, n) of the smem element it is stored to."""
    import cutlass
    import cutlass.cute as cute
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir
    from jax_efc.kernels.problem import KernelProblem, tile_k
    from jax_efc.kernels.schedule import plan_schedule
    from jax_efc.kernels.sm100 import Sm100FusedGemm
    from jax_efc.kernels.sm100_policy import ACC_STAGES, EPI_THREADS

    maps = {}
    for name, (tm, tn, cm, cn, extra, out, acc_dtype, mnl) in walks.items():
        cfg = GemmConfig(tm, tn, cm, cn, **extra)
        ab = "bfloat16" if acc_dtype == "float32" else "float16"
        problem = KernelProblem(identity_ir(jnp.dtype(out)), ab, acc_dtype, "k", "n", False, False, False, (),
                                "sm_100a", cfg)
        kernel = Sm100FusedGemm(problem, plan_schedule(cfg, mnl[0], mnl[1], 512, mnl[2], 148 // (cm * cn),
                                                       tile_k(ab)))
        threads = []

        @cute.jit
        def collect():
            tiled_mma = kernel._tiled_mma()
            acc = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C(kernel.mma_tiler[:2]),
                                                        ACC_STAGES))
            for ctid in cutlass.range_constexpr(EPI_THREADS):  # static: every coordinate is a number
                t2r, _, regs = kernel._tmem_load(acc, ctid)
                r2s = cute.make_tiled_copy_D(kernel._r2s_atom(kernel.out_dtypes[0], t2r), t2r)
                tCcT, acc_index = kernel._fragment_coords(t2r, r2s, regs, ctid)
                # where the copy takes each fragment value (the source side: a warp's stmatrix
                # writes its lanes' values to addresses that other lanes supply)
                smem = r2s.get_slice(ctid).partition_S(cute.make_identity_tensor(kernel.epi_tile))
                threads.append({"tile": [[[int(x) for x in tCcT[i]] for i in sub] for sub in acc_index],
                                "smem": [[int(x) for x in smem[v]] for v in range(cute.size(smem))]})

        cute.compile(collect)
        maps[name] = {"cta_tile": list(kernel.tile_mnk[:2]), "epi_tile": list(kernel.epi_tile),
                      "epi_blocks": kernel.epi_blocks, "clusters": kernel.schedule.clusters, "threads": threads}
    return maps


@pytest.fixture(scope="module")
def walk_maps():
    pytest.importorskip("cutlass.jax")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, json.dumps(_WALKS)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(_WALKS))
def test_every_output_element_is_stored_once(walk_maps, name):
    """From the kernel's index mappings: within a subtile, each fragment value goes to the smem
    element of its own (m, n) (a 2-CTA 128-row tile's subtile spans two column blocks, which the
    reductions' column map follows too), and the 128 epilogue threads' values cover the subtile
    once; the subtiles cover the CTA tile once; the persistent walk hands every CTA tile of the output
    (2-CTA pairs and clusters included) to exactly one CTA, whose TMA stores, clipped at the M
    and N edges, write each output element exactly once. With a 2-CTA MMA, the A rows each CTA
    of the pair loads are the rows its epilogue stores."""
    import numpy as np

    from jax_efc.config import GemmConfig
    from jax_efc.kernels.reduction import TileReduction
    from jax_efc.kernels.schedule import TileWalk, cluster_tiles, plan_schedule

    tm, tn, cm, cn, extra, _, _, (m, n, l) = _WALKS[name]
    info = walk_maps[name]
    (cta_m, cta_n), (epi_m, epi_n) = info["cta_tile"], info["epi_tile"]
    sub_m = cta_m // epi_m
    n_sub = sub_m * (cta_n // epi_n)
    # a 2-CTA 128-row tile's subtiles span two column blocks: runs of epi_n / 2 columns, one in
    # each half of the CTA tile; the subtiles along N step a run's width
    blocks = info["epi_blocks"]
    assert blocks == (2 if extra.get("use_2cta") and tm == 128 else 1), (name, blocks)
    run = epi_n // blocks
    # the reductions' column map, which stages and masks a subtile's values, is the same
    reduction = TileReduction("sum", ("m",), (epi_m, epi_n), (cta_m, cta_n), 128, blocks)
    in_tile = np.zeros((cta_m, cta_n), np.int32)
    for thread in info["threads"]:
        assert len(thread["tile"]) == n_sub
        for s, values in enumerate(thread["tile"]):
            assert len(values) == len(thread["smem"])
            n0 = s // sub_m * run
            for (r, c), (sr, sc) in zip(values, thread["smem"]):
                at = (s % sub_m * epi_m + sr, n0 + sc % run + sc // run * (cta_n // blocks))
                assert (r, c) == at, (name, s, (r, c), (sr, sc))
                assert (n0 + reduction.spread(sc), reduction.gather(c - n0)) == (c, sc), (name, s, c, sc)
                in_tile[r, c] += 1
    assert (in_tile == 1).all(), name
    for s in range(n_sub):  # one subtile's smem elements, once each
        seen = np.zeros((epi_m, epi_n), np.int32)
        for thread in info["threads"]:
            for sr, sc in thread["smem"]:
                seen[sr, sc] += 1
        assert (seen == 1).all(), name

    cfg = GemmConfig(tm, tn, cm, cn, **extra)
    schedule = plan_schedule(cfg, m, n, 512, l, info["clusters"], 64)
    tiles_mnl = cluster_tiles(m, n, l, (cta_m, cta_n), (cm, cn))
    clusters = min(tiles_mnl[0] * tiles_mnl[1] * tiles_mnl[2], schedule.clusters)  # as the launch
    pair = 2 if cfg.use_2cta else 1
    written = np.zeros((l, m, n), np.int32)
    outside = 0  # CTA tiles wholly past the M or N edge: they store nothing, and write no reduction partial
    for cluster in range(clusters):
        for bx in range(cm):
            for by in range(cn):
                walk = TileWalk(schedule, tiles_mnl, cluster, (bx, by), clusters, 8)
                for j in range(walk.count()):
                    u = walk.unit(j)
                    if cfg.use_2cta:  # the pair's MMA tile, and this CTA's half of its rows
                        assert (u.m // pair) * tm + bx % pair * cta_m == u.m * cta_m
                    if u.m * cta_m >= m or u.n * cta_n >= n:
                        outside += 1
                        continue
                    rows = slice(u.m * cta_m, min(m, (u.m + 1) * cta_m))
                    cols = slice(u.n * cta_n, min(n, (u.n + 1) * cta_n))
                    written[u.l, rows, cols] += in_tile[: rows.stop - rows.start, : cols.stop - cols.start]
    assert (written == 1).all(), (name, np.unique(written, return_counts=True))
    # (e.g. M = 1288 in 2-CTA pairs of 128-row CTA tiles: 11 tiles along M, the sixth pair's second
    # is empty; reduction.TileReduction.flush writes no partial for it, as the partial arrays
    # have one per tile inside the output)
    assert (outside > 0) == (name in ("128x256_epi64_c2x2", "2cta_256x128_c4x1_epi16", "2cta_256x128_c2x2",
                                      "2cta_128x256_c4x2_f32_out", "2cta_128x192_epi16",
                                      "2cta_128x128_fp8_out_epi64", "fp16_acc_2cta_128x256")), (name, outside)


@pytest.mark.matrix
@pytest.mark.parametrize("over", [("m",), ("n",), ("m", "n")])
@pytest.mark.parametrize("name", list(_WALKS))
def test_reductions_meet_on_the_tensor_memory_layout(walk_maps, name, over, rng):
    """The epilogue reductions on Blackwell's own thread/value layout (each of the 128 epilogue
    threads a row of the tile, a 2-CTA 128-row tile's subtiles split in two column blocks): the
    lane map the kernel reads off it folds, shuffles and writes every row's or column's total
    once (``test_reductions.reduce_as_the_kernel``)."""
    from test_reductions import check_tile_reduction

    from jax_efc.kernels.reduction import TileReduction

    info = walk_maps[name]
    tile = tuple(info["cta_tile"])
    red = TileReduction("max", over, tuple(info["epi_tile"]), tile, 128, info["epi_blocks"])
    check_tile_reduction(red, lambda t: [[tuple(p) for p in sub] for sub in info["threads"][t]["tile"]], tile, rng)


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(_WALKS))
def test_row_totals_reach_every_thread_on_the_tensor_memory_layout(walk_maps, name, rng):
    """A reduction the epilogue consumes over N (a row softmax's), on Blackwell's layout: every
    thread reads back the totals of the rows it holds (``test_row_stats.check_row_totals``)."""
    from test_row_stats import check_row_totals

    from jax_efc.kernels.reduction import TileReduction

    info = walk_maps[name]
    tile = tuple(info["cta_tile"])
    red = TileReduction("sum", ("n",), tuple(info["epi_tile"]), tile, 128, info["epi_blocks"])
    check_row_totals(red, lambda t: [[tuple(p) for p in sub] for sub in info["threads"][t]["tile"]], rng)


if __name__ == "__main__":
    print(json.dumps(_walk_maps(json.loads(sys.argv[1]))))
