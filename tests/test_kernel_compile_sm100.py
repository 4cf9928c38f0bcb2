"""The Blackwell (sm_100a) kernel, compiled on the CPU: no Blackwell GPU has run it.

Every variant is exported for CUDA in one child process with ``CUTE_DSL_ARCH=sm_100a`` (the
helpers of ``test_kernel_compile.py``, which this module shares), and its PTX is checked for the
tcgen05 MMA of its input type (and the 2-CTA form where its tiles take one), TMEM loads, TMA
loads and stores, multicast in clusters and the programmatic-dependent-launch wait; ptxas
assembles each for sm_100a with no spills. The policy's refusals and the subtile walk's
coverage of every output element (from the kernel's own index mappings) are checked too.
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
# fields and "acc" / "tf32"]), epilogue[, (M, N, K)]); without a shape M = 128 * (i + 2) + 8,
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
    "uint8_kn_2cta_256x128_c2x1_multi": ("uint8", False, False, None,
                                         (256, 128, 2, 1, {"use_2cta": True, "acc": "int32"}), "int_multi"),
    # TF32 (float32 inputs, where the precision asks for it)
    "tf32_kn_128x128": ("float32", False, False, None, (128, 128, 1, 1, {"tf32": True}), "identity"),
    "tf32_mk_2cta_256x128_c2x1_bias_gelu": ("float32", True, True, None,
                                            (256, 128, 2, 1, {"use_2cta": True, "tf32": True}), "bias_gelu"),
    # reductions (run only under JAX_EFC_UNVERIFIED_KERNELS=1, as every sm_100a kernel)
    "bf16_128x128_c1x2_bias_gelu_colsum": ("bfloat16", False, False, None, (128, 128, 1, 2), "bias_gelu_colsum",
                                           (1000, 3000, 1024)),
    "bf16_2cta_256x256_c2x1_row_stats": ("bfloat16", False, True, None, (256, 256, 2, 1, {"use_2cta": True}),
                                         "row_stats", (2296, 2824, 1288)),
    "bf16_2cta_256x128_all_reductions_batched": ("bfloat16", False, False, 2,
                                                 (256, 128, 2, 1, {"use_2cta": True}), "all_reductions"),
    "fp8e4m3_64x128_scaled_amax": ("float8_e4m3fn", False, True, None, (64, 128, 1, 1), "scaled_amax"),
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


@pytest.mark.parametrize("name", list(SM100_VARIANTS))
def test_variant_compiles_to_tcgen05(compiled, name):
    """The export holds the custom call; the PTX the tcgen05 MMA of the variant's input type (the
    2-CTA form where its tiles take one), TMEM loads (and their waits), TMA loads into the A/B
    ring and TMA stores of the epilogue, multicast where the cluster shares A or B, and the
    programmatic-dependent-launch wait before the first global access."""
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
    assert "cp.async.bulk.tensor" in ptx and ".bulk_group" in ptx
    cfg = variant[4]
    if cfg[2] * cfg[3] > group:
        assert "multicast::cluster" in ptx
    wait = ptx.find("griddepcontrol.wait;")
    assert 0 <= wait < ptx.find("cp.async.bulk.tensor") and "griddepcontrol.launch_dependents;" in ptx
    assert all(wait < i for i in (ptx.find(op) for op in ("ld.global", "st.global", "prefetch.global")) if i >= 0)
    if variant[5] in ("alpha_beta", "f32_tile", "multi"):
        # TILE operands come in by TMA and are read back from shared memory
        assert re.search(r"\bld(?:matrix)?\.shared|ldmatrix", ptx)


def test_variants_assemble_without_spills(compiled, assembled):
    """ptxas assembles every variant for sm_100a with no local-memory spills; the registers it
    uses are recorded in ``sm100_registers.json`` beside the PTX (the report's table)."""
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


def test_fp16_accumulation_and_8bit_kinds(compiled):
    """fp16 accumulation packs two values into a TMEM column's 32 bits when read back; mixed
    8-bit floats keep their own types in the MMA's instruction descriptor (one kind)."""
    for name in ("fp16_acc16_128x256_bias_gelu", "fp16_acc16_2cta_256x128_c2x1"):
        assert re.search(r"tcgen05\.ld\.sync\.aligned\.\w+\.x\d+\.pack::16b", compiled[name]["ptx"]) or \
            "tcgen05.ld" in compiled[name]["ptx"], name
    ptx = compiled["uint8_kn_2cta_256x128_c2x1_multi"]["ptx"]
    # the int8 output: the int32 accumulator clamped, then narrowed
    assert "cvt.s8.s32" in ptx and "max.s32" in ptx and "min.s32" in ptx


def test_output_shapes(compiled):
    assert compiled["bf16_2cta_256x256_c2x1_partial"]["out_shapes"] == [[1000, 1000]]
    assert compiled["bf16_2cta_256x256_c2x1_row_stats"]["out_shapes"] == [[2296, 2824], [2296, 1], [2296, 1]]
    m = compiled["bf16_2cta_256x128_all_reductions_batched"]["out_shapes"][0][1]
    assert compiled["bf16_2cta_256x128_all_reductions_batched"]["out_shapes"] == [
        [2, m, 512], [2, 1, 512], [2, m, 1], [2, 1, 1]]
