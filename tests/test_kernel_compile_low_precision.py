"""The kernel variants for the input types beyond 16-bit floats with fp32 accumulation (8-bit
floats, 8-bit integers, fp16 accumulation, float32 as TF32), compiled for sm_90a on the CPU like those of
``test_kernel_compile.py`` (whose checks they share), in a child process of their own; and the
instructions their types call for."""

from __future__ import annotations

import re

import pytest

from test_kernel_compile import LOW_PRECISION_VARIANTS, assemble_all, check_spills, check_variant, compile_variants

pytestmark = pytest.mark.matrix


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "low_precision")


@pytest.mark.parametrize("name", list(LOW_PRECISION_VARIANTS))
def test_variant_compiles_to_wgmma(compiled, name):
    check_variant(compiled[name], LOW_PRECISION_VARIANTS[name])


def test_variants_do_not_spill_and_fit_the_register_budget(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


def test_8bit_kernels_use_the_8bit_wgmma_and_saturating_stores(compiled):
    for name, kind, tile_n in (("fp8e4m3_nk_bias_gelu_128x128", "e4m3", 128),
                               ("fp8e4m3_nk_alpha_beta_128x192_c2x1", "e4m3", 192),
                               ("fp8e4m3_nk_bias_gelu_128x128_stream_k", "e4m3", 128),
                               ("fp8e5m2_nk_fast_pingpong_128x128_c1x2", "e5m2", 128),
                               ("fp8e4m3_nk_fast_alpha_beta_128x256_c2x1", "e4m3", 256),
                               ("fp8e4m3_nk_fast_pingpong_192x128_bias_gelu", "e4m3", 128),
                               ("fp8mixed_kn_bias_gelu_128x192", "e4m3", 192)):
        ptx = compiled[name]["ptx"]
        assert compiled[name]["custom_call"], name
        b_kind = "e5m2" if "mixed" in name else kind
        assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k32.f32.{kind}.{b_kind}" in ptx, name
        assert "k16.f32.bf16" not in ptx, name
        # stores to 8-bit outputs round to nearest even and saturate (no NaN from an overflow)
        assert f"cvt.rn.satfinite.{kind}x2.f32" in ptx, name


def test_8bit_float_partial_sums_are_promoted_each_k_tile_at_highest(compiled):
    """Promotion at precision HIGHEST: each k-tile's WGMMAs start from zero in registers of their
    own, the k-loop waits for them (no batch left in flight) and adds them into the fp32
    accumulators: 64 ``add.f32`` a thread for a 128x128 cooperative tile, beside the epilogue's
    64 bias adds. Fast kernels keep one batch in flight instead."""
    for name in ("fp8e4m3_nk_bias_gelu_128x128", "fp8e4m3_nk_alpha_beta_128x192_c2x1",
                 "fp8e4m3_nk_bias_gelu_128x128_stream_k", "fp8mixed_kn_bias_gelu_128x192"):
        assert _waits(compiled[name]["ptx"]) == {"0"}, name
    for name in ("fp8e5m2_nk_fast_pingpong_128x128_c1x2", "fp8e4m3_nk_fast_alpha_beta_128x256_c2x1"):
        assert _waits(compiled[name]["ptx"]) == {"0", "1"}, name
    assert len(_adds(compiled["fp8e4m3_nk_bias_gelu_128x128"]["ptx"])) >= 2 * 64


def _waits(ptx: str) -> set[str]:
    """The counts of WGMMA batches the kernel waits down to."""
    return set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d);", ptx))


def _adds(ptx: str) -> list[str]:
    return re.findall(r"\badd(?:\.rn)?\.f32\b", ptx)


# partial sums promoted every second k-tile (Sm90Policy.promotion_k_tiles), the default, a
# cooperative tile's two warpgroups at alternate k-tiles: the heuristic's 128x192 tile in 2x1
# clusters, 128x128 under stream-K, and ping-pong (one warpgroup a tile)
PROMOTION_INTERVAL_VARIANTS = {
    "fp8e4m3_nk_every2_bias_gelu_128x128": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "bias_gelu"),
    "fp8e4m3_nk_every2_bias_gelu_128x128_stream_k": ("float8_e4m3fn", False, True, None,
                                                     (128, 128, 2, 1, {"swizzle": 8}), "bias_gelu", (8192, 8192, 8192)),
    "fp8e4m3_nk_every2_bias_gelu_128x192_c2x1": ("float8_e4m3fn", False, True, None,
                                                 (128, 192, 2, 1, {"swizzle": 8}), "bias_gelu"),
    "fp8e5m2_nk_every2_pingpong_128x64_c1x2": ("float8_e5m2", False, True, None,
                                               (128, 64, 1, 2, {"pingpong": True}), "identity"),
}


@pytest.fixture(scope="module")
def compiled_every2(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_low_precision.PROMOTION_INTERVAL_VARIANTS")


def test_promotion_every_two_k_tiles_keeps_a_batch_in_flight_between(compiled_every2, tmp_path_factory):
    """Promoting every second k-tile (the default), each warpgroup's k-loop waits for all but the
    last batch (``wait_group 1``) after the first k-tile of each of its pairs and for all
    (``wait_group 0``) before adding the pair's partial sums into fp32; no spills."""
    for name, variant in PROMOTION_INTERVAL_VARIANTS.items():
        check_variant(compiled_every2[name], variant)
        assert _waits(compiled_every2[name]["ptx"]) == {"0", "1"}, name
    assert compiled_every2["fp8e4m3_nk_every2_bias_gelu_128x128_stream_k"]["stream_k"]
    assert len(_adds(compiled_every2["fp8e4m3_nk_every2_bias_gelu_128x128"]["ptx"])) >= 2 * 64
    check_spills(assemble_all(compiled_every2, tmp_path_factory.mktemp("sass")))


def test_int8_kernels_use_the_integer_wgmma(compiled):
    # the integer WGMMA accumulates in int32, saturating (.satfinite) where a sum would overflow
    assert "wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8" in compiled["int8_nk_identity_128x128"]["ptx"]
    ptx = compiled["int8xuint8_nk_multi_128x256_c2x1"]["ptx"]
    assert set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)) == {"wgmma.mma_async.sync.aligned.m64n256k32.satfinite.s32.s8.u8"}
    # the int8 output: the int32 accumulator clamped, then narrowed
    assert "cvt.s8.s32" in ptx and "max.s32" in ptx and "min.s32" in ptx


def test_fp16_accumulation_uses_the_f16_accumulating_wgmma(compiled):
    for name, tile_n in (("fp16_acc16_bias_gelu_128x256", 256), ("fp16_acc16_pingpong_128x128_c1x2", 128)):
        ptx = compiled[name]["ptx"]
        assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k16.f16.f16.f16" in ptx, name
        assert ".f32.f16.f16" not in ptx, name


def test_float32_kernels_use_the_tf32_wgmma(compiled):
    for name, tile_n in (("tf32_nk_bias_gelu_128x128", 128), ("tf32_kn_pingpong_128x192_epi64_c2x1", 192),
                         ("tf32_nk_bias_gelu_128x128_c2x1_stream_k", 128)):
        ptx = compiled[name]["ptx"]
        assert set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)) == {
            f"wgmma.mma_async.sync.aligned.m64n{tile_n}k8.f32.tf32.tf32"}, name
    assert "cvt.rna.tf32.f32" not in "".join(compiled[name]["ptx"] for name in LOW_PRECISION_VARIANTS)
