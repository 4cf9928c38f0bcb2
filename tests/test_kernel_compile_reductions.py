"""The kernel variants whose epilogues reduce (``kernels/reduction.py``), compiled for sm_90a on
the CPU like those of ``test_kernel_compile.py`` (whose checks they share), in a child process of
their own; and what their reductions compile to."""

from __future__ import annotations

import re

import pytest

from test_kernel_compile import REDUCTION_VARIANTS, assemble_all, check_spills, check_variant, compile_variants

pytestmark = pytest.mark.matrix


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "reductions")


@pytest.mark.parametrize("name", list(REDUCTION_VARIANTS))
def test_variant_compiles_to_wgmma(compiled, name):
    check_variant(compiled[name], REDUCTION_VARIANTS[name], stream_k="stream_k" in name)


def test_variants_do_not_spill_and_fit_the_register_budget(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


def test_partials_meet_by_shuffles_and_are_stored_once_per_tile(compiled):
    """Lanes that share a position meet by butterfly shuffles, warps through fp32 shared
    memory; the partials leave by plain fp32 global stores (no atomics: the result is the same
    on every run); max and min keep NaN (a self-comparison)."""
    for name in REDUCTION_VARIANTS:
        ptx = compiled[name]["ptx"]
        assert re.search(r"\bshfl\.sync\.bfly\.b32\b", ptx), name
        assert re.search(r"\bst\.shared(?:\.\w+)*\.f32\b", ptx) or re.search(r"\bst\.shared(?:\.\w+)*\.b32\b", ptx), name
        assert re.search(r"\bld\.shared(?:\.\w+)*\.(?:f|b)32\b", ptx), name
        assert re.search(r"\bst\.global(?:\.\w+)*\.(?:f|b)32\b", ptx), name
        assert "atom." not in ptx and "red.global" not in ptx, name
    for name in ("bf16_pingpong_row_stats_128x192_c2x1_stream_k", "bf16_amax_128x256_c2x1",
                 "bf16_all_reductions_batched_256x128", "fp8e4m3_nk_scaled_amax_128x128"):
        assert re.search(r"setp\.(?:nan|neu)\.f32", compiled[name]["ptx"]), name


def test_output_shapes(compiled):
    """Tile outputs (M, N); reductions in their canonical shapes, finished in XLA."""
    assert compiled["bf16_pingpong_bias_gelu_colsum_128x128_c1x2"]["out_shapes"] == [[1000, 3000], [1, 3000]]
    assert compiled["bf16_pingpong_row_stats_128x192_c2x1_stream_k"]["out_shapes"] == [[2296, 2824], [2296, 1], [2296, 1]]
    # a row softmax and a row norm finished in the tile, a row sum's partials (one tile a row)
    assert compiled["bf16_softmax_norm_128x128_stream_k"]["out_shapes"] == [[8192, 120], [8192, 120], [8192, 1]]
    m = compiled["bf16_all_reductions_batched_256x128"]["out_shapes"][0][1]
    assert compiled["bf16_all_reductions_batched_256x128"]["out_shapes"] == [
        [2, m, 512], [2, 1, 512], [2, m, 1], [2, 1, 1]]


def test_the_heuristic_keeps_crowded_reduction_epilogues_off_192_accumulator_tiles():
    """fused_mlp's backward epilogues (TILE operands and column sums) spilled on ping-pong
    192x128 tiles (the gated one 500 bytes, GELU's 464): the heuristic runs them on ping-pong
    128x128 (compiled above). A column sum without a TILE operand keeps the taller tile."""
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.kernels import KernelProblem
    from jax_efc.kernels.sm90_policy import POLICY
    from test_kernel_compile import _epilogue

    m, n, k = 8192, 14336, 4096

    def chosen(ir, ops):
        problem = KernelProblem(ir=ir, ab_dtype="bfloat16", acc_dtype="float32", a_major="k", b_major="k",
                                batched=False, a_batched=False, b_batched=False,
                                operand_batched=(False,) * len(ops), arch="sm_90a", config=GemmConfig())
        return POLICY.choose_config(problem, m, n, k, 1)

    gated = chosen(*_epilogue("mlp_gated_bwd", m, n, None, jnp.bfloat16))
    assert (gated.tile_m, gated.tile_n, gated.pingpong) == (128, 128, True), gated
    pinned = REDUCTION_VARIANTS["bf16_pingpong_mlp_gated_bwd_128x128_epi64x16_c1x2"][4]
    assert (gated.cluster_m, gated.cluster_n, gated.epi_m, gated.epi_n) == (
        pinned[2], pinned[3], pinned[4]["epi_m"], pinned[4]["epi_n"])
    gelu = chosen(*_epilogue("mlp_gelu_bwd", m, n, None, jnp.bfloat16))
    pinned = REDUCTION_VARIANTS["bf16_pingpong_mlp_gelu_bwd_128x128_c1x2"][4]
    assert (gelu.tile_m, gelu.tile_n, gelu.pingpong, gelu.cluster_n, gelu.epi_m, gelu.epi_n) == (
        128, 128, True, pinned[3], 0, 32), gelu
    roomy = chosen(*_epilogue("bias_gelu_colsum", m, n, None, jnp.bfloat16))
    assert roomy.tile_m * roomy.tile_n > 128 * 128, roomy
