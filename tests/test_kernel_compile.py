"""Compile every supported SM90 kernel variant on the CPU (no GPU needed).

All variants are built in one child process with ``CUTE_DSL_ARCH=sm_90a`` and the DSL told to
keep its PTX (the DSL reads those settings once, at import, hence the child). Each variant is
exported through ``jax.export(jax.jit(f), platforms=["cuda"])`` with ``f`` calling
``jax_efc.ffi.fused_gemm``; the test then checks the exported module holds the custom call and
the variant's PTX holds WGMMA, TMA loads and TMA stores. Variants get distinct M so their PTX
files (named after the argument shapes) can be told apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import run_for_sm90

# name -> (dtype, transpose_a, transpose_b, batch, config (tile_m, tile_n, cluster_m, cluster_n
# [, other GemmConfig fields as a dict]), epilogue[, (M, N, K)])
VARIANTS = {
    "bf16_kn_128x128": ("bfloat16", False, False, None, (128, 128, 1, 1), "identity"),
    "fp16_mk_128x256": ("float16", True, True, None, (128, 256, 1, 1), "identity"),
    "bf16_mn_128x256_c2x1": ("bfloat16", True, False, None, (128, 256, 2, 1), "bias_gelu"),
    "bf16_kk_128x128_c1x2": ("bfloat16", False, True, None, (128, 128, 1, 2), "identity"),
    "bf16_batched_64x128": ("bfloat16", False, False, 3, (64, 128, 1, 1), "identity"),
    "fp16_c2x2_128x128": ("float16", False, False, None, (128, 128, 2, 2), "bias_gelu"),
    "bf16_multi_batched_c2x1": ("bfloat16", True, True, 2, (128, 256, 2, 1), "multi"),
    # two TILE operands (TMA-loaded epilogue operands), two outputs: the CUTLASS example's alpha-beta
    "bf16_alpha_beta_128x256": ("bfloat16", False, False, None, (128, 256, 1, 1), "alpha_beta"),
    "fp16_alpha_beta_epi64_64x128": ("float16", False, True, None, (64, 128, 1, 1, {"epi_n": 64}),
                                     "alpha_beta"),
    "bf16_bias_gelu_epi64_c2x1": ("bfloat16", False, False, None, (128, 256, 2, 1, {"epi_n": 64}),
                                  "bias_gelu"),
    "bf16_bias_silu_128x256": ("bfloat16", False, False, None, (128, 256, 1, 1), "bias_silu"),
    # fp32 TILE operand, shared across the batch, 192-wide tile (3 subtiles of 64)
    "bf16_f32tile_batched_192_epi64": ("bfloat16", False, False, 2, (128, 192, 1, 1, {"epi_n": 64}),
                                       "f32_tile"),
    # ping-pong schedule: two consumer warpgroups with 64x256 or 128x128 tiles each, ordered
    # by named barriers; TILE operands through the shared epilogue buffers, clusters,
    # 64-wide subtiles
    "bf16_pingpong_64x256": ("bfloat16", False, False, None, (64, 256, 1, 1, {"pingpong": True}),
                             "identity"),
    "bf16_pingpong_alpha_beta_64x256_c2x1": ("bfloat16", False, False, None,
                                             (64, 256, 2, 1, {"pingpong": True}), "alpha_beta"),
    "fp16_pingpong_bias_gelu_epi64_c1x2": ("float16", False, True, None,
                                           (64, 256, 1, 2, {"pingpong": True, "epi_n": 64}),
                                           "bias_gelu"),
    # what the heuristic runs for large problems
    "bf16_pingpong_128x128_c1x2_swizzle8": ("bfloat16", False, False, None,
                                            (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                            "identity"),
    "bf16_pingpong_128x192_c2x1_raster_n_mk": ("bfloat16", True, False, None,
                                               (128, 192, 2, 1, {"pingpong": True, "swizzle": 8, "raster": "n"}),
                                               "identity"),
    "bf16_pingpong_bias_silu_epi64_c1x2": ("bfloat16", False, False, None,
                                           (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_n": 64}),
                                           "bias_silu"),
    "bf16_pingpong_192x128_c1x2_swizzle8": ("bfloat16", False, False, None,
                                            (192, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                            "bias_gelu"),
    "fp16_pingpong_alpha_beta_128x192_mk": ("float16", True, False, None,
                                            (128, 192, 1, 1, {"pingpong": True}), "alpha_beta"),
    # what the heuristic gives epilogues with work where 192x128 tiles fill the SMs worse
    "bf16_pingpong_bias_gelu_128x192_c2x1_raster_n": ("bfloat16", False, False, None,
                                                      (128, 192, 2, 1, {"pingpong": True, "swizzle": 8,
                                                                        "raster": "n"}), "bias_gelu"),
    "bf16_pingpong_alpha_beta_128x192_epi64x16_c2x1_nk": ("bfloat16", False, True, None,
                                                          (128, 192, 2, 1, {"pingpong": True, "swizzle": 8,
                                                                            "raster": "n", "epi_m": 64,
                                                                            "epi_n": 16}), "alpha_beta"),
    # cooperative 256x128: two warpgroups of 128 rows, two m64n128 WGMMAs each per k-step
    "bf16_256x128_c1x2_swizzle8": ("bfloat16", False, True, None, (256, 128, 1, 2, {"swizzle": 8}),
                                   "bias_gelu"),
    "fp16_256x192_mk": ("float16", True, False, None, (256, 192, 1, 1), "bias_silu"),
    "bf16_pingpong_128x128_c2x1": ("bfloat16", False, False, None,
                                   (128, 128, 2, 1, {"pingpong": True}), "bias_gelu"),
    "bf16_pingpong_alpha_beta_128x128": ("bfloat16", True, True, 2,
                                         (128, 128, 1, 1, {"pingpong": True}), "alpha_beta"),
    # 64x32 and 64x16 subtiles (what the heuristic gives alpha-beta on 128x128 and 192x128
    # ping-pong tiles), 16-wide ones, subtiles a third of a 192-row tile high, and with outputs
    # of three dtypes (fp32 and fp16 outputs are not stored by stmatrix)
    "bf16_pingpong_alpha_beta_epi64x32_c1x2": ("bfloat16", False, False, None,
                                               (128, 128, 1, 2, {"pingpong": True, "swizzle": 8,
                                                                 "epi_m": 64}), "alpha_beta"),
    "bf16_pingpong_alpha_beta_192x128_epi64x16_c1x2": ("bfloat16", False, False, None,
                                                       (192, 128, 1, 2, {"pingpong": True, "swizzle": 8,
                                                                         "epi_m": 64, "epi_n": 16}),
                                                       "alpha_beta"),
    "bf16_pingpong_alpha_beta_epi16_c1x2": ("bfloat16", False, False, None,
                                            (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_n": 16}),
                                            "alpha_beta"),
    "fp16_pingpong_bias_gelu_192x128_epi64x64": ("float16", True, False, 2,
                                                 (192, 128, 1, 2, {"pingpong": True, "epi_n": 64,
                                                                   "epi_m": 64}), "bias_gelu"),
    # every operand role (TILE, ROW, COL, SCALAR) and a boolean intermediate, paced
    "bf16_pingpong_multi_c1x2": ("bfloat16", False, False, None,
                                 (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}), "multi"),
    "bf16_multi_256x128_epi128x32": ("bfloat16", False, True, None, (256, 128, 2, 1, {"epi_m": 128}),
                                     "multi"),
    "fp16_multi_epi16_128x256": ("float16", False, True, 2, (128, 256, 1, 1, {"epi_n": 16}), "multi"),
    # shapes whose last round of whole tiles would leave most clusters idle: stream-K
    "bf16_pingpong_bias_gelu_stream_k": ("bfloat16", False, False, None,
                                         (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                         "bias_gelu", (8192, 8192, 8192)),
    "bf16_alpha_beta_128x256_c2x1_stream_k": ("bfloat16", False, True, None,
                                              (128, 256, 2, 1, {"swizzle": 8}), "alpha_beta",
                                              (8192, 7936, 8192)),
    "bf16_pingpong_alpha_beta_128x192_c2x1_stream_k": ("bfloat16", True, True, None,
                                                       (128, 192, 2, 1, {"pingpong": True, "swizzle": 8,
                                                                         "raster": "n", "epi_m": 64,
                                                                         "epi_n": 16}), "alpha_beta",
                                                       (2296, 2824, 1288)),
    # at most half as many tiles as SMs: every tile's k-iterations split over all of them
    "bf16_bias_gelu_128x128_split_all": ("bfloat16", False, False, None, (128, 128, 1, 1), "bias_gelu",
                                         (1024, 512, 8192)),
}
# The input types beyond 16-bit floats with fp32 accumulation (compiled in a module of their own,
# tests/test_kernel_compile_low_precision.py, so that the two compile matrices can run side by side)
LOW_PRECISION_VARIANTS = {
    # 8-bit float A and B (K-major both: b stored (N, K)); 128-deep k-tiles, m64nNk32 WGMMAs;
    # bf16 epilogue operands, 8-bit or wider outputs. "highest" ones (precision HIGHEST) promote
    # each k-tile's partial sums into fp32 accumulators (cooperative tiles of at most 96 columns a
    # warpgroup; the default interval, every second k-tile, is compiled beside them in
    # test_kernel_compile_low_precision.py); "fast" ones accumulate in the WGMMA alone
    # (precision=...FAST_ACCUM), in any tile
    "fp8e4m3_nk_bias_gelu_128x128": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1, {"highest": True}),
                                     "bias_gelu"),
    "fp8e4m3_nk_alpha_beta_128x192_c2x1": ("float8_e4m3fn", False, True, None,
                                           (128, 192, 2, 1, {"swizzle": 8, "highest": True}), "alpha_beta"),
    "fp8e4m3_nk_bias_gelu_128x128_stream_k": ("float8_e4m3fn", False, True, None,
                                              (128, 128, 2, 1, {"swizzle": 8, "highest": True}), "bias_gelu",
                                              (8192, 8192, 8192)),
    "fp8e5m2_nk_fast_pingpong_128x128_c1x2": ("float8_e5m2", False, True, None,
                                              (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "fast": True}),
                                              "identity"),
    "fp8e4m3_nk_fast_alpha_beta_128x256_c2x1": ("float8_e4m3fn", False, True, None,
                                                (128, 256, 2, 1, {"fast": True}), "alpha_beta"),
    # fp16 accumulation (fp16 inputs): the f16-accumulating WGMMA, read as fp32 by the epilogue
    "fp16_acc16_bias_gelu_128x256": ("float16", False, False, None, (128, 256, 1, 1, {"acc": "float16"}),
                                     "bias_gelu"),
    "fp16_acc16_pingpong_128x128_c1x2": ("float16", False, True, None,
                                         (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "acc": "float16"}),
                                         "alpha_beta"),
    # 8-bit integers, int32 accumulators: the bare accumulator stored exactly as int32, and
    # int8 x uint8 with a float epilogue and several outputs (bf16, fp32, int32, saturated int8)
    "int8_nk_identity_128x128": ("int8", False, True, None, (128, 128, 1, 1, {"acc": "int32"}), "identity"),
    "int8xuint8_nk_multi_128x256_c2x1": ("int8+uint8", False, True, None, (128, 256, 2, 1, {"acc": "int32"}),
                                         "int_multi"),
    # mixed 8-bit formats (A e4m3, B e5m2), B stored (K, N): transposed once before the kernel
    "fp8mixed_kn_bias_gelu_128x192": ("float8_e4m3fn+float8_e5m2", False, False, None,
                                      (128, 192, 1, 1, {"highest": True}), "bias_gelu"),
    "fp8e4m3_nk_fast_pingpong_192x128_bias_gelu": ("float8_e4m3fn", False, True, None,
                                                   (192, 128, 1, 2, {"pingpong": True, "epi_m": 64, "epi_n": 16,
                                                                     "fast": True}), "bias_gelu"),
    # float32 A and B as TF32 (K-major both; 32-deep k-tiles, m64nNk8 WGMMAs), fp32 epilogue
    # operands and outputs; B stored (K, N) is transposed once before the kernel
    "tf32_nk_bias_gelu_128x128": ("float32", False, True, None, (128, 128, 1, 1), "bias_gelu"),
    "tf32_kn_pingpong_128x192_epi64_c2x1": ("float32", False, False, None,
                                            (128, 192, 2, 1, {"pingpong": True, "swizzle": 8, "raster": "n",
                                                              "epi_m": 64}), "identity"),
    "tf32_nk_bias_gelu_128x128_c2x1_stream_k": ("float32", False, True, None, (128, 128, 2, 1, {"swizzle": 8}),
                                                "bias_gelu", (8192, 8192, 8192)),
}

# Epilogues that reduce (kernels/reduction.py): sums, maxes and amaxes over M, N and both, on
# ping-pong and cooperative tiles, in clusters, batched, under stream-K, with partial tiles
# (compiled in tests/test_kernel_compile_reductions.py; the kernel runs them only under
# JAX_EFC_UNVERIFIED_KERNELS=1 until they have run on a GPU)
REDUCTION_VARIANTS = {
    "bf16_pingpong_bias_gelu_colsum_128x128_c1x2": ("bfloat16", False, False, None,
                                                    (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                                    "bias_gelu_colsum", (1000, 3000, 1024)),
    "bf16_pingpong_row_stats_128x192_c2x1_stream_k": ("bfloat16", False, True, None,
                                             (128, 192, 2, 1, {"pingpong": True, "raster": "n"}), "row_stats",
                                             (2296, 2824, 1288)),
    "bf16_amax_128x256_c2x1": ("bfloat16", True, False, None, (128, 256, 2, 1), "amax"),
    "bf16_all_reductions_batched_256x128": ("bfloat16", False, False, 2, (256, 128, 1, 2, {"epi_m": 128}),
                                            "all_reductions"),
    "bf16_pingpong_bias_gelu_colsum_stream_k": ("bfloat16", False, False, None,
                                                (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                                "bias_gelu_colsum", (8192, 8192, 8192)),
    "fp8e4m3_nk_scaled_amax_128x128": ("float8_e4m3fn", False, True, None, (128, 128, 1, 1), "scaled_amax"),
    # what the heuristic runs for large problems: 192 accumulators a thread, 64-row subtiles
    "bf16_pingpong_row_stats_192x128_epi64_c1x2": ("bfloat16", False, False, None,
                                                   (192, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64}),
                                                   "row_stats"),
    "bf16_pingpong_bias_gelu_colsum_128x192_epi64_c2x1": ("bfloat16", False, False, None,
                                                          (128, 192, 2, 1, {"pingpong": True, "swizzle": 8,
                                                                            "raster": "n", "epi_m": 64}),
                                                          "bias_gelu_colsum"),
    # fused_mlp's gated backward (two TILE operands, two column sums) as the heuristic runs it at
    # 8192x14336x4096: ping-pong 128x128 (on 192x128 tiles it spilled 500 bytes)
    "bf16_pingpong_mlp_gated_bwd_128x128_epi64x16_c1x2": ("bfloat16", False, True, None,
                                                          (128, 128, 1, 2, {"pingpong": True, "swizzle": 8,
                                                                            "epi_m": 64, "epi_n": 16}),
                                                          "mlp_gated_bwd", (8192, 14336, 4096)),
    # and its GELU backward (one TILE operand, one column sum), 464 bytes spilled on 192x128
    # (K 2048: the dumped PTX is named by the first operands' shapes, which the gated one shares)
    "bf16_pingpong_mlp_gelu_bwd_128x128_c1x2": ("bfloat16", False, True, None,
                                                (128, 128, 1, 2, {"pingpong": True, "swizzle": 8}),
                                                "mlp_gelu_bwd", (8192, 14336, 2048)),
    # reductions the epilogue consumes, finished inside a tile that spans the rows (two passes)
    "bf16_softmax_norm_128x128_stream_k": ("bfloat16", False, False, None, (128, 128, 1, 1), "softmax_norm",
                                           (8192, 120, 4096)),
    "bf16_softmax_norm_transposed_128x128": ("bfloat16", False, False, None, (128, 128, 1, 1), "softmax_norm/0",
                                             (4096, 96, 1024)),
    "bf16_pingpong_softmax_norm_128x128_epi64_stream_k": ("bfloat16", False, True, None,
                                                          (128, 128, 1, 1, {"pingpong": True, "epi_m": 64}),
                                                          "softmax_norm", (2296, 128, 4104)),
}


def _config(cfg):
    from jax_efc.config import GemmConfig

    extra = {k: v for k, v in (cfg[4] if len(cfg) > 4 else {}).items() if k not in ("acc", "fast", "highest")}
    return GemmConfig(*cfg[:4], **extra)


def _acc_dtype(cfg) -> str:
    """A variant's accumulator dtype: ``"acc"`` among its config's extras, else float32."""
    return (cfg[4] if len(cfg) > 4 else {}).get("acc", "float32")


def _precision(cfg):
    """A variant's precision: 8-bit float ones marked ``"fast"`` skip promoting partial sums, those
    marked ``"highest"`` promote them each k-tile (by default, every ``promotion_k_tiles``)."""
    import jax

    extra = cfg[4] if len(cfg) > 4 else {}
    if extra.get("highest"):
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM if extra.get("fast") else None


def _epilogue(name: str, m: int, n: int, batch: int | None, dtype):
    """(ir, operand avals) for one of the test epilogues; ``"NAME/D,Y"`` stores its outputs D
    and Y transposed, ``"NAME+atomic"`` folds its reductions across tiles by atomics, ``"gatedB:NAME"``
    is a gated one of block B (``n`` the product's columns)."""
    import jax
    import jax.numpy as jnp

    from jax_efc.epilogue import rows_in_tile, split_at_reductions, with_masked_stores
    from jax_efc.tracing import trace_epilogue

    name, _, transposed = name.partition("/")
    name, atomic = name.removesuffix("+atomic"), name.endswith("+atomic")
    gated = 0
    if name.startswith("gated"):
        head, _, name = name.partition(":")
        gated, n = int(head[len("gated"):]), n // 2

    acc_shape = (m, n) if batch is None else (batch, m, n)
    out_dtype = jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else dtype  # as efc.gemm defaults
    if jnp.dtype(dtype).itemsize == 1:  # 8-bit inputs: 16-bit epilogue operands
        dtype = jnp.bfloat16
    if name == "identity":
        fn, shapes, dtypes, outs = (lambda acc: acc), [], [], out_dtype
    elif name == "alpha_beta":
        fn = lambda acc, c, x: {"D": acc * 2.0 + c * 1.0 + x * 3.0, "Y": acc}  # noqa: E731
        shapes, dtypes, outs = [acc_shape, acc_shape], [dtype, dtype], {"D": out_dtype, "Y": dtype}
    elif name == "int_multi":
        fn = lambda acc, bias: {"D": jax.nn.gelu(acc * 1e-4 + bias), "Y": acc * 0.5, "I": acc, "Q": acc}  # noqa: E731
        shapes, dtypes, outs = [(1, n)], [dtype], {"D": jnp.bfloat16, "Y": jnp.float32, "I": jnp.int32,
                                                   "Q": jnp.int8}
    elif name == "f32_tile":
        fn = lambda acc, c: jnp.maximum(acc, c) * c  # noqa: E731
        shapes, dtypes, outs = [(m, n)], [jnp.float32], jnp.float32
    elif name == "bias_silu":
        fn = lambda acc, bias: jax.nn.silu(acc + bias)  # noqa: E731
        shapes, dtypes, outs = [(1, n)], [dtype], dtype
    elif name == "bias_gelu":
        fn = lambda acc, bias: jax.nn.gelu(acc + bias)  # noqa: E731
        shapes, dtypes, outs = [(1, n)], [dtype], out_dtype
    elif name == "bias_gelu_colsum":  # a layer's output and its column sums (a bias gradient's shape)
        def fn(acc, bias):
            y = jax.nn.gelu(acc + bias)
            return y, jnp.sum(y, axis=-2)
        shapes, dtypes, outs = [(1, n)], [dtype], (out_dtype, jnp.float32)
    elif name == "row_stats":  # a row max and a row sum of squares (a softmax's, a norm's)
        fn = lambda acc: (acc, jnp.max(acc, axis=-1), jnp.sum(acc * acc, axis=-1))  # noqa: E731
        shapes, dtypes, outs = [], [], (out_dtype, jnp.float32, jnp.float32)
    elif name == "softmax_norm":  # a row softmax and a row-normalised output: two passes over the tile
        def fn(acc, bias, *, scale):
            y = acc * scale + bias
            return jax.nn.softmax(y, axis=-1), y / jnp.linalg.norm(y, axis=-1, keepdims=True), jnp.sum(y, axis=-1)
        shapes, dtypes, outs = [(1, n)], [dtype], (out_dtype, out_dtype, jnp.float32)
    elif name == "amax":  # an output and its amax, the next FP8 scale's input
        fn = lambda acc, bias: (acc + bias, jnp.max(jnp.abs(acc + bias)))  # noqa: E731
        shapes, dtypes, outs = [(1, n)], [dtype], (out_dtype, jnp.float32)
    elif name == "scaled_amax":  # 8-bit: per-tensor scales, an fp8 output and its amax
        def fn(acc, *, scale):
            y = acc * scale
            return y, jnp.max(jnp.abs(y))
        shapes, dtypes, outs = [], [], (jnp.float8_e4m3fn, jnp.float32)
    elif name == "all_reductions":  # every kind over every axis, per batch
        def fn(acc, bias):
            y = acc + bias
            return (y, jnp.sum(y, axis=-2), jnp.min(y, axis=-1), jnp.max(y, axis=(-2, -1)))
        shapes, dtypes, outs = [(1, n)], [dtype], (out_dtype,) + (jnp.float32,) * 3
    elif name == "masked":  # written over c only where the mask (from acc) holds
        fn = lambda acc, c, bias: jnp.where(acc + bias > 0, acc + bias, c)  # noqa: E731
        shapes, dtypes, outs = [acc_shape, (1, n)], [out_dtype, dtype], out_dtype
    elif name == "masked_operand":  # where a mask operand is zero (a negated mask), beside a second output
        fn = lambda acc, c, keep: {"D": jnp.where(keep != 0, c, acc * 0.5), "Y": acc}  # noqa: E731
        shapes, dtypes, outs = [acc_shape, acc_shape], [out_dtype, dtype], {"D": out_dtype, "Y": dtype}
    elif name == "fp8_grad_pass":  # fp8_dense's output-gradient pass: e5m2 twice, its amax and column sums
        from jax_efc import activations, fp8
        fn = fp8._gradient_epilogue(activations.resolve("gelu_tanh"), True, True)
        shapes, dtypes, outs = [acc_shape, acc_shape], [dtype, dtype], (jnp.float8_e5m2,) * 2 + (jnp.float32,) * 2
    elif name == "mlp_gated_bwd":  # fused_mlp's gated derivative and its two bias gradients
        from jax_efc import mlp
        fn = mlp._backward_epilogue(jax.nn.silu, True, True, (True, True))
        shapes, dtypes, outs = [acc_shape, (1, n), acc_shape], [dtype] * 3, (dtype, dtype, jnp.float32, jnp.float32)
    elif name == "mlp_gelu_bwd":  # fused_mlp's GELU derivative and its bias gradient
        from jax_efc import mlp
        fn = mlp._backward_epilogue(jax.nn.gelu, True, False, (True,))
        shapes, dtypes, outs = [acc_shape, (1, n)], [dtype] * 2, (dtype, jnp.float32)
    elif name == "swiglu":  # gated: the gate's and the up projection's biases
        fn = lambda g, u, bg, bu: jax.nn.silu(g + bg) * (u + bu)  # noqa: E731
        shapes, dtypes, outs = [(1, n), (1, n)], [dtype, dtype], out_dtype
    elif name == "geglu_tile":  # gated: a TILE operand, and the gate's accumulator kept
        fn = lambda g, u, c: {"D": jax.nn.gelu(g) * u + c, "G": g}  # noqa: E731
        shapes, dtypes, outs = [acc_shape], [dtype], {"D": out_dtype, "G": dtype}
    else:  # tile + row + col + scalar operands, three outputs of three dtypes
        def fn(acc, c, bias, col, s, *, alpha):
            y = acc * alpha + c * s + bias
            return {"D": jax.nn.gelu(y) * col, "Y": jnp.where(y > 0, y, 0.0), "Z": jnp.tanh(y)}
        shapes = [acc_shape, (batch, 1, n) if batch else (1, n), (m, 1), (batch, 1, 1) if batch else ()]
        dtypes = [dtype, jnp.float32, dtype, jnp.float32]
        outs = {"D": out_dtype, "Y": jnp.float32, "Z": jnp.float16}
    static = {"multi": {"alpha": 2.0}, "scaled_amax": {"scale": 0.25}, "fp8_grad_pass": {"inv_scale": 0.5},
              "softmax_norm": {"scale": 0.125}}.get(name, {})
    ir, *_ = trace_epilogue(fn, acc_shape, shapes, dtypes, static, {}, outs, out_dtype, gated=gated)
    if name.startswith("masked"):  # the first output over operand 0
        ir = with_masked_stores(ir.with_outputs([dataclasses.replace(o, inplace=0 if k == 0 else None)
                                                 for k, o in enumerate(ir.outputs)]))
        assert ir.outputs[0].mask is not None
    if transposed:
        ir = ir.with_outputs([dataclasses.replace(o, transposed=o.name in transposed.split(",")) for o in ir.outputs])
    split = split_at_reductions(ir, rows_in_tile(ir, n))
    assert None not in split.direct  # every reduction is one the GEMM computes
    gemm = split.gemm.with_outputs([dataclasses.replace(o, atomic=atomic and bool(o.reduce))
                                    for o in split.gemm.outputs])
    return gemm, [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]


def _compile_all(dump_dir: str, variants: dict, arch: str = "sm_90a") -> dict:
    """Child process: export every variant for ``arch``, return {name: {"custom_call": bool,
    "ptx": text, ...}}."""
    import jax
    import jax.numpy as jnp
    from cutlass.jax import get_export_disabled_safety_checks

    import jax_efc.ffi as F
    import jax_efc.plan as P
    results = {}
    for i, (name, (dt, ta, tb, batch, cfg, epi, *mnk)) in enumerate(variants.items()):
        dtype, b_dtype = (jnp.dtype(d) for d in (dt.split("+") * 2)[:2])
        m, n, k = mnk[0] if mnk else (128 * (i + 2) + 8, 512, 256)
        ir, ops = _epilogue(epi, m, n, batch, dtype)
        a_shape = (k, m) if ta else (m, k)
        b_shape = (n, k) if tb else (k, n)
        a = jax.ShapeDtypeStruct(a_shape if batch is None else (batch, *a_shape), dtype)
        b = jax.ShapeDtypeStruct(b_shape, b_dtype)  # B shared across the batch
        kw = dict(transpose_a=ta, transpose_b=tb, acc_dtype=_acc_dtype(cfg), config=_config(cfg),
                  arch=arch, precision=_precision(cfg))
        plan = P.plan_kernel(ir, a, b, ops, **kw)
        if plan.reason:
            results[name] = {"error": plan.reason}
            continue
        before = set(os.listdir(dump_dir))
        kernels_before = set(F._KERNELS)
        exported = jax.export.export(
            jax.jit(lambda a, b, *ops: F.fused_gemm(a, b, *ops, plan=plan)),
            platforms=["cuda"],
            disabled_checks=get_export_disabled_safety_checks(),
        )(a, b, *ops)
        new = [f for f in set(os.listdir(dump_dir)) - before if f.endswith(".ptx")]
        ptx = "".join(open(os.path.join(dump_dir, f)).read() for f in new)
        results[name] = {
            "custom_call": "stablehlo.custom_call @CuteDSLRT" in exported.mlir_module(),
            "out_shapes": [list(x.shape) for x in exported.out_avals],
            "ptx": ptx,
            "stream_k": any(F._KERNELS[key].schedule.stream_k for key in set(F._KERNELS) - kernels_before),
            # the CTA's last tile stages its outputs in the A/B ring
            "ring_outputs": any(F._KERNELS[key].ring_out_slots is not None for key in set(F._KERNELS) - kernels_before),
        }
    return results


def compile_variants(tmp_path_factory, which: str, arch: str = "sm_90a", unverified: bool | None = None) -> dict:
    """Compile ``VARIANTS`` ("standard"), ``LOW_PRECISION_VARIANTS`` ("low_precision"),
    ``REDUCTION_VARIANTS`` ("reductions"), or another test module's ("module.NAME"), for
    ``arch`` in a child process; ``unverified``: with JAX_EFC_UNVERIFIED_KERNELS=1 (default:
    for the reductions)."""
    pytest.importorskip("cutlass.jax")
    dump = tmp_path_factory.mktemp("ptx")
    out = dump / "results.json"
    unverified = which == "reductions" if unverified is None else unverified
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump),
               JAX_PLATFORMS="cpu", JAX_EFC_UNVERIFIED_KERNELS="1" if unverified else "0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.path.dirname(__file__), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, str(dump), str(out), which, arch], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "standard")


def test_sigmoid_uses_the_hardware_reciprocal(compiled):
    ptx = compiled["bf16_bias_silu_128x256"]["ptx"]
    assert "rcp.approx" in ptx and "ex2.approx" in ptx and "div.rn" not in ptx


def test_assumed_max_clusters():
    from jax_efc.kernels.sm90_policy import POLICY

    # clusters of 1 and 2 fill the 132 SMs (as the driver of an H200 answers); of 4, leave a
    # margin for the SMs that GPCs strand (30 fit on an H200)
    assert [POLICY.assumed_max_clusters(c, 132) for c in (1, 2, 4)] == [132, 66, 29]


def test_gelu_tanh_is_rewritten(compiled):
    # jax.nn.gelu's tanh form runs as h + h*tanh(x*(a + b*x^2)) (kernels/rewrite.py): three fp32
    # multiplies per tanh, where its own form takes five
    ptx = compiled["bf16_bias_gelu_epi64_c2x1"]["ptx"]
    tanhs = len(re.findall(r"\btanh\.approx\.f32\s", ptx))
    assert tanhs > 0 and len(re.findall(r"\bmul\.f32\s", ptx)) == 3 * tanhs


def test_tiles_use_their_wgmma_shapes(compiled):
    # a 192x128 consumer issues three m64n128 WGMMAs per k-step, a 128x192 one two m64n192
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in compiled["bf16_pingpong_192x128_c1x2_swizzle8"]["ptx"]
    for name in ("fp16_pingpong_alpha_beta_128x192_mk", "bf16_pingpong_128x192_c2x1_raster_n_mk",
                 "bf16_pingpong_bias_gelu_128x192_c2x1_raster_n",
                 "bf16_pingpong_alpha_beta_128x192_epi64x16_c2x1_nk"):
        assert "wgmma.mma_async.sync.aligned.m64n192k16" in compiled[name]["ptx"]
    # cooperative 256x128: each of the two warpgroups issues two m64n128 per k-step
    ptx = compiled["bf16_256x128_c1x2_swizzle8"]["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in ptx and "m64n256k16" not in ptx


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_to_wgmma(compiled, name):
    check_variant(compiled[name], VARIANTS[name])


def check_variant(result: dict, variant: tuple, stream_k: bool | None = None) -> None:
    """What every variant's export and PTX must hold: the custom call, WGMMA, TMA loads and
    stores, the programmatic-dependent-launch wait first, L1 prefetches of vector operands,
    smem-staged TILE operands, stream-K's handover, paced ping-pong epilogues, multicast.
    ``stream_k``: whether the variant splits k (default: whether it names its own shape)."""
    assert "error" not in result, result.get("error")
    assert result["custom_call"]
    ptx = result["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx  # TMA loads into the pipeline
    assert ".bulk_group" in ptx  # TMA stores of the epilogue
    # launched as a programmatic dependent: every thread waits for the previous kernel before
    # its first global access (the PTX keeps program order here: the wait precedes them all)
    wait = ptx.find("griddepcontrol.wait;")
    assert 0 <= wait < ptx.find("cp.async.bulk.tensor") and "griddepcontrol.launch_dependents;" in ptx
    assert all(wait < i for i in (ptx.find(op) for op in ("ld.global", "st.global", "prefetch.global")) if i >= 0)
    epilogue = variant[5].partition("/")[0].removesuffix("+atomic").rpartition(":")[2]  # ("gatedB:NAME": NAME)
    # each tile's slice of a ROW/COL vector is prefetched into L1 ahead of its epilogue
    assert ("prefetch.global.L1" in ptx) == (epilogue in ("bias_gelu", "bias_silu", "multi", "int_multi",
                                                         "bias_gelu_colsum", "amax", "all_reductions",
                                                         "swiglu", "softmax_norm", "mlp_gated_bwd",
                                                         "mlp_gelu_bwd"))
    if epilogue in ("alpha_beta", "f32_tile", "multi", "geglu_tile", "mlp_gated_bwd", "mlp_gelu_bwd"):
        # TILE operands are TMA-loaded into smem and read from there (16-bit ones by
        # ldmatrix), not gathered from global memory ("multi" and "mlp_gated_bwd" still gather
        # their row/column vectors)
        assert ("ld.shared" if epilogue == "f32_tile" else "ldmatrix") in ptx
        assert "ld.global" not in ptx.replace("ld.global.v4.b32", "") or epilogue in ("multi", "mlp_gated_bwd",
                                                                                      "mlp_gelu_bwd")
    # stream-K pieces hand fp32 partials over through global memory, 16 bytes per access,
    # behind a release fence and an acquire load of the flag; whole-tile schedules have none
    assert result["stream_k"] == (len(variant) > 6 if stream_k is None else stream_k)
    handover = ("ld.acquire.gpu", "fence.acq_rel.gpu", "st.global.v4.b32", "ld.global.v4.b32")
    assert all((h in ptx) == result["stream_k"] for h in handover)
    cfg = variant[4]
    # ping-pong epilogues with arithmetic run paced under the other consumer's WGMMAs (all but
    # a CTA's last): their values tied into chains by a lop3 with a zero read from the dynamic
    # smem size; stream-K kernels, cooperative ones and tiles of 192 accumulators a thread run
    # theirs dense
    ties = len(re.findall(r"\blop3\.b32(?:\s+%\w+,){4}\s*0xF8;", ptx))
    paced = (len(cfg) > 4 and cfg[4].get("pingpong", False) and epilogue != "identity"
             and not result["stream_k"] and cfg[0] * cfg[1] <= 128 * 128)
    assert (ties > 0) == paced and ("%dynamic_smem_size" in ptx) == paced
    if cfg[2] * cfg[3] > 1:
        assert "multicast::cluster" in ptx
    if len(cfg) > 4 and cfg[4].get("pingpong"):
        # the consumers take turns through 256-thread named barriers (both consumer
        # warpgroups): each waits on its own (bar.sync id, 256) and opens the other's
        # (bar.arrive id, 256); their epilogues sync on 128-thread ones
        assert re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\S+,\s*256;", ptx)
        assert re.search(r"\bbar(?:rier)?\.arrive(?:\.aligned)?\s+\S+,\s*256;", ptx)
        assert re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\S+,\s*128;", ptx)
        assert "setmaxnreg" in ptx


# Local-memory spills ptxas reports today for pinned variants that are not the heuristic's
# choices (bytes stored, bytes loaded): the bound is today's; every other variant spills none.
_KNOWN_SPILLS = {
    "fp16_pingpong_alpha_beta_128x192_mk": (20, 20),
    "fp16_256x192_mk": (4, 4),
    "fp16_pingpong_bias_gelu_192x128_epi64x64": (376, 448),
    "bf16_pingpong_multi_c1x2": (376, 420),
    # two row reductions on a pinned 128x192 ping-pong stream-K tile in 128-row subtiles: a
    # thread's four rows each keep a running value, and an edge subtile's column masks
    "bf16_pingpong_row_stats_128x192_c2x1_stream_k": (16, 16),
}


def _ptxas() -> str:
    """The ptxas of the nvidia-cuda-nvcc wheel (the [test] extra), else one on PATH."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "cu13", "bin", "ptxas")
        if os.path.exists(path):
            return path
    path = shutil.which("ptxas")
    assert path, "ptxas not found: install the [test] extra (nvidia-cuda-nvcc)"
    return path


def assemble_all(compiled: dict, folder, arch: str = "sm_90a") -> dict:
    """{variant: ptxas -v output} for every variant's PTX, assembled for ``arch`` in parallel."""
    import concurrent.futures

    ptxas = _ptxas()

    def assemble(name: str) -> str:
        ptx = folder / f"{name}.ptx"
        ptx.write_text(compiled[name]["ptx"])
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        return proc.stdout + proc.stderr

    names = [name for name, result in compiled.items() if "error" not in result]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(assemble, names)))


def check_spills(assembled: dict, max_registers: int = 232) -> None:
    """ptxas's report per variant: no local-memory spills (beyond the known ones of a few
    pinned variants, which must not grow), and every kernel within ``max_registers`` a thread
    (Hopper: the 232 setmaxnreg hands the consumers)."""
    for name, report in assembled.items():
        (stores, loads), = [tuple(map(int, m)) for m in
                            re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
        allowed = _KNOWN_SPILLS.get(name, (0, 0))
        assert stores <= allowed[0] and loads <= allowed[1], (name, stores, loads)
        registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
        assert registers and max(registers) <= max_registers, (name, registers)


def test_variants_do_not_spill_and_fit_the_register_budget(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


def test_output_shapes(compiled):
    assert compiled["bf16_batched_64x128"]["out_shapes"] == [[3, 128 * 6 + 8, 512]]
    assert len(compiled["bf16_multi_batched_c2x1"]["out_shapes"]) == 3


def _aval(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(k=1001), "K=1001"),
        (dict(n=1001), "N=1001"),
        (dict(dtype="float64"), "A/B dtype float64 is not supported"),
        (dict(config=(32, 128, 1, 1)), "tile_m=32"),
        (dict(config=(256, 128, 1, 1, {"pingpong": True})), "tile_m=256 needs pingpong=False"),
        (dict(config=(256, 256, 1, 1)), "cooperative 256x256 tile"),
        (dict(config=(128, 96, 1, 1)), "tile_n=96"),
        (dict(config=(128, 128, 4, 2)), "at most 4"),
        (dict(config=(128, 256, 1, 1, {"pingpong": True})), "pingpong=True with a 128x256 tile"),
        (dict(config=(192, 192, 1, 1, {"pingpong": True})), "pingpong=True with a 192x192 tile"),
        (dict(config=(192, 128, 1, 1)), "tile_m=192 needs pingpong=True"),
        (dict(config=(128, 128, 1, 1, {"epi_m": 64})), "span the rows of all 2 warpgroups"),
        (dict(arch="sm_80"), "sm_80"),
    ],
)
def test_unsupported_reasons(change, needle):
    pytest.importorskip("cutlass.jax")
    import jax.numpy as jnp

    import jax_efc.plan as P
    from jax_efc.tracing import trace_epilogue

    m, n, k = change.get("m", 256), change.get("n", 512), change.get("k", 256)
    dtype = jnp.dtype(change.get("dtype", "bfloat16"))
    ir, *_ = trace_epilogue(lambda acc: acc, (m, n), [], [], {}, {}, jnp.bfloat16, jnp.bfloat16)
    reason = P.plan_kernel(
        ir, _aval((m, k), dtype), _aval((k, n), dtype), [], transpose_a=False, transpose_b=False,
        acc_dtype=jnp.float32, config=_config(change.get("config", (128, 128, 1, 1))),
        arch=change.get("arch", "sm_90a"),
    ).reason
    assert reason is not None and needle in reason, reason


def test_8bit_kernels_read_a_and_b_k_major_and_promote_unless_fast():
    """8-bit inputs: a B stored (K, N) is transposed once, K-major, before the kernel, and the
    plan says so. 8-bit float partial sums are promoted into fp32 unless precision asks for
    fast accumulation; promotion holds two accumulators an element, which wide tiles cannot."""
    pytest.importorskip("cutlass.jax")
    import jax
    import jax.numpy as jnp

    import jax_efc.plan as P
    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir

    ir = identity_ir(jnp.bfloat16)
    a, b_kn, b_nk = (_aval(s, jnp.float8_e4m3fn) for s in ((1024, 512), (512, 1024), (1024, 512)))
    fast = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM

    def plan(b, transpose_b, config=None, precision=None, a=a):
        return P.plan_kernel(ir, a, b, [], transpose_a=False, transpose_b=transpose_b, acc_dtype=jnp.float32,
                             config=config, arch="sm_90a", precision=precision)

    assert plan(b_nk, True).backend == "kernel" and plan(b_nk, True).problem.tile_k == 128
    assert plan(b_nk, True).transposes == (False, False) and plan(b_nk, True).note is None
    moved = plan(b_kn, False)
    assert moved.backend == "kernel" and moved.transposes == (False, True) and moved.problem.b_major == "k"
    # partial sums promoted every second k-tile by default, each k-tile at HIGHEST, or not at all
    # (fast accumulation)
    highest = (jax.lax.Precision.HIGHEST, (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST),
               jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32)
    assert plan(b_nk, True).problem.promote == 2
    assert plan(b_nk, True, precision=jax.lax.Precision.DEFAULT).problem.promote == 2
    assert all(plan(b_nk, True, precision=p).problem.promote == 1 for p in highest)
    assert plan(b_nk, True, precision=fast).problem.promote == 0
    wide = GemmConfig(128, 256)
    assert "two accumulators an element, 256 registers a thread" in plan(b_nk, True, wide).reason
    assert plan(b_nk, True, wide, fast).backend == "kernel"
    # the heuristic's tiles fit promotion: cooperative, at most 96 columns a warpgroup
    for m, n in ((8192, 8192), (8192, 14336), (1024, 512)):
        cfg = plan(_aval((n, 512), jnp.float8_e4m3fn), True, a=_aval((m, 512), jnp.float8_e4m3fn)).problem.config
        assert not cfg.pingpong and cfg.tile_m == 128 and cfg.tile_n in (128, 192), (m, n, cfg)
    # 128x192 unless it pads N over 4% more than 128x128 (4096: 3% more; 776: 19% against 13%),
    # however its tiles fill the SMs' rounds
    for n, tile_n in ((4096, 192), (14336, 192), (776, 128), (320, 192), (256, 128)):
        b = _aval((n, 512), jnp.float8_e4m3fn)
        assert plan(b, True, a=_aval((4096, 512), jnp.float8_e4m3fn)).problem.config.tile_n == tile_n, n
    # beside the two accumulator sets of 192 columns a transposed store spilled: 128x128 tiles
    a_big, b_big = _aval((8192, 512), jnp.float8_e4m3fn), _aval((14336, 512), jnp.float8_e4m3fn)
    assert plan(b_big, True, a=a_big).problem.config.tile_n == 192
    ir = ir.with_outputs([dataclasses.replace(o, transposed=True) for o in ir.outputs])
    assert plan(b_big, True, a=a_big).problem.config.tile_n == 128
    # presets asking for other arithmetic run on the reference; 16-bit inputs never promote
    x3 = plan(b_nk, True, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)
    assert x3.backend == "reference" and "BF16_BF16_F32_X3" in x3.reason
    bf16 = _aval((1024, 512), jnp.bfloat16)
    assert plan(bf16, True, a=bf16).problem.promote == 0
    assert plan(bf16, True, precision=jax.lax.Precision.HIGHEST, a=bf16).problem.promote == 0


def test_a_policy_says_what_has_not_run_on_its_gpus():
    """A policy names what of a kernel compiles but has not run on a GPU of its architecture (an
    input or accumulator type, epilogue reductions): what the plan has checked on first use."""
    import dataclasses

    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir
    from jax_efc.kernels.problem import KernelProblem
    from jax_efc.kernels.sm90_policy import Sm90Policy

    class Held(Sm90Policy):
        unverified_ab_dtypes = ("float8_e4m3fn",)
        unverified_acc_dtypes = ("float16",)

    problem = KernelProblem(identity_ir(jnp.bfloat16), "float8_e4m3fn", "float32", "k", "k", False, False, False,
                            (), "sm_90a", GemmConfig())
    assert Held().unverified_reason(problem) == "the sm_90a kernel with float8_e4m3fn inputs"
    f16 = dataclasses.replace(problem, ab_dtype="float16", b_dtype="float16", acc_dtype="float16", b_major="n")
    assert Held().unverified_reason(f16) == "the sm_90a kernel with float16 accumulation"
    assert Held().unsupported_reason(problem) is None and Held().unsupported_reason(f16) is None
    bf16 = dataclasses.replace(problem, ab_dtype="bfloat16", b_dtype="bfloat16", b_major="n")
    assert Sm90Policy().unverified_reason(bf16) is None


def test_too_few_stages_names_the_subtiles_that_fit():
    # four fp32 outputs and three TILE operands crowd the A/B ring out of a cooperative
    # 256x192 tile; the error names the subtiles to pin, and pinning them is accepted
    pytest.importorskip("cutlass.jax")
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.tracing import trace_epilogue
    from jax_efc.kernels import KernelProblem
    from jax_efc.kernels.sm90_policy import POLICY

    def fn(acc, c, x, w):
        return {"D": acc + c, "Y": acc * x, "Z": acc * w, "W": acc}

    ir, *_ = trace_epilogue(fn, (4096, 4096), [(4096, 4096)] * 3, [jnp.bfloat16] * 3, {}, {},
                            jnp.float32, jnp.bfloat16)

    def reason(cfg):
        return POLICY.unsupported_reason(KernelProblem(ir, "bfloat16", "float32", "k", "n", False, False,
                                                False, (False,) * 3, "sm_90a", cfg))

    message = reason(GemmConfig(tile_m=256, tile_n=192))
    assert message is not None and "4 outputs and 3 tile operands" in message, message
    assert "(epi_m=128, epi_n=16)" in message
    assert reason(GemmConfig(tile_m=256, tile_n=192, epi_m=128, epi_n=16)) is None


@pytest.mark.parametrize("epilogue, dtype, cfg, mnk, fits, outputs_fit", [
    # 2 operands x 8 subtiles of 4 KiB, eight a stage (16 KiB of A's, 16 KiB of B's): two
    # stages, then the outputs' two of the ring's six
    ("alpha_beta", "bfloat16", (128, 128, 1, 2, {"pingpong": True, "epi_n": 16}), (2048, 4096, 4096),
     True, True),
    # the same in 64x32 subtiles
    ("alpha_beta", "bfloat16", (128, 128, 1, 2, {"pingpong": True, "epi_m": 64}), (2048, 4096, 4096),
     True, True),
    # 16 subtiles of 8 KiB, six a stage (16 KiB of A's, 32 KiB of B's): three stages; no room
    # for the outputs' three more
    ("alpha_beta", "bfloat16", (128, 256, 1, 1), (1000, 4096, 4096), True, False),
    # fp32: 4 subtiles of 16 KiB, two a stage, then the fp32 output's two stages
    ("f32_tile", "float16", (128, 128, 1, 1), (1024, 1024, 512), True, True),
    # fp32: subtiles of 32 KiB, more than a stage's 16 KiB of A's or 24 KiB of B's
    ("f32_tile", "float16", (128, 192, 1, 1, {"epi_n": 64}), (1024, 1536, 512), False, False),
    ("bias_gelu", "bfloat16", (128, 128, 1, 2, {"pingpong": True}), (2048, 4096, 4096), False, False),
    # stream-K: the last units take the split epilogue
    ("alpha_beta", "bfloat16", (128, 256, 2, 1, {"swizzle": 8}), (8192, 7936, 8192), False, False),
])
def test_last_tile_ring_slots(epilogue, dtype, cfg, mnk, fits, outputs_fit):
    """The CTA's last tile takes its TILE-operand subtiles through the ring stages past its
    last k-tile, in subtile order, and stages its output subtiles in the stages after those
    where they fit too: one 1 KiB-aligned slot each, inside A's or B's share of a stage,
    none overlapping; each operand stage expects the bytes of the subtiles placed in it."""
    pytest.importorskip("cutlass.jax")
    import jax.numpy as jnp

    from jax_efc.kernels import KernelProblem
    from jax_efc.kernels.schedule import plan_schedule
    from jax_efc.kernels.sm90_policy import pipeline_stages
    from jax_efc.kernels.sm90 import Sm90FusedGemm

    m, n, k = mnk
    ir, ops = _epilogue(epilogue, m, n, None, jnp.dtype(dtype))
    problem = KernelProblem(ir, dtype, "float32", "k", "n", False, False, False, (False,) * len(ops),
                            "sm_90a", _config(cfg))
    clusters = 132 // (problem.config.cluster_m * problem.config.cluster_n)
    kernel = Sm90FusedGemm(problem, plan_schedule(problem.config, m, n, k, 1, clusters, problem.tile_k))
    if not fits:
        assert kernel.ring_slots is None and kernel.ring_out_slots is None
        return
    assert (kernel.ring_out_slots is not None) == outputs_fit
    config, stages = problem.config, pipeline_stages(problem)
    room = [config.tile_m * 64 * 2, config.tile_n * 64 * 2]
    epi_m = config.epi_m or config.tile_m
    n_sub = config.tile_m // epi_m * config.tile_n // config.epi_n
    operand_stages = len(kernel.ring_stage_bytes)
    spans, stage_bytes = [], [0] * operand_stages

    def check(dtypes, slots, first, end):
        assert len(slots) == len(dtypes)
        for dtype, per_subtile in zip(dtypes, slots):
            assert len(per_subtile) == n_sub
            assert [slot[0] for slot in per_subtile] == sorted(slot[0] for slot in per_subtile)
            size = epi_m * config.epi_n * jnp.dtype(dtype).itemsize
            for stage, part, offset in per_subtile:
                assert first <= stage < end and offset % 1024 == 0 and offset + size <= room[part]
                spans.append((stage, part, offset, offset + size))
                if stage < operand_stages:
                    stage_bytes[stage] += size

    check([o.dtype for o in ops if len(o.shape) == 2], kernel.ring_slots, 0, operand_stages)
    if outputs_fit:
        check([o.dtype for o in ir.outputs], kernel.ring_out_slots, operand_stages, stages)
    assert tuple(stage_bytes) == kernel.ring_stage_bytes
    spans.sort()
    assert all(a[:2] != b[:2] or a[3] <= b[2] for a, b in zip(spans, spans[1:]))


def _export_for_cuda(fn, *specs):
    import jax
    from cutlass.jax import get_export_disabled_safety_checks

    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=get_export_disabled_safety_checks())(*specs)


def test_pinned_config_the_kernel_refuses_is_an_error(monkeypatch):
    """A pinned config that alone keeps the kernel from running raises at compile time for
    the device; a call the kernel refuses for another reason still falls back."""
    pytest.importorskip("cutlass.jax")
    import jax.numpy as jnp

    import jax_efc as efc
    from jax_efc.config import GemmConfig

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cooperative_192 = GemmConfig(192, 128)
    ab = [_aval((256, 256), jnp.bfloat16)] * 2
    with pytest.raises(ValueError, match=r"cannot run GemmConfig\(tile_m=192.*tile_m=192 needs pingpong=True"
                                         r".*config=None"):
        _export_for_cuda(lambda a, b: efc.gemm(a, b, config=cooperative_192), *ab)
    # K = 1001 is not 16-byte aligned: no config would run, so the reference runs
    odd = [_aval((256, 1001), jnp.bfloat16), _aval((1001, 256), jnp.bfloat16)]
    exported = _export_for_cuda(lambda a, b: efc.gemm(a, b, config=cooperative_192), *odd)
    assert "CuteDSLRT" not in exported.mlir_module()


def test_supported_and_heuristic():
    pytest.importorskip("cutlass.jax")
    import jax.numpy as jnp

    import jax_efc.plan as P
    from jax_efc.config import GemmConfig
    from jax_efc.tracing import trace_epilogue
    from jax_efc.kernels import KernelProblem
    from jax_efc.kernels.sm90_policy import POLICY

    choose_config = POLICY.choose_config

    ir, *_ = trace_epilogue(lambda acc: acc, (8192, 8192), [], [], {}, {}, jnp.bfloat16, jnp.bfloat16)
    a = _aval((8192, 8192), jnp.bfloat16)
    assert P.plan_kernel(ir, a, a, [], transpose_a=False, transpose_b=False,
                         acc_dtype=jnp.float32, config=None, arch="sm_90a").backend == "kernel"
    problem = KernelProblem(ir, "bfloat16", "float32", "k", "n", False, False, False, (), "sm_90a",
                            GemmConfig())
    # large problems: ping-pong in 1x2 clusters, 192x128 tiles unless they fill the SMs'
    # rounds worse than 128x128; smaller ones: cooperative. A plain GEMM takes 128x192 tiles
    # in 2x1 clusters along N where those fill the rounds as well
    cfg = choose_config(problem, 8192, 8192, 8192, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.raster, cfg.pingpong) == \
        (128, 192, 2, 1, "n", True)
    for mnk in ((16384, 14336, 4096), (4096, 28672, 8192), (3000, 6152, 1032)):  # the last as the GPU test
        assert choose_config(problem, *mnk, 1) == cfg
    transposed = dataclasses.replace(problem, a_major="m", b_major="k")
    assert choose_config(transposed, 3000, 6152, 1032, 1) == cfg
    cfg = choose_config(problem, 4096, 14336, 4096, 1)  # 2400 tiles of 128x192: 18.2 per SM
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (128, 128, 1, 2, True)
    cfg = choose_config(problem, 8192, 4096, 4096, 1)  # 1376 tiles of 192x128: 10.4 per SM
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (128, 128, 1, 2, True)
    # 256 tiles of 128x128 on 132 SMs: ping-pong with K = 4096; a long K keeps one wave of
    # 128 cooperative 128x256 tiles
    cfg = choose_config(problem, 1000, 4096, 4096, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n, cfg.pingpong) == (128, 128, 2, True)
    cfg = choose_config(problem, 1000, 4096, 14336, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) == (128, 256, False)
    assert not choose_config(problem, 1000, 3584, 4096, 1).pingpong  # 224 tiles: 1.7 per SM
    cfg = choose_config(problem, 1000, 2048, 4096, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) == (128, 128, False)
    # 192 tiles of 128x128: under two waves of 132 SMs, over two of 78
    assert not choose_config(problem, 1000, 3072, 4096, 1).pingpong
    assert choose_config(problem, 1000, 3072, 4096, 1, sm_count=78).pingpong
    cfg = choose_config(problem, 512, 16384, 4096, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) == (128, 256, False)
    assert not choose_config(problem, 8192, 128, 8192, 1).pingpong  # one N tile: no 1x2 cluster
    # a long K: cooperative 128x256 tiles in 2x1 clusters where they fill the SMs as well
    cfg = choose_config(problem, 8192, 4096, 14336, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (128, 256, 2, 1, False)
    assert choose_config(problem, 16384, 4096, 14336, 1).tile_m == 192  # 192x128 fills better
    assert choose_config(problem, 8192, 4096, 8192, 1).pingpong  # K not long enough
    # A stored (K, M), a weight gradient's: a long K from 8192
    for mnk in ((4096, 14336, 8192), (14336, 4096, 8192), (4096, 4096, 8192)):
        cfg = choose_config(transposed, *mnk, 1)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (128, 256, 2, 1, False), mnk
    # below it, ping-pong tiles 192 along the longer side, which read it faster than 128x128
    # (K-major A keeps 128x128 at 4096x14336x4096, above; at 4096^3 192-wide tiles fill too little)
    for mnk, tile in (((14336, 4096, 4096), (192, 128, 1, 2)), ((4096, 14336, 4096), (128, 192, 2, 1))):
        cfg = choose_config(transposed, *mnk, 1)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (*tile, True), mnk
    cfg = choose_config(transposed, 4096, 4096, 4096, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) == (128, 128, True)

    # an fp32 output leaves 128x192 tiles 4 stages in 128x32 subtiles, 5 in 64x32 ones; at
    # 4096^3 128x128 tiles fill the SMs' rounds better
    f32, *_ = trace_epilogue(lambda acc: acc, (8192, 8192), [], [], {}, {}, jnp.float32, jnp.bfloat16)
    for ab in ("bfloat16", "float32"):  # TF32 reads B K-major
        p_f32 = dataclasses.replace(problem, ir=f32, ab_dtype=ab, b_dtype=ab, b_major="k" if ab == "float32" else "n")
        cfg = choose_config(p_f32, 8192, 8192, 8192, 1)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.epi_m, cfg.epi_n, cfg.pingpong) == (128, 192, 2, 64, 32, True)
        cfg = choose_config(p_f32, 4096, 4096, 4096, 1)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n, cfg.pingpong) == (128, 128, 2, True)

    # a cooperative epilogue with work gets 64-wide subtiles; four epilogue buffers (two
    # TILE operands, two outputs) would leave too few stages at 64, and fp32 outputs too few
    # at 128x256. Epilogues with work keep 192x128 ping-pong tiles in 1x2 clusters where those
    # fill the SMs' rounds as well, else take 128x192 ones in 2x1 clusters along N where
    # those do (in 128x32 subtiles: 64-wide ones would cost a stage), else 128x128
    bias, *_ = trace_epilogue(lambda acc, b: acc + b, (8192, 8192), [(1, 8192)], [jnp.bfloat16], {}, {},
                              jnp.bfloat16, jnp.bfloat16)
    p_bias = dataclasses.replace(problem, ir=bias, operand_batched=(False,))
    cfg = choose_config(p_bias, 8192, 8192, 8192, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (192, 128, 1, 2, True)
    wide = choose_config(p_bias, 4096, 28672, 8192, 1)  # 21.3 tiles of 192 rows down M
    assert (wide.tile_m, wide.tile_n, wide.cluster_m, wide.cluster_n, wide.raster, wide.epi_m, wide.epi_n,
            wide.pingpong) == (128, 192, 2, 1, "n", 0, 32, True)
    for mnk in ((8192, 13824, 4096), (1000, 6152, 1032)):  # the last as the GPU test runs it
        assert choose_config(p_bias, *mnk, 1) == wide
    cfg = choose_config(p_bias, 4096, 14336, 4096, 1)  # 2400 tiles of 128x192: 18.2 per SM
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n, cfg.pingpong) == (128, 128, 2, True)
    # one k-tile: the kernel is its epilogue, and cooperative 128x256 tiles run it fastest; a
    # plain GEMM of one k-tile keeps the usual choice
    cfg = choose_config(p_bias, 8192, 14336, 16, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (128, 256, 1, 1, False)
    assert choose_config(problem, 8192, 14336, 64, 1).pingpong
    # a long K: up to two 16-bit outputs and no TILE operand cost little exposed, so 128x256
    # as for plain; more output bytes or a TILE operand keep ping-pong, which hides them
    cfg = choose_config(p_bias, 8192, 4096, 14336, 1)
    assert (cfg.tile_n, cfg.cluster_m, cfg.epi_n, cfg.pingpong) == (256, 2, 64, False)
    two_out, *_ = trace_epilogue(lambda acc, b: {"D": jnp.maximum(acc + b, 0), "Y": acc + b}, (8192, 4096),
                                 [(1, 4096)], [jnp.bfloat16], {}, {}, jnp.bfloat16, jnp.bfloat16)
    cfg = choose_config(dataclasses.replace(p_bias, ir=two_out), 8192, 4096, 14336, 1)
    assert (cfg.tile_n, cfg.cluster_m, cfg.epi_n, cfg.pingpong) == (256, 2, 64, False)
    wide_out, *_ = trace_epilogue(lambda acc, b: {"D": jnp.maximum(acc + b, 0), "Y": acc + b}, (8192, 4096),
                                  [(1, 4096)], [jnp.bfloat16], {}, {}, {"D": jnp.bfloat16, "Y": jnp.float32},
                                  jnp.bfloat16)
    assert choose_config(dataclasses.replace(p_bias, ir=wide_out), 8192, 4096, 14336, 1).pingpong
    with_c, *_ = trace_epilogue(lambda acc, c: acc + c, (8192, 4096), [(8192, 4096)], [jnp.bfloat16], {}, {},
                                jnp.bfloat16, jnp.bfloat16)
    assert choose_config(dataclasses.replace(p_bias, ir=with_c), 8192, 4096, 14336, 1).pingpong
    # ping-pong 128x128 with one 16-bit output: 64-wide subtiles, which keep its 6 stages
    cfg = choose_config(p_bias, 8192, 4096, 4096, 1)
    assert (cfg.tile_m, cfg.epi_n, cfg.pingpong) == (128, 64, True)
    assert choose_config(problem, 8192, 4096, 4096, 1).epi_n == 32  # no epilogue work
    # 192x128 would lose a stage to 64-wide subtiles
    assert choose_config(p_bias, 8192, 8192, 8192, 1).epi_n == 32
    cfg = choose_config(p_bias, 512, 16384, 8192, 1)
    assert (cfg.tile_n, cfg.epi_n, cfg.pingpong) == (256, 64, False)
    ab, *_ = trace_epilogue(lambda acc, c, x: {"D": acc * 2 + c + x, "Y": acc}, (8192, 8192),
                            [(8192, 8192)] * 2, [jnp.bfloat16] * 2, {}, {},
                            {"D": jnp.bfloat16, "Y": jnp.bfloat16}, jnp.bfloat16)
    p_ab = dataclasses.replace(problem, ir=ab, operand_batched=(False, False))
    from jax_efc.kernels.sm90_policy import pipeline_stages
    # 16-bit: the four buffers leave the ping-pong ring 5 stages at 128x32 subtiles, enough
    # for ping-pong, and 6 at 64x32 ones, which it takes where 128x128 tiles fill the SMs better
    cfg = choose_config(p_ab, 8192, 4096, 4096, 1)
    assert (cfg.tile_m, cfg.tile_n, cfg.epi_m, cfg.epi_n, cfg.pingpong) == (128, 128, 64, 32, True)
    assert pipeline_stages(dataclasses.replace(p_ab, config=cfg)) == 6
    assert pipeline_stages(dataclasses.replace(p_ab, config=dataclasses.replace(cfg, epi_m=0))) == 5
    for mnk in ((2048, 4096, 4096), (1000, 14336, 1032)):  # as the GPU tests run it
        assert choose_config(p_ab, *mnk, 1) == cfg
    # 192x128 tiles leave it 3 stages at 192x32 subtiles, 4 at 64x32 and 5 at 64x16, enough
    tall = choose_config(p_ab, 8192, 8192, 8192, 1)
    assert (tall.tile_m, tall.epi_m, tall.epi_n, tall.pingpong) == (192, 64, 16, True)
    assert [pipeline_stages(dataclasses.replace(p_ab, config=dataclasses.replace(tall, epi_m=em, epi_n=en)))
            for em, en in ((0, 32), (64, 32), (64, 16))] == [3, 4, 5]
    assert choose_config(p_ab, 3000, 4096, 1032, 1) == tall  # as the GPU tests run it
    # 128x192 tiles: 64x16 subtiles too, for 5 stages
    wide = choose_config(p_ab, 1000, 6152, 1032, 1)  # as the GPU test runs it
    assert (wide.tile_m, wide.tile_n, wide.cluster_m, wide.raster, wide.epi_m, wide.epi_n) == \
        (128, 192, 2, "n", 64, 16)
    assert pipeline_stages(dataclasses.replace(p_ab, config=wide)) == 5
    assert choose_config(p_ab, 4096, 28672, 8192, 1) == wide
    ab_f32_y, *_ = trace_epilogue(lambda acc, c, x: {"D": acc * 2 + c + x, "Y": acc}, (1000, 6152),
                                  [(1000, 6152)] * 2, [jnp.bfloat16] * 2, {}, {},
                                  {"D": jnp.bfloat16, "Y": jnp.float32}, jnp.bfloat16)
    assert choose_config(dataclasses.replace(p_ab, ir=ab_f32_y), 1000, 6152, 1032, 1) == wide
    assert choose_config(p_ab, 8192, 4096, 14336, 1).pingpong  # ping-pong hides its epilogue
    cfg = choose_config(p_ab, 512, 16384, 8192, 1)
    assert (cfg.tile_n, cfg.epi_n, cfg.pingpong) == (256, 32, False)
    assert pipeline_stages(dataclasses.replace(p_ab, config=cfg)) == 3
    ab32, *_ = trace_epilogue(lambda acc, c, x: {"D": acc * 2 + c + x, "Y": acc}, (8192, 8192),
                              [(8192, 8192)] * 2, [jnp.bfloat16] * 2, {}, {},
                              {"D": jnp.float32, "Y": jnp.float32}, jnp.bfloat16)
    # fp32 outputs: 4 stages at 128x32 subtiles, but 6 at 64x16, which ping-pong takes
    p_ab32 = dataclasses.replace(p_ab, ir=ab32)
    cfg = choose_config(p_ab32, 8192, 4096, 4096, 1)
    assert (cfg.tile_m, cfg.epi_m, cfg.epi_n, cfg.pingpong) == (128, 64, 16, True)
    assert pipeline_stages(dataclasses.replace(p_ab32, config=cfg)) == 6
    assert pipeline_stages(dataclasses.replace(p_ab32, config=dataclasses.replace(cfg, epi_m=0, epi_n=32))) == 4
    assert choose_config(p_ab32, 2000, 4104, 1032, 1) == cfg  # as the GPU test runs it
    cfg = choose_config(p_ab32, 8192, 8192, 8192, 1)
    assert (cfg.tile_m, cfg.epi_m, cfg.epi_n, cfg.pingpong) == (192, 64, 16, True)


def test_short_or_few_tile_gemms_go_to_xla(monkeypatch):
    """At most 64 rows per B, or 128x128 tiles that fill less than 3/4 of the SMs: the
    heuristic hands the call to XLA's GEMM, saying why; a pinned config or JAX_EFC_STRICT=1
    keeps the kernel."""
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.tracing import trace_epilogue
    from jax_efc.kernels import KernelProblem
    from jax_efc.kernels.sm90_policy import POLICY
    from jax_efc.plan import plan_call

    xla_faster_reason = POLICY.xla_faster_reason

    ir, *_ = trace_epilogue(lambda acc: acc, (8, 8), [], [], {}, {}, jnp.bfloat16, jnp.bfloat16)
    problem = KernelProblem(ir, "bfloat16", "float32", "k", "n", False, False, False, (), "sm_90a",
                            GemmConfig())
    def goes_to_xla(m, n, l=1, p=problem):
        return xla_faster_reason(p, m, n, l, sm_count=132) is not None

    assert goes_to_xla(64, 14336) and goes_to_xla(1, 65536)  # any tile count
    # more rows: only where 128x128 tiles fill less than 3/4 of the SMs (99 of 132)
    assert goes_to_xla(256, 4096) and goes_to_xla(128, 12288)  # 64 and 96 tiles
    assert goes_to_xla(1024, 1024) and goes_to_xla(8192, 128) and goes_to_xla(257, 128)
    assert not goes_to_xla(128, 14336) and not goes_to_xla(256, 14336)  # 112, 224
    assert goes_to_xla(896, 1792) and not goes_to_xla(1152, 1408)  # 98 and 99 tiles
    assert not goes_to_xla(8192, 8192)
    # a B shared across a batch is read once for all its rows; a batched B once per batch
    assert not goes_to_xla(64, 4096, l=8)
    per_batch = dataclasses.replace(problem, batched=True, a_batched=True, b_batched=True)
    assert goes_to_xla(64, 4096, l=8, p=per_batch) and not goes_to_xla(128, 4096, l=8, p=per_batch)
    assert "its 64 tiles of 128x128 would leave 68 of 132 SMs idle" in xla_faster_reason(
        problem, 256, 4096, 1, sm_count=132)
    assert "64 rows share each B" in xla_faster_reason(problem, 64, 4096, 1, sm_count=132)

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    avals = [_aval((64, 512), jnp.bfloat16), _aval((512, 512), jnp.bfloat16)]
    params = dict(ir=ir, transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=None, precision=None)
    plan = plan_call(avals, params)
    assert plan.backend == "reference" and plan.level == logging.INFO and "64 rows share each B" in plan.reason
    assert plan_call(avals, dict(params, config=GemmConfig(64, 128))).backend == "kernel"
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    assert plan_call(avals, params).backend == "kernel"


def test_device_arch_from_env(monkeypatch):
    from jax_efc import device

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert device.arch() == "sm_90a"


_EXPORT_PUBLIC = """
import os
import jax, jax.numpy as jnp
import jax_efc as efc
from cutlass.jax import get_export_disabled_safety_checks
def specs(m):
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(m, 1536), (1536, 1536), (1536,)]]
def layer(x, w, b, config=None):
    return efc.fused_dense(x, w, b, activation="gelu", config=config)
def loss(x, w, b):
    return layer(x, w, b).astype(jnp.float32).sum()
def kernels(fn, m):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=get_export_disabled_safety_checks())(*specs(m))
    print(exported.mlir_module().count("NvJaxCutlassCall"))
kernels(layer, 2048)
kernels(jax.grad(loss, argnums=(0, 1, 2)), 2048)
kernels(layer, 64)
kernels(layer, 512)
kernels(lambda x, w, b: layer(x, w, b, efc.GemmConfig(64, 128)), 64)
os.environ["JAX_EFC_STRICT"] = "1"  # read when a call is lowered: a new function, not a cached one
kernels(lambda x, w, b: layer(x, w, b), 64)
"""


def test_export_of_the_public_op_holds_the_kernels():
    """``jax.export`` for CUDA of a jitted ``fused_dense``, and of its gradient, on a machine
    without a GPU: one kernel forward, three with the two backward GEMMs. A 64-row layer, and a
    512-row one (48 tiles of 128x128), go to XLA's GEMM, unless a config is pinned or
    ``JAX_EFC_STRICT=1``."""
    pytest.importorskip("cutlass.jax")
    assert run_for_sm90(_EXPORT_PUBLIC).split() == ["1", "3", "0", "0", "1", "1"]


_EXPORT_MLP = """
import re
import jax, jax.numpy as jnp
import jax_efc as efc
from cutlass.jax import get_export_disabled_safety_checks
for gated in (False, True):
    shapes = [(2048, 1024), (1024, 4096), (4096,), (4096, 1024), (1024,)] + [(1024, 4096), (4096,)] * gated
    def loss(*a):
        gate = dict(gate_kernel=a[5], gate_bias=a[6]) if gated else {}
        y = efc.fused_mlp(*a[:5], activation="silu" if gated else "gelu_tanh", **gate)
        return y.astype(jnp.float32).sum()
    grads = jax.grad(loss, argnums=tuple(range(len(shapes))))
    exported = jax.export.export(jax.jit(grads), platforms=["cuda"],
                                 disabled_checks=get_export_disabled_safety_checks())(
        *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes])
    calls = [re.search(r"} : \\((.*?)\\) ->", line).group(1).split(", ")
             for line in exported.mlir_module().splitlines() if "NvJaxCutlassCall" in line]
    # the backward's fused GEMM: the cotangent and the down kernel, then the saved accumulator,
    # the bias (and the up projection)
    head = ["tensor<1x2048x1024xbf16>", "tensor<1x4096x1024xbf16>"]
    fused = [c for c in calls if len(c) == 4 + gated and c[:2] == head]
    print(len(calls), len(fused))
"""


def test_export_of_fused_mlp_gradients_holds_the_kernels():
    """``jax.export`` for CUDA of the gradients of ``fused_mlp`` (plain and gated) compiles
    every kernel for sm_90a, the backward's GEMM with the activation's derivative among them.
    Custom calls in the module: the forward's first layer (and up projection), the backward's
    four GEMMs (gated: six, two of which have the same types and share a function in the
    module); the forward's down projection is dead in a gradient of a sum."""
    pytest.importorskip("cutlass.jax")
    assert run_for_sm90(_EXPORT_MLP).split() == ["5", "1", "7", "1"]


_EXPORT_TIMELINE = """
import os, sys
import jax
from cutlass.jax import get_export_disabled_safety_checks
from jax_efc.bench import bench_problem
from jax_efc.config import GemmConfig
from jax_efc.timeline import timeline_call
cfg = GemmConfig(128, 128, 1, 2, swizzle=8, pingpong=True, epi_n=64)
fn, specs = timeline_call(bench_problem("bias+gelu_tanh", (2048, 1024, 512, 1), config=cfg))
exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=get_export_disabled_safety_checks())(*specs)
dump = sys.argv[1]
ptx = "".join(open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx"))
stamps = exported.out_avals[0]
print(",".join(map(str, stamps.shape)), stamps.dtype, "%clock;" in ptx)
"""


def test_timeline_build_exports(tmp_path):
    """The diagnostic timeline build compiles for sm_90a and returns its SM-clock stamps:
    (132 CTAs, 2 ping-pong groups, units, events) int32."""
    pytest.importorskip("cutlass.jax")
    from jax_efc.kernels import TIMELINE_EVENTS, TIMELINE_UNITS

    out = run_for_sm90(_EXPORT_TIMELINE, str(tmp_path), CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    assert out.split() == [f"132,2,{TIMELINE_UNITS},{len(TIMELINE_EVENTS)}", "int32", "True"]


if __name__ == "__main__":
    import importlib

    dump_dir, out_path, which, arch = sys.argv[1:5]
    groups = {"low_precision": LOW_PRECISION_VARIANTS, "reductions": REDUCTION_VARIANTS, "standard": VARIANTS}
    if which in groups:
        variants = groups[which]
    else:
        module, name = which.rsplit(".", 1)
        variants = getattr(importlib.import_module(module), name)
    with open(out_path, "w") as f:
        json.dump(_compile_all(dump_dir, variants, arch), f)
