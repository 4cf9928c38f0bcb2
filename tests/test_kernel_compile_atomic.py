"""Epilogue reductions folded across tiles by atomics (``gemm(deterministic=False)``), compiled
for sm_90a and sm_100a on the CPU like those of ``test_kernel_compile_reductions.py``, in child
processes of their own: what they compile to, and the results' shapes."""

from __future__ import annotations

import re

import pytest

from test_kernel_compile import assemble_all, check_spills, check_variant, compile_variants

pytestmark = pytest.mark.matrix

# as REDUCTION_VARIANTS: sums, maxes, mins and amaxes over M, N and both, on ping-pong and
# cooperative tiles, in clusters (tiles wholly past an edge), batched, under stream-K
ATOMIC_VARIANTS = {
    "bf16_pingpong_bias_gelu_colsum_128x128_c1x2": ("bfloat16", False, False, None,
                                                    (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                                    "bias_gelu_colsum+atomic", (1000, 3000, 1024)),
    "bf16_pingpong_row_stats_128x192_c2x1_stream_k": ("bfloat16", False, True, None,
                                                      (128, 192, 2, 1, {"pingpong": True, "raster": "n"}),
                                                      "row_stats+atomic", (2296, 2824, 1288)),
    "bf16_amax_128x256_c2x1": ("bfloat16", True, False, None, (128, 256, 2, 1), "amax+atomic"),
    "bf16_all_reductions_batched_256x128": ("bfloat16", False, False, 2, (256, 128, 1, 2, {"epi_m": 128}),
                                            "all_reductions+atomic"),
    "bf16_pingpong_row_stats_192x128_epi64_c1x2": ("bfloat16", False, False, None,
                                                   (192, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64}),
                                                   "row_stats+atomic"),
}

# Blackwell's: 1-CTA tiles in a cluster, 2-CTA ones (a subtile spans two column blocks), a batch
SM100_ATOMIC_VARIANTS = {
    "bf16_128x128_c1x2_bias_gelu_colsum": ("bfloat16", False, False, None, (128, 128, 1, 2),
                                           "bias_gelu_colsum+atomic", (1000, 3000, 1024)),
    "bf16_2cta_256x256_c2x1_row_stats": ("bfloat16", False, True, None, (256, 256, 2, 1, {"use_2cta": True}),
                                         "row_stats+atomic", (2296, 2824, 1288)),
    "bf16_2cta_256x128_all_reductions_batched": ("bfloat16", False, False, 2,
                                                 (256, 128, 2, 1, {"use_2cta": True}), "all_reductions+atomic"),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_atomic.ATOMIC_VARIANTS", unverified=True)


@pytest.fixture(scope="module")
def compiled_sm100(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_atomic.SM100_ATOMIC_VARIANTS", arch="sm_100a",
                            unverified=True)


@pytest.mark.parametrize("name", list(ATOMIC_VARIANTS))
def test_variant_compiles_to_wgmma(compiled, name):
    check_variant(compiled[name], ATOMIC_VARIANTS[name], stream_k="stream_k" in name)


def test_variants_do_not_spill_and_fit_the_register_budget(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


# the global reductions each variant's results take: a sum by a float one, a max or min by a
# signed integer one on non-negative values' bits and an unsigned one the other way on negative ones'
FOLDS = {
    "bf16_pingpong_bias_gelu_colsum_128x128_c1x2": {"add.f32"},
    "bf16_pingpong_row_stats_128x192_c2x1_stream_k": {"add.f32", "max.s32", "min.u32"},
    "bf16_amax_128x256_c2x1": {"max.s32", "min.u32"},
    "bf16_all_reductions_batched_256x128": {"add.f32", "min.s32", "max.u32", "max.s32", "min.u32"},
    "bf16_pingpong_row_stats_192x128_epi64_c1x2": {"add.f32", "max.s32", "min.u32"},
    "bf16_128x128_c1x2_bias_gelu_colsum": {"add.f32"},
    "bf16_2cta_256x256_c2x1_row_stats": {"add.f32", "max.s32", "min.u32"},
    "bf16_2cta_256x128_all_reductions_batched": {"add.f32", "min.s32", "max.u32", "max.s32", "min.u32"},
}


def test_sm100_variants_compile_without_spills(compiled_sm100, tmp_path_factory):
    for name, result in compiled_sm100.items():
        assert "error" not in result, (name, result.get("error"))
        assert "tcgen05.mma" in result["ptx"], name
    check_spills(assemble_all(compiled_sm100, tmp_path_factory.mktemp("sass"), arch="sm_100a"), max_registers=255)


@pytest.mark.parametrize("name", list(FOLDS))
def test_tiles_fold_into_the_results_by_atomics(compiled, compiled_sm100, name):
    """Each tile's value goes straight into the result by a global reduction (no returned old
    value), with no per-tile partials stored (stream-K's workspace is stored 16 bytes at a time);
    max and min still find NaN (a self-comparison) and fold it in as the value that wins."""
    ptx = (compiled if name in ATOMIC_VARIANTS else compiled_sm100)[name]["ptx"]
    assert set(re.findall(r"\bred(?:\.\w+)*?\.global\.(\w+\.\w+)", ptx)) == FOLDS[name]
    assert "atom." not in ptx
    assert not [s for s in re.findall(r"\bst\.global(?:\.\w+)*\.[fb]32\b", ptx) if ".v" not in s]
    if FOLDS[name] != {"add.f32"}:
        assert re.search(r"setp\.(?:nan|neu)\.f32", ptx)


def test_output_shapes(compiled):
    """The results come back whole, one value per column, row or batch: nothing is left to
    reduce but the conversion to the output's dtype."""
    assert compiled["bf16_pingpong_bias_gelu_colsum_128x128_c1x2"]["out_shapes"] == [[1000, 3000], [1, 3000]]
    assert compiled["bf16_pingpong_row_stats_128x192_c2x1_stream_k"]["out_shapes"] == [
        [2296, 2824], [2296, 1], [2296, 1]]
    m = compiled["bf16_all_reductions_batched_256x128"]["out_shapes"][0][1]
    assert compiled["bf16_all_reductions_batched_256x128"]["out_shapes"] == [
        [2, m, 512], [2, 1, 512], [2, m, 1], [2, 1, 1]]
