"""Outputs stored transposed (M contiguous), compiled on the CPU for sm_90a and sm_100a like the
variants of ``test_kernel_compile.py`` (whose helpers and checks they share): the PTX stores
them through TMA, 16-bit ones on Hopper by the transposing stmatrix, and nothing spills. No GPU
has run them yet, so they compile under ``JAX_EFC_UNVERIFIED_KERNELS=1``; the plan's refusal of
an M the TMA store cannot take runs by default."""

from __future__ import annotations

import re

import pytest

from test_kernel_compile import _aval, assemble_all, check_spills, check_variant, compile_variants

# as test_kernel_compile.VARIANTS; the epilogue's "/D,Y" names the outputs stored transposed. M
# and N leave partial tiles; M is a multiple of 16 bytes of every transposed output's dtype
TRANSPOSED_VARIANTS = {
    # a plain GEMM's output transposed (the transposing stmatrix), and a batched fp16 one
    "bf16_identity_T_128x128": ("bfloat16", False, False, None, (128, 128, 1, 1), "identity/0", (1000, 776, 256)),
    "fp16_pingpong_bias_gelu_T_batched_192x128_epi64x16_c1x2_mk": (
        "float16", True, False, 2, (192, 128, 1, 2, {"pingpong": True, "epi_m": 64, "epi_n": 16}), "bias_gelu/0",
        (1064, 776, 256)),
    # TILE operands, one output transposed and one not (ping-pong: the CTA's last tile stages both in
    # the A/B ring), or both; in clusters
    "bf16_pingpong_alpha_beta_D_T_epi64x32_c1x2": (
        "bfloat16", False, False, None, (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64}),
        "alpha_beta/D", (1128, 776, 256)),
    "bf16_alpha_beta_DY_T_128x256_c2x1": ("bfloat16", False, True, None, (128, 256, 2, 1), "alpha_beta/D,Y",
                                          (1192, 776, 256)),
    # fp32 (one value per thread and store) beside an fp32 TILE operand, batched
    "bf16_f32tile_T_batched_128x192_epi64": ("bfloat16", False, False, 2, (128, 192, 1, 1, {"epi_n": 64}),
                                             "f32_tile/0", (1256, 776, 256)),
    # 8-bit outputs transposed, cooperative and ping-pong (with a bf16 output beside)
    "fp8e4m3_nk_bias_gelu_T_128x128": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "bias_gelu/0",
                                       (1040, 776, 512)),
    "fp8e4m3_nk_fast_pingpong_alpha_beta_D_T_128x128_c1x2": (
        "float8_e4m3fn", False, True, None, (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "fast": True}),
        "alpha_beta/D", (1104, 776, 512)),
    # fp8_dense's output-gradient pass (K = 16, the accumulator unused), as the heuristic plans it:
    # two TILE operands, e5m2 stored both ways, an amax and column sums
    "bf16_fp8_grad_pass_1_T_128x256": (
        "bfloat16", False, False, None, (128, 256, 1, 1), "fp8_grad_pass/1", (1072, 912, 16)),
    # the same on ping-pong 192x128 tiles, whose last tile stages its outputs in the A/B ring
    "bf16_fp8_grad_pass_1_T_192x128_c1x2": (
        "bfloat16", False, False, None, (192, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64, "epi_n": 16}),
        "fp8_grad_pass/1", (1040, 784, 16)),
    # stream-K: split tiles meet before the epilogue, which stores the transposed output
    "bf16_bias_gelu_T_128x128_c2x1_stream_k": ("bfloat16", False, False, None, (128, 128, 2, 1, {"swizzle": 8}),
                                               "bias_gelu/0", (8192, 8192, 8192)),
}

# Blackwell: the shared driver's M-major subtiles, one value per thread and store
SM100_TRANSPOSED_VARIANTS = {
    "bf16_128x128_alpha_beta_D_T": ("bfloat16", False, False, None, (128, 128, 1, 1), "alpha_beta/D",
                                    (1000, 776, 256)),
    "bf16_2cta_256x128_c2x1_identity_T": ("bfloat16", False, True, None, (256, 128, 2, 1, {"use_2cta": True}),
                                          "identity/0", (1064, 776, 256)),
    "fp8e4m3_nk_128x128_bias_gelu_T": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "bias_gelu/0",
                                       (1040, 776, 512)),
}


def _transposed_stores(ptx: str) -> bool:
    """Whether ``ptx`` stores an epilogue subtile through TMA."""
    return bool(re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.tile\.bulk_group", ptx))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_transposed.TRANSPOSED_VARIANTS", unverified=True)


@pytest.fixture(scope="module")
def compiled_sm100(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_transposed.SM100_TRANSPOSED_VARIANTS",
                            arch="sm_100a", unverified=True)


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(TRANSPOSED_VARIANTS))
def test_variant_compiles_and_stores_through_tma(compiled, name):
    """Each variant passes the checks every Hopper variant does, returns its transposed outputs
    as (L, N, M), and stores 16-bit ones with the transposing stmatrix where every output is
    16-bit (else one value per thread and store)."""
    variant = TRANSPOSED_VARIANTS[name]
    result = compiled[name]
    check_variant(result, variant, stream_k=name.endswith("stream_k"))
    ptx = result["ptx"]
    assert _transposed_stores(ptx)
    m, n, _ = variant[6]
    epilogue, _, transposed = variant[5].partition("/")
    names = {"identity": ["0"], "bias_gelu": ["0"], "f32_tile": ["0"], "alpha_beta": ["D", "Y"],
             "fp8_grad_pass": ["0", "1"]}[epilogue]
    shapes = [tuple(s[-2:]) for s in result["out_shapes"]][:len(names)]  # reductions' partials follow
    assert shapes == [(n, m) if o in transposed.split(",") else (m, n) for o in names], shapes
    all_16bit = variant[0] in ("bfloat16", "float16") and epilogue not in ("f32_tile", "fp8_grad_pass")
    assert ("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx) == all_16bit, name
    # the untransposed output beside a transposed one keeps the plain stmatrix
    assert ("stmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx) == (all_16bit and epilogue == "alpha_beta"
                                                                    and transposed == "D")
    # on ping-pong tiles the CTA's last tile stages the outputs, M-major ones too, in the A/B ring
    assert result["ring_outputs"] == ("pingpong_alpha_beta" in name or "grad_pass_1_T_192" in name)


@pytest.mark.matrix
def test_variants_do_not_spill(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(SM100_TRANSPOSED_VARIANTS))
def test_sm100_variant_compiles_and_stores_through_tma(compiled_sm100, name):
    result = compiled_sm100[name]
    assert "error" not in result, result.get("error")
    assert result["custom_call"]
    ptx = result["ptx"]
    assert "tcgen05.mma" in ptx and "tcgen05.ld" in ptx and "stmatrix" not in ptx
    assert _transposed_stores(ptx)
    m, n, _ = SM100_TRANSPOSED_VARIANTS[name][6]
    assert tuple(result["out_shapes"][0][-2:]) == (n, m)


@pytest.mark.matrix
def test_sm100_variants_do_not_spill(compiled_sm100, tmp_path_factory):
    check_spills(assemble_all(compiled_sm100, tmp_path_factory.mktemp("sass100"), arch="sm_100a"))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_an_m_the_tma_store_cannot_take_is_refused(arch):
    """A transposed output's contiguous dimension is M: the plan refuses an M that is not 16 bytes of
    its dtype (the reference runs it), naming M and the output; N then needs no alignment."""
    pytest.importorskip("cutlass.jax")
    import dataclasses

    import jax.numpy as jnp

    import jax_efc.plan as P
    from jax_efc.config import GemmConfig
    from jax_efc.tracing import trace_epilogue

    def plan(m, n, transposed=True):
        ir, *_ = trace_epilogue(lambda acc: {"D": acc}, (m, n), [], [], {}, {}, None, jnp.bfloat16)
        ir = ir.with_outputs([dataclasses.replace(ir.outputs[0], transposed=transposed)])
        return P.plan_kernel(ir, _aval((m, 256), jnp.bfloat16), _aval((n, 256), jnp.bfloat16), [],
                             transpose_a=False, transpose_b=True, acc_dtype=jnp.float32,
                             config=GemmConfig(128, 128, 1, 1), arch=arch)

    refused = plan(1004, 512)
    assert refused.backend == "reference"
    assert "output 'D' (bfloat16) is stored transposed" in refused.reason and "M=1004" in refused.reason
    assert plan(1000, 1001).backend == "kernel"
    assert "N=1001" in plan(1000, 1001, transposed=False).reason
