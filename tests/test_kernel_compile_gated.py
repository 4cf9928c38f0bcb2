"""Gated GEMMs (``EpilogueIR.gated``) compiled on the CPU for sm_90a like the variants of
``test_kernel_compile.py`` (whose helpers and checks they share): the PTX holds the WGMMA and
TMA of every variant, outputs half the product's width, and nothing spills."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from conftest import run_for_sm90
from test_kernel_compile import assemble_all, check_spills, check_variant, compile_variants

# as test_kernel_compile.VARIANTS; "gatedB:NAME" is a gated epilogue of block B, N the product's
# columns (the outputs have N / 2). M and N leave partial tiles where a tile holds several pairs
GATED_VARIANTS = {
    # what the heuristic runs for large problems: ping-pong 128x128 tiles (one pair of 64) in 1x2
    # clusters, 64-wide subtiles
    "bf16_pingpong_swiglu_128x128_c1x2_epi64": (
        "bfloat16", False, False, None, (128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_n": 64}),
        "gated64:swiglu", (1000, 1024, 256)),
    # cooperative 128x256 (two pairs a tile), 32-wide subtiles, B stored (2N, K); the last tile
    # holds one pair
    "bf16_swiglu_128x256_nk": ("bfloat16", False, True, None, (128, 256, 1, 1), "gated64:swiglu",
                               (1064, 896, 256)),
    # a TILE operand and two outputs, blocks of 32 (four pairs a 256-column tile), batched
    "fp16_geglu_tile_batched_128x256_c2x1": ("float16", False, False, 2, (128, 256, 2, 1), "gated32:geglu_tile",
                                             (1128, 832, 256)),
    # ping-pong 192x128 tiles in 64x16 subtiles, what the heuristic runs for the largest
    # problems (64x32 ones spill: the policy narrows them)
    "bf16_pingpong_swiglu_192x128_c1x2_epi64x16": (
        "bfloat16", False, False, None,
        (192, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64, "epi_n": 16}), "gated64:swiglu",
        (1192, 1024, 256)),
    # stream-K: split tiles meet before the gated epilogue
    "bf16_swiglu_128x128_c2x1_stream_k": ("bfloat16", False, False, None, (128, 128, 2, 1, {"swizzle": 8}),
                                          "gated64:swiglu", (8192, 8192, 8192)),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "test_kernel_compile_gated.GATED_VARIANTS", unverified=True)


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(GATED_VARIANTS))
def test_variant_compiles_to_wgmma(compiled, name):
    """Each variant passes the checks every Hopper variant does and returns outputs of half the
    product's columns."""
    variant = GATED_VARIANTS[name]
    result = compiled[name]
    check_variant(result, variant, stream_k=name.endswith("stream_k"))
    m, n, _ = variant[6]
    batch = variant[3]
    assert result["out_shapes"][0] == ([batch] if batch else []) + [m, n // 2]


@pytest.mark.matrix
def test_variants_do_not_spill(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


def _gated_problem(block: int, config, reduce: bool = False):
    import jax.numpy as jnp

    from jax_efc.epilogue import split_at_reductions
    from jax_efc.kernels import KernelProblem
    from jax_efc.tracing import trace_epilogue

    def fn(g, u):
        return (g * u, jnp.sum(g, axis=-2)) if reduce else g * u

    ir, *_ = trace_epilogue(fn, (256, 512), [], [], {}, {}, None, jnp.bfloat16, gated=block)
    return KernelProblem(ir=split_at_reductions(ir).gemm, ab_dtype="bfloat16", acc_dtype="float32", a_major="k",
                         b_major="n", batched=False,
                         a_batched=False, b_batched=False, operand_batched=(), arch="sm_90a", config=config)


@pytest.mark.parametrize("block, change, needle", [
    (64, dict(tile_n=192, pingpong=True, cluster_n=2), "gated=64: a tile of 192 columns does not hold whole"),
    (128, dict(tile_n=128), "gated=128: a tile of 128 columns"),
    (32, dict(epi_n=64), "gated=32: epilogue subtiles of 64 columns do not divide a block of 32"),
    (8, dict(epi_n=16), "gated=8: epilogue subtiles of 16 columns"),
])
def test_configs_that_split_pairs_are_refused(block, change, needle):
    from jax_efc.config import GemmConfig
    from jax_efc.kernels.sm90_policy import POLICY

    problem = _gated_problem(block, dataclasses.replace(GemmConfig(), **change))
    assert needle in POLICY.unsupported_reason(problem)


def test_gated_reductions_integers_and_blackwell_are_refused():
    from jax_efc.config import GemmConfig
    from jax_efc.kernels import policy

    assert "does not reduce" in policy("sm_90a").unsupported_reason(_gated_problem(64, GemmConfig(), reduce=True))
    int8 = dataclasses.replace(_gated_problem(64, GemmConfig()), ab_dtype="int8", b_dtype="int8", acc_dtype="int32",
                               b_major="k")
    assert "integer accumulators" in policy("sm_90a").unsupported_reason(int8)
    problem = dataclasses.replace(_gated_problem(64, GemmConfig()), arch="sm_100a")
    assert "does not pair a gated GEMM" in policy("sm_100a").unsupported_reason(problem)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("mnk", [(8192, 28672, 4096), (1000, 4096, 4096), (256, 512, 512)])
def test_heuristic_picks_configs_that_pair(block, mnk):
    """Whatever the heuristic would take for a plain GEMM of the shape, a gated one gets a tile
    of whole pairs and subtiles within a block, and so does every autotuning candidate."""
    from jax_efc.config import GemmConfig
    from jax_efc.kernels.sm90_policy import POLICY

    problem = _gated_problem(block, GemmConfig())
    m, n, k = mnk
    chosen = POLICY.choose_config(problem, m, n, k, 1)
    if chosen.pingpong and chosen.tile_m * chosen.tile_n > 128 * 128:  # wider subtiles spill
        assert (chosen.epi_m, chosen.epi_n) == (64, 16), chosen
    for cfg in [chosen] + POLICY.candidate_configs(problem, m, n, k, 1):
        assert POLICY.unsupported_reason(dataclasses.replace(problem, config=cfg), (m, n, k, 1)) is None, cfg


@pytest.mark.parametrize("m, tile_m", [(4096, 192), (8192, 192), (16384, 192), (1024, 128)])
def test_heuristic_takes_tall_tiles_for_gated_gemms_that_fill_a_little_worse(m, tile_m):
    """SwiGLU's up projection (K 4096, hidden 14336, so 28672 product columns): 192x128
    ping-pong tiles wherever they fill the SMs' rounds within _GATED_FILL_SLACK of 128x128
    (at M = 4096, 0.953 against 0.987: there they ran 1.19x faster on an H100)."""
    from jax_efc.config import GemmConfig
    from jax_efc.kernels.sm90_policy import POLICY

    chosen = POLICY.choose_config(_gated_problem(64, GemmConfig()), m, 28672, 4096, 1, 132)
    assert (chosen.tile_m, chosen.tile_n, chosen.pingpong) == (tile_m, 128, True), chosen


def test_block_width_is_in_every_key_and_checked_on_first_use(monkeypatch):
    """Kernels of two block widths (or none) differ in their compile key, and so in the
    autotuner's and the first-use check's records; where the gated epilogue has not run on a GPU
    of the kind, the policy names it for a first-use check (jax_efc.self_check)."""
    from jax_efc import autotune, self_check
    from jax_efc.config import GemmConfig
    from jax_efc.kernels import policy
    from jax_efc.kernels.sm90_policy import Sm90Policy

    problems = [_gated_problem(b, GemmConfig()) for b in (32, 64)]
    plain = dataclasses.replace(problems[1], ir=dataclasses.replace(problems[1].ir, gated=0))
    assert len({p.compile_key for p in (*problems, plain)}) == 3
    plans = [SimpleNamespace(problem=p, mnkl=(256, 512, 64, 1)) for p in (*problems, plain)]
    gpu = ("NVIDIA H100 80GB HBM3", 132)
    for key in (autotune.record_key, self_check._key):
        assert len({key(p, gpu) for p in plans}) == 3
    assert policy("sm_90a").unverified_reason(problems[1]) is None  # ran on an H100 and an H200
    monkeypatch.setattr(Sm90Policy, "verified_gated", False)
    assert policy("sm_90a").unverified_reason(problems[1]) == (
        "the sm_90a kernel's gated epilogue (gate and up columns paired)")
    assert policy("sm_90a").unverified_reason(plain) is None


_EXPORT = """
import json
import jax, jax.numpy as jnp
import jax_efc as efc
efc.set_target_arch("sm_90a")
S = jax.ShapeDtypeStruct
x, w, b = S((2048, 1024), jnp.bfloat16), S((1024, 8192), jnp.bfloat16), S((4096,), jnp.bfloat16)
f = jax.jit(lambda x, w, b: efc.gemm(x, w, lambda g, u, b: jax.nn.silu(g + b) * u, b, gated=64))
exported = jax.export.export(f, platforms=["cuda"], disabled_checks=efc.export_checks())(x, w, b)
print(json.dumps({"backends": efc.backends(f, x, w, b), "shape": list(exported.out_avals[0].shape),
                  "kernel": "CuteDSLRT" in exported.mlir_module()}))
"""


def test_an_export_from_a_cpu():
    """Verified on Hopper GPUs, the gated kernel is what an export for sm_90a from a CPU holds;
    its output has N columns."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_EXPORT, JAX_EFC_UNVERIFIED_KERNELS="0").strip().splitlines()[-1])
    assert out["shape"] == [2048, 4096]
    assert out["kernel"] and out["backends"] == ["kernel (sm_90a)"], out


@pytest.mark.parametrize("block", [32, 64])
def test_first_use_check_problems_hold_whole_pairs(block):
    """The first-use check of a gated kernel runs whole (gate, up) pairs past twice the cluster's
    tiles: a tile count the cluster does not divide, and a partial tile where one holds several."""
    from jax_efc import checking
    from jax_efc.config import GemmConfig

    for cfg in (GemmConfig(128, 128, 1, 2, pingpong=True), GemmConfig(128, 256, 2, 1)):
        _, n, _, _ = checking.check_shapes(cfg, 64, batched=False, gated=block)
        assert n % (2 * block) == 0
        tiles = -(-n // cfg.tile_n)
        assert tiles > 2 * cfg.cluster_n and (cfg.cluster_n == 1 or tiles % cfg.cluster_n)
        assert (n % cfg.tile_n != 0) == (cfg.tile_n > 2 * block)


@pytest.mark.parametrize("tile, epi, block", [((128, 128), (128, 32), 64), ((128, 256), (64, 64), 64),
                                              ((128, 256), (128, 16), 32), ((192, 128), (64, 16), 16),
                                              ((128, 256), (128, 32), 128)])
def test_the_gated_walk_pairs_every_output_column_once(tile, epi, block):
    """The driver's map from an output subtile to its gate and up accumulator subtiles
    (``FusedGemmBase._gated_subtiles``): output column c of the tile reads the gate's column
    2B (c // B) + c % B and the up column B further, and the walk reads every accumulator
    subtile of the tile exactly once."""
    pytest.importorskip("cutlass")
    from types import SimpleNamespace

    from jax_efc.kernels.gemm_base import FusedGemmBase

    (tile_m, tile_n), (epi_m, epi_n) = tile, epi
    walk = SimpleNamespace(tile_mnk=(tile_m, tile_n, 64), epi_tile=epi, gated=block)
    sub_m = tile_m // epi_m
    n_out_sub = sub_m * (tile_n // 2 // epi_n)
    read = []
    for s in range(n_out_sub):
        gate, up, shift = FusedGemmBase._gated_subtiles(walk, s)
        assert gate % sub_m == up % sub_m == s % sub_m  # the same rows
        for c in range(epi_n):
            out_col = s // sub_m * epi_n + c
            gate_col = gate // sub_m * epi_n + c
            assert gate_col - shift == out_col
            assert gate_col == 2 * block * (out_col // block) + out_col % block
            assert up // sub_m * epi_n + c == gate_col + block
        read += [gate, up]
    assert sorted(read) == list(range(sub_m * (tile_n // epi_n)))
