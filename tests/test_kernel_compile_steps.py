"""The kernels the heuristic plans for a model's training steps, compiled for sm_90a on the CPU:
a dense layer's, a GELU MLP's and a gated MLP's (bf16, 8192 x 14336 x 4096, the benchmark's
``train:`` problems), the FP8 dense layer's (``fp8train:``, its 8-bit GEMMs promoting partial
sums every second k-tile, the default) and the FP8 MLP's (delayed scaling: its up GEMM and its
down projection's data-gradient GEMM also store transposed copies). None spills. The compile
matrix pins its configs; this checks the heuristic's own choices for the epilogues a model runs,
where reductions folded beside TILE operands once spilled 464-500 bytes on 192x128 tiles
(benchmarks/FINDINGS.md, "Tenth sitting")."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_for_sm90
from test_kernel_compile import assemble_all, check_spills

pytestmark = pytest.mark.matrix

STEPS = ("train:bias+gelu_tanh", "train:mlp+gelu_tanh", "train:gated_mlp+silu", "fp8train:bias+gelu_tanh", "fp8mlp")

# Lowers each step for CUDA with a fresh kernel cache; after each GEMM's kernel is built (the
# next plan, or the end), takes the PTX the DSL dumped (named by the operands' shapes, so two
# kernels of one step may share a name) and records it under the plan that built it.
_LOWER_STEPS = r"""
import glob, json, os, sys
import jax
import jax_efc.primitive as prim
from jax_efc.bench import bench_problem

dump, steps = sys.argv[1], sys.argv[2:]
kernels, plans = {}, []

def collect():
    for path in glob.glob(os.path.join(dump, "*.ptx")):
        with open(path) as f:
            kernels[plans[-1]] = {"ptx": f.read()}
        os.remove(path)

for primitive, planner in list(prim.PLANNERS.items()):
    def spy(avals_in, params, devices=None, planner=planner):
        if plans:
            collect()
        plan = planner(avals_in, params, devices)
        c = plan.config
        plans.append(f"{step} #{len(plans)} {plan.backend} {c.tile_m}x{c.tile_n} "
                     f"{'pingpong' if c.pingpong else 'cooperative'} {c.epi_m}x{c.epi_n}" if c else plan.backend)
        return plan
    prim.PLANNERS[primitive] = spy

def fp8_mlp_step():  # the FP8 MLP's training step (delayed scaling): width 4096, hidden 14336, 8192 rows
    import jax.numpy as jnp
    import jax_efc as efc

    def loss(x, u, bu, w, bw, mu, md):
        y = efc.fp8_mlp(x, u, bu, w, bw, activation="gelu_tanh", up_meta=mu, down_meta=md)
        return jnp.square(y.astype(jnp.float32)).sum()

    S, meta = jax.ShapeDtypeStruct, efc.Fp8Meta.init(16)
    specs = (S((8192, 4096), jnp.bfloat16), S((4096, 14336), jnp.bfloat16), S((14336,), jnp.bfloat16),
             S((14336, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16), meta, meta)
    return jax.jit(jax.grad(loss, range(7))), specs

for step in steps:
    if step == "fp8mlp":
        fn, specs = fp8_mlp_step()
    else:
        problem = bench_problem(step, (8192, 14336, 4096, 1), "bfloat16", None)
        fn, specs = problem.ours, problem.specs
    fn.trace(*specs).lower(lowering_platforms=("cuda",))
collect()
print(json.dumps(kernels))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("cutlass.jax")
    dump = tmp_path_factory.mktemp("ptx")
    out = run_for_sm90(_LOWER_STEPS, str(dump), *STEPS, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump),
                       JAX_EFC_CACHE_DIR=str(tmp_path_factory.mktemp("cache")), JAX_EFC_COMPILE_AHEAD="0")
    return json.loads(out.strip().splitlines()[-1])


def test_every_kernel_of_the_steps_runs_on_the_kernel(compiled):
    # the dense step's three GEMMs, the GELU MLP's six, the gated MLP's eight, the FP8 layer's
    # four, the FP8 MLP's seven
    for step in STEPS:
        names = [name for name in compiled if name.startswith(step + " ")]
        assert len(names) >= 3 and all(" kernel " in name for name in names), names
        assert all("wgmma.mma_async" in compiled[name]["ptx"] for name in names)


def test_no_kernel_of_the_steps_spills(compiled, tmp_path_factory):
    files = {re.sub(r"\W+", "_", name): kernel for name, kernel in compiled.items()}  # names of PTX files
    check_spills(assemble_all(files, tmp_path_factory.mktemp("sass")))
