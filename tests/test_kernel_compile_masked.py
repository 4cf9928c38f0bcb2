"""Outputs written over their operand only where a mask holds (``Output.mask``), compiled on the
CPU for sm_90a like the variants of ``test_kernel_compile.py``: the PTX stores them from
registers with predicated global stores, loads no subtile of the operand they are written over,
and nothing spills. No GPU has run them yet, so they compile under
``JAX_EFC_UNVERIFIED_KERNELS=1``."""

from __future__ import annotations

import re

import pytest

from test_kernel_compile import assemble_all, check_spills, compile_variants

# as test_kernel_compile.VARIANTS; M and N leave partial tiles. "masked": the one output, over
# its only TILE operand; "masked_operand": a negated mask read from a second TILE operand, and
# a second output stored through TMA
MASKED_VARIANTS = {
    "bf16_masked_128x256_c2x1": ("bfloat16", False, False, None, (128, 256, 2, 1), "masked", (1000, 776, 256)),
    "bf16_pingpong_masked_128x128_c1x2": ("bfloat16", False, False, None,
                                          (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}), "masked",
                                          (1064, 776, 256)),
    "bf16_masked_operand_128x128_epi64": ("bfloat16", False, True, None, (128, 128, 1, 1, {"epi_n": 64}),
                                          "masked_operand", (1128, 776, 256)),
    "bf16_pingpong_masked_operand_64x256": ("bfloat16", False, False, None, (64, 256, 1, 1, {"pingpong": True}),
                                            "masked_operand", (1192, 776, 256)),
    # stream-K: split tiles meet before the epilogue, which stores the masked output
    "bf16_masked_128x128_c2x1_stream_k": ("bfloat16", False, False, None, (128, 128, 2, 1, {"swizzle": 8}),
                                          "masked", (8192, 8192, 8192)),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_masked.MASKED_VARIANTS", unverified=True)


def _tensor_maps(ptx: str) -> int:
    """TMA descriptors the kernel takes (128-byte parameters): A's, B's, one per output and one
    per operand it TMA-loads."""
    return len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", ptx))


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(MASKED_VARIANTS))
def test_masked_output_is_stored_with_predicated_global_stores(compiled, name):
    """The masked output leaves the kernel by predicated 16-bit global stores, and the operand
    it is written over is never TMA-loaded: A, B and (``masked_operand``) the mask's operand are;
    a second output is stored through TMA."""
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["custom_call"] and result["stream_k"] == name.endswith("stream_k")
    ptx = result["ptx"]
    assert "wgmma.mma_async" in ptx
    assert re.search(r"@%?p\w*\s+st\.global\.b16", ptx)
    # "masked": A, B and the output; "masked_operand": A, B, two outputs and the mask's operand
    operand = MASKED_VARIANTS[name][5] == "masked_operand"
    assert _tensor_maps(ptx) == (5 if operand else 3)
    assert (".bulk_group" in ptx) == operand


@pytest.mark.matrix
def test_masked_variants_do_not_spill(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))

# Blackwell: the shared driver, its accumulators read from tensor memory
SM100_MASKED_VARIANTS = {
    "bf16_128x128_masked": ("bfloat16", False, False, None, (128, 128, 1, 1), "masked", (1000, 776, 256)),
    "bf16_2cta_256x128_c2x1_masked_operand": ("bfloat16", False, True, None, (256, 128, 2, 1, {"use_2cta": True}),
                                              "masked_operand", (1064, 776, 256)),
}


@pytest.mark.matrix
def test_sm100_masked_output_is_stored_with_predicated_global_stores(tmp_path_factory):
    compiled = compile_variants(tmp_path_factory, "test_kernel_compile_masked.SM100_MASKED_VARIANTS",
                                arch="sm_100a", unverified=True)
    for name, (*_, epilogue, _) in SM100_MASKED_VARIANTS.items():
        result = compiled[name]
        assert "error" not in result, (name, result.get("error"))
        ptx = result["ptx"]
        assert "tcgen05.mma" in ptx and re.search(r"@%?p\w*\s+st\.global\.b16", ptx), name
        assert _tensor_maps(ptx) == (5 if epilogue == "masked_operand" else 3), name
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass"), arch="sm_100a"))
