"""Grouped (ragged) GEMMs (``KernelProblem.groups``) compiled on the CPU for sm_90a, as
``test_kernel_compile.py`` compiles the dense variants: the PTX holds WGMMA, the TMA loads of A,
B and TILE operands, TMA stores and the predicated stores of a group's last tile, and nothing
spills; the weight gradient's (groups of the contraction) reads both operands transposed and
clears the rows of a group's last k-tile past its end. They compile under
``JAX_EFC_UNVERIFIED_KERNELS=1``; the policy's refusals run by default."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from test_kernel_compile import _config, assemble_all, check_spills

# name -> (dtype, transpose_b (rhs stored (G, N, K): the lhs gradient's GEMM), config (tile_m,
# tile_n, cluster_m, cluster_n[, other GemmConfig fields]), epilogue, (T, N, K, G))
GROUPED_VARIANTS = {
    # what the heuristic runs for large problems: ping-pong 128x128 tiles in 1x2 clusters
    "bf16_pingpong_group_bias_silu_c1x2": ("bfloat16", False, (128, 128, 1, 2, {"pingpong": True, "epi_n": 64}),
                                           "group_bias_silu", (4096, 1024, 512, 8)),
    # what the heuristic runs where 256-row tiles pad balanced groups no more than 128-row ones:
    # cooperative 256x128 in 1x2 clusters
    "bf16_bias_silu_256x128_c1x2": ("bfloat16", False, (256, 128, 1, 2), "group_bias_silu", (4096, 1024, 512, 16)),
    # cooperative 128x256, the plain product (the lhs gradient: rhs read transposed)
    "bf16_identity_128x256_nk": ("bfloat16", True, (128, 256, 1, 1), "identity", (2048, 512, 1024, 64)),
    # every operand role: a TILE operand (TMA-loaded at the tile's rows), a column, a per-group row
    # and a traced scalar; fp16, ping-pong 192x128 tiles in 64x16 subtiles
    "fp16_pingpong_multi_192x128": ("float16", False, (192, 128, 1, 1, {"pingpong": True, "epi_m": 64,
                                                                         "epi_n": 16}),
                                    "multi", (1000, 768, 256, 5)),
    # cooperative 128x128 tiles in 1x2 clusters, a bf16 and an fp32 output
    "bf16_two_outputs_128x128_c1x2": ("bfloat16", False, (128, 128, 1, 2), "two_outputs", (1536, 512, 384, 256)),
}


# name -> (dtype, config, (T, M, N, G)): the weight gradient's GEMM, (G, M, N) from a (T, M) and
# b (T, N); the first two are the heuristic's configs for 8 and 64 experts of 4096 -> 3584
CONTRACTION_VARIANTS = {
    "bf16_wgrad_pingpong_128x192_c1x2": ("bfloat16", (128, 192, 1, 2, {"pingpong": True, "epi_n": 32}),
                                         (4096, 512, 576, 8)),
    "bf16_wgrad_pingpong_128x128_c1x2": ("bfloat16", (128, 128, 1, 2, {"pingpong": True, "epi_n": 32}),
                                         (4096, 512, 384, 64)),
    "bf16_wgrad_128x256_c1x2": ("bfloat16", (128, 256, 1, 2, {"epi_n": 32}), (2000, 384, 768, 5)),
    "fp16_wgrad_128x128": ("float16", (128, 128, 1, 1), (1000, 200, 136, 3)),
}


def _grouped_epilogue(name: str, t: int, n: int, groups: int, dtype):
    """(ir, operand avals) of a test epilogue: its per-group operands (G + 1, 1, N) (a zero row
    for the rows past the groups), traced as rows."""
    import jax
    import jax.numpy as jnp

    from jax_efc.tracing import trace_epilogue

    group_row = ((1, n), (groups + 1, 1, n))
    if name == "identity":
        fn, specs, outs = (lambda acc: acc), [], dtype
    elif name == "group_bias_silu":
        fn, specs, outs = (lambda acc, bias: jax.nn.silu(acc + bias)), [(group_row, dtype)], dtype
    elif name == "two_outputs":
        fn = lambda acc, bias: {"y": jax.nn.gelu(acc + bias), "acc": acc}  # noqa: E731
        specs, outs = [(group_row, jnp.float32)], {"y": dtype, "acc": jnp.float32}
    else:  # tile + column + per-group row + traced scalar
        def fn(acc, c, col, bias, s):
            return jnp.tanh(acc * s + bias) * col + c
        specs = [(((t, n), (t, n)), dtype), (((t, 1), (t, 1)), dtype), (group_row, jnp.float32),
                 (((), ()), jnp.float32)]
        outs = dtype
    shapes = [traced for (traced, _), _ in specs]
    dtypes = [d for _, d in specs]
    ir, *_ = trace_epilogue(fn, (t, n), shapes, dtypes, {}, {}, outs, dtype)
    return ir, [jax.ShapeDtypeStruct(given, d) for (_, given), d in specs]


def _compile_all(dump_dir: str, arch: str = "sm_90a") -> dict:
    """Child process: export every grouped variant for ``arch``."""
    import jax
    import jax.numpy as jnp
    from cutlass.jax import get_export_disabled_safety_checks

    import jax_efc.ffi as F
    import jax_efc.plan as P
    from jax_efc.epilogue import identity_ir

    results = {}
    for name, (dt, tb, cfg, epi, (t, n, k, g)) in GROUPED_VARIANTS.items():
        dtype = jnp.dtype(dt)
        ir, ops = _grouped_epilogue(epi, t, n, g, dtype)
        a = jax.ShapeDtypeStruct((t, k), dtype)
        b = jax.ShapeDtypeStruct((g, n, k) if tb else (g, k, n), dtype)
        sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
        plan = P.plan_kernel(ir, a, b, ops, transpose_a=False, transpose_b=tb, acc_dtype=jnp.float32,
                             config=_config(cfg), arch=arch, groups=g)
        if plan.reason:
            results[name] = {"error": plan.reason}
            continue
        before = set(os.listdir(dump_dir))
        exported = jax.export.export(
            jax.jit(lambda a, b, s, *ops: F.fused_gemm(a, b, *ops, plan=plan, group_sizes=s)),
            platforms=["cuda"], disabled_checks=get_export_disabled_safety_checks(),
        )(a, b, sizes, *ops)
        new = [f for f in set(os.listdir(dump_dir)) - before if f.endswith(".ptx")]
        results[name] = {
            "custom_call": "stablehlo.custom_call @CuteDSLRT" in exported.mlir_module(),
            "out_shapes": [list(x.shape) for x in exported.out_avals],
            "ptx": "".join(open(os.path.join(dump_dir, f)).read() for f in new),
            "clusters": plan.schedule.clusters,
        }
    for name, (dt, cfg, (t, m, n, g)) in CONTRACTION_VARIANTS.items():
        dtype = jnp.dtype(dt)
        a, b = jax.ShapeDtypeStruct((t, m), dtype), jax.ShapeDtypeStruct((t, n), dtype)
        sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
        plan = P.plan_kernel(identity_ir(dtype), a, b, [], transpose_a=True, transpose_b=False, acc_dtype=jnp.float32,
                             config=_config(cfg), arch=arch, groups=g, ragged_k=True)
        if plan.reason:
            results[name] = {"error": plan.reason}
            continue
        before = set(os.listdir(dump_dir))
        exported = jax.export.export(
            jax.jit(lambda a, b, s, plan=plan: F.fused_gemm(a, b, plan=plan, group_sizes=s)),
            platforms=["cuda"], disabled_checks=get_export_disabled_safety_checks(),
        )(a, b, sizes)
        new = [f for f in set(os.listdir(dump_dir)) - before if f.endswith(".ptx")]
        results[name] = {"out_shapes": [list(x.shape) for x in exported.out_avals],
                         "ptx": "".join(open(os.path.join(dump_dir, f)).read() for f in new)}
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("cutlass.jax")
    dump = tmp_path_factory.mktemp("ptx")
    out = dump / "results.json"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump),
               JAX_PLATFORMS="cpu", JAX_EFC_UNVERIFIED_KERNELS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.path.dirname(__file__), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, str(dump), str(out)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(GROUPED_VARIANTS))
def test_variant_compiles_to_wgmma_and_tma(compiled, name):
    """WGMMA, TMA loads (A at its group's rows, B by group) and stores, the predicated stores of
    a group's last tile, and (T, N) outputs."""
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["custom_call"]
    ptx = result["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx and ".bulk_group" in ptx
    assert "@p st.global.b" in ptx  # a group's last tile: its rows only, by predicate
    wait = ptx.find("griddepcontrol.wait;")
    assert 0 <= wait < ptx.find("ld.global")  # the group sizes are read after the wait
    _, _, cfg, _, (t, n, _, _) = GROUPED_VARIANTS[name]
    assert result["out_shapes"][0] == [t, n]
    if cfg[3] > 1:
        assert "multicast::cluster" in ptx


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(CONTRACTION_VARIANTS))
def test_weight_gradient_variant_reads_both_operands_transposed_and_clears_the_group_edge(compiled, name):
    """The weight gradient's WGMMAs read A and B M/N-major (transpose flags 1, 1), the TMA loads
    start at the group's rows, a group's last k-tile is cleared past its end (16-byte shared
    stores of zeros, then a proxy fence before the WGMMAs read it), and the output is (G, M, N)."""
    result = compiled[name]
    assert "error" not in result, result.get("error")
    ptx = result["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.\w+\.\w+ [^;]*, 1,\s*1;", ptx)
    assert re.search(r"st\.shared\.v4\.b32\s+\[%r\d+\], \{0, 0, 0, 0\};", ptx)  # 16 zero bytes a store
    assert "fence.proxy.async.shared::cta" in ptx
    assert "cp.async.bulk.tensor" in ptx and "@p st.global" not in ptx  # whole tiles, TMA stores
    _, cfg, (t, m, n, g) = CONTRACTION_VARIANTS[name]
    assert result["out_shapes"][0] == [g, m, n]
    if cfg[3] > 1:
        assert "multicast::cluster" in ptx


@pytest.mark.matrix
def test_variants_do_not_spill(compiled, tmp_path_factory):
    check_spills(assemble_all(compiled, tmp_path_factory.mktemp("sass")))


def _problem(config=None, **change):
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.kernels import KernelProblem

    ir, _ = _grouped_epilogue(change.pop("epilogue", "group_bias_silu"), 1024, 512, 8, jnp.bfloat16)
    problem = KernelProblem(ir=ir, ab_dtype="bfloat16", acc_dtype="float32", a_major="k", b_major="n",
                            batched=False, a_batched=False, b_batched=True, operand_batched=(True,),
                            arch="sm_90a", config=config or GemmConfig(), groups=8)
    return dataclasses.replace(problem, **change)


@pytest.mark.parametrize("change, needle", [
    (dict(config="cluster_m"), "cluster_m=2: a grouped GEMM's clusters span one row tile"),
    (dict(groups=4096), "4096 groups"),
    (dict(a_major="m"), "reads A (the tokens) K-major only"),
    (dict(epilogue="reduce"), "does not reduce"),
])
def test_policy_refusals(change, needle):
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import split_at_reductions
    from jax_efc.kernels.sm90_policy import POLICY
    from jax_efc.tracing import trace_epilogue

    if change.get("config") == "cluster_m":
        change["config"] = GemmConfig(cluster_m=2)
    if change.get("epilogue") == "reduce":
        del change["epilogue"]
        ir, *_ = trace_epilogue(lambda acc: (acc, jnp.sum(acc, axis=-2)), (1024, 512), [], [], {}, {}, None,
                                jnp.bfloat16)
        change["ir"], change["operand_batched"] = split_at_reductions(ir).gemm, ()
    assert needle in POLICY.unsupported_reason(_problem(**change))


def _contraction_problem(**change):
    import jax.numpy as jnp

    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import identity_ir
    from jax_efc.kernels import KernelProblem

    problem = KernelProblem(ir=identity_ir(jnp.bfloat16), ab_dtype="bfloat16", acc_dtype="float32", a_major="m",
                            b_major="n", batched=True, a_batched=False, b_batched=False, operand_batched=(),
                            arch="sm_90a", config=GemmConfig(), groups=8, ragged_k=True)
    return dataclasses.replace(problem, **change)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32"])
def test_the_weight_gradient_kernel_reads_16_bit_inputs_only(dtype):
    """Planned as the primitive plans it (8-bit and TF32 operands are first moved K-major, which
    the contraction along their rows cannot be): the reference, saying why."""
    import jax
    import jax.numpy as jnp

    from jax_efc.plan import plan_kernel

    a, b = jax.ShapeDtypeStruct((1024, 256), dtype), jax.ShapeDtypeStruct((1024, 512), dtype)
    plan = plan_kernel(_contraction_problem().ir, a, b, [], transpose_a=True, transpose_b=False,
                       acc_dtype=jnp.float32, config=None, arch="sm_90a", groups=4, ragged_k=True)
    assert plan.backend == "reference" and "reads 16-bit inputs only" in plan.reason, plan.reason


@pytest.mark.parametrize("change, needle", [
    (dict(a_major="k"), "reads A stored (T, M) and B stored (T, N) only"),
    (dict(epilogue="silu"), "stores the plain product only"),
])
def test_weight_gradient_policy_refusals(change, needle):
    import jax
    import jax.numpy as jnp

    from jax_efc.kernels.sm90_policy import POLICY
    from jax_efc.tracing import trace_epilogue

    if change.pop("epilogue", None):
        change["ir"] = trace_epilogue(jax.nn.silu, (512, 512), [], [], {}, {}, None, jnp.bfloat16)[0]
    assert needle in POLICY.unsupported_reason(_contraction_problem(**change))


def test_the_weight_gradient_kernel_has_a_verification_of_its_own(monkeypatch):
    """Its own flag (verified on Hopper): the grouped GEMM's verification does not cover it,
    and its compile key differs from the grouped GEMM's of the same shapes."""
    from jax_efc.kernels.sm90_policy import POLICY, Sm90Policy

    problem = _contraction_problem()
    assert POLICY.unsupported_reason(problem) is None
    assert POLICY.unverified_reason(problem) is None
    monkeypatch.setattr(Sm90Policy, "verified_grouped_k", False)
    assert "groups of the contraction" in POLICY.unverified_reason(problem)
    assert POLICY.unverified_reason(_problem()) is None
    assert problem.compile_key != dataclasses.replace(problem, ragged_k=False).compile_key


def test_grouped_kernels_are_verified_on_hopper_and_blackwell_refuses_them():
    from jax_efc.kernels import policy

    problem = _problem()
    assert policy("sm_90a").unsupported_reason(problem) is None
    assert policy("sm_90a").unverified_reason(problem) is None
    assert "does not run grouped GEMMs" in policy("sm_100a").unsupported_reason(
        dataclasses.replace(problem, arch="sm_100a"))


def test_heuristic_takes_clusters_along_n():
    from jax_efc.kernels.sm90_policy import POLICY

    for mnk in ((16384, 4096, 4096), (4096, 14336, 4096), (512, 512, 512)):
        cfg = POLICY.choose_config(_problem(), *mnk, 1)
        assert cfg.cluster_m == 1 and POLICY.unsupported_reason(_problem(cfg)) is None, cfg



def test_heuristic_takes_256_row_tiles_where_they_pad_the_groups_no_more(monkeypatch):
    """Balanced groups of 256 or 2048 rows: cooperative 256x128 in 1x2 clusters; of 300 rows
    (one 256-row tile and a nearly empty one, against three 128-row tiles) or too few tiles to
    fill the SMs: the dense choice, clusters along N."""
    from jax_efc.kernels.sm90_policy import POLICY

    def chosen(t, n, k, g):
        problem = dataclasses.replace(_problem(), groups=g)
        return POLICY.choose_config(problem, t, n, k, 1)

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")  # verified on a GPU: the default
    for t, g in ((16384, 64), (16384, 8)):
        cfg = chosen(t, 3584, 4096, g)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.pingpong) == (256, 128, 1, 2, False), cfg
    for t, n, g in ((19200, 3584, 64), (2048, 512, 8)):
        cfg = chosen(t, n, 4096, g)
        assert cfg.tile_m != 256 and cfg.cluster_m == 1, cfg


if __name__ == "__main__":
    with open(sys.argv[2], "w") as f:
        json.dump(_compile_all(sys.argv[1]), f)
