"""Reductions the epilogue consumes over N, finished inside a tile that spans the rows (a row
softmax, a row norm): where the op sends them, the reference numerics, the plan's tiles and
refusals, the passes the kernel makes, and how each thread reads its rows' totals back, checked
without a GPU (the kernel's numerics: ``test_gpu_row_stats.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from jax_efc.epilogue import ROW_TILE_N, rows_in_tile, split_at_reductions
from jax_efc.tracing import trace_epilogue

from test_reductions import reduce_as_the_kernel, wgmma_points


def softmax_norm(acc, bias):
    y = acc * 0.5 + bias
    return {"p": jax.nn.softmax(y, axis=-1), "u": y / jnp.linalg.norm(y, axis=-1, keepdims=True),
            "lse": jnp.log(jnp.sum(jnp.exp(y - 4.0), axis=-1)), "y": y}


def oracle(a, b, bias):
    y = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64)) * 0.5 + np.asarray(bias, np.float64)
    e = np.exp(y - y.max(-1, keepdims=True))
    return {"p": e / e.sum(-1, keepdims=True), "u": y / np.sqrt((y * y).sum(-1, keepdims=True)),
            "lse": np.log(np.exp(y - 4.0).sum(-1)), "y": y}


def _trace(fn, n, m=64, operands=((1, None),)):
    shapes = [tuple(n if d is None else d for d in s) for s in operands]
    ir, *_ = trace_epilogue(fn, (m, n), shapes, [jnp.float32] * len(shapes), {}, {}, jnp.float32, jnp.float32)
    return ir


def crowded_rows(acc, bias, c):
    """softmax_norm beside four more fp32 outputs that read a TILE operand: buffers enough that
    the tile's row stats run in 16-wide subtiles."""
    out = softmax_norm(acc, bias)
    return {**out, **{f"z{i}": out["p"] * (i + 1) + c for i in range(4)}}


def crowded_oracle(a, b, bias, c):
    want = oracle(a, b, bias)
    return {**want, **{f"z{i}": want["p"] * (i + 1) + np.asarray(c, np.float64) for i in range(4)}}


def test_where_the_reductions_run():
    """Consumed reductions over N alone stay in the GEMM for rows up to ROW_TILE_N wide; over M,
    over the whole tile, on wider rows, or not consumed at all, the program splits as before."""
    ir = _trace(softmax_norm, 120)
    assert rows_in_tile(ir, 120) and rows_in_tile(ir, ROW_TILE_N) and not rows_in_tile(ir, ROW_TILE_N + 8)
    assert not rows_in_tile(_trace(lambda acc, b: acc - jnp.mean(acc, axis=0), 64), 64)
    assert not rows_in_tile(_trace(lambda acc, b: acc / jnp.linalg.norm(acc), 64), 64)
    assert not rows_in_tile(_trace(lambda acc, b: (acc, jnp.max(acc, axis=-1)), 64), 64)
    # a reduced value that reads a tile operand: the kernel could not finish it before storing
    tiled = _trace(lambda acc, c: jax.nn.softmax(acc + c, axis=-1), 64, operands=((64, None),))
    assert not rows_in_tile(tiled, 64)
    assert rows_in_tile(_trace(lambda acc, c: jax.nn.softmax(acc, axis=-1) * c, 64, operands=((64, None),)), 64)
    split = split_at_reductions(ir, True)
    gemm = split.gemm
    # the tiles come straight from the GEMM; the log of a row sum (one value a row) after it
    direct = {o.name: d for o, d in zip(ir.outputs, split.direct)}
    assert direct["lse"] is None and None not in (direct["p"], direct["u"], direct["y"])
    assert [i.attr for i in gemm.instrs if i.op == "reduce"] == [("max", ("n",)), ("sum", ("n",)),
                                                                  ("sum", ("n",))]
    assert [(o.reduce, o.over) for o in gemm.outputs if o.reduce] == [("sum", ("n",))]


@pytest.mark.parametrize("m, n, k, batch", [(300, 120, 64, None), (130, 128, 32, 2), (40, 8, 16, None),
                                             (50, 200, 16, None)])
def test_reference_numerics(rng, m, n, k, batch):
    lead = () if batch is None else (batch,)
    a = jnp.asarray(rng.standard_normal((*lead, m, k)) / np.sqrt(k), jnp.float32)
    b = jnp.asarray(rng.standard_normal((*lead, k, n)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    got = jax.jit(lambda a, b, c: efc.gemm(a, b, softmax_norm, c, precision="highest"))(a, b, bias)
    for key, want in oracle(a, b, bias).items():
        np.testing.assert_allclose(np.asarray(got[key], np.float64), want, rtol=2e-5, atol=2e-6, err_msg=key)


def test_gradients_and_vmap_match_plain_jax(rng):
    a = jnp.asarray(rng.standard_normal((3, 40, 16)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(24), jnp.float32)

    def loss(fn):
        def f(a, b, bias):
            out = fn(a, b, bias)
            return jnp.sum(out["p"] * jnp.arange(24.0)) + jnp.sum(out["u"][..., 3]) + jnp.sum(out["lse"])
        return f

    fused = loss(jax.vmap(lambda a, b, c: efc.gemm(a, b, softmax_norm, c, precision="highest"), (0, None, None)))
    plain = loss(lambda a, b, c: softmax_norm(jnp.matmul(a, b, precision="highest"), c))
    got, want = jax.grad(fused, (0, 1, 2))(a, b, bias), jax.grad(plain, (0, 1, 2))(a, b, bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_columns_sharded_are_gathered_for_the_rows(rng):
    """A softmax over N on columns sharded across devices sees whole rows, never a shard's."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    a = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(96), jnp.float32)
    fn = jax.jit(lambda a, b, c: efc.gemm(a, b, softmax_norm, c, precision="highest"))
    want = fn(a, b, bias)
    sa = jax.device_put(a, NamedSharding(mesh, P("data", None)))
    sb = jax.device_put(b, NamedSharding(mesh, P(None, "model")))
    got = fn(sa, sb, bias)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-6, err_msg=key)


def _plan(monkeypatch, fn, m, n, k, operands=((1, None),), arch="sm_90a", rows=None, **config):
    from jax_efc.config import GemmConfig
    from jax_efc.plan import plan_kernel

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    ir = _trace(fn, n, m, operands)
    gemm = split_at_reductions(ir, rows_in_tile(ir, n) if rows is None else rows).gemm
    specs = [jax.ShapeDtypeStruct(tuple(n if d is None else d for d in s), jnp.float32) for s in operands]
    return plan_kernel(gemm, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
                       specs, transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                       config=GemmConfig(**config) if config else None, arch=arch)


@pytest.mark.parametrize("n", [8, 64, 120, 128])
def test_the_heuristic_takes_a_tile_as_wide_as_the_row(monkeypatch, n):
    plan = _plan(monkeypatch, softmax_norm, 8192, n, 4096)
    assert plan.backend == "kernel", plan.reason
    assert plan.config.tile_n >= n and plan.config.cluster_n == 1


@pytest.mark.parametrize("m, n, k", [(1000, 120, 48), (64, 88, 48), (2296, 128, 4104)])
def test_crowded_rows_take_narrow_subtiles_not_xla(monkeypatch, m, n, k):
    """With one k-tile the heuristic took 128x256 tiles, whose 128x32 subtiles left these buffers
    no room for 2 stages, and the call went to XLA; narrower subtiles and tiles that still span
    the row run it (test_gpu_row_stats.py runs them)."""
    plan = _plan(monkeypatch, crowded_rows, m, n, k, operands=((1, None), (m, None)))
    assert plan.backend == "kernel", plan.reason
    assert plan.config.tile_n >= n and plan.config.epi_n == 16, plan.config


def test_refusals_name_the_cause(monkeypatch):
    from jax_efc.kernels import policy

    plan = _plan(monkeypatch, softmax_norm, 4096, 128, 1024, tile_m=128, tile_n=64)
    assert plan.backend == "reference" and "tile_n=64 is narrower than N=128" in plan.reason
    tiled = lambda acc, bias, c: jax.nn.softmax(acc + c, axis=-1) + bias  # noqa: E731
    # (the op splits such a program; the primitive, given it whole, refuses it)
    plan = _plan(monkeypatch, tiled, 4096, 128, 1024, operands=((1, None), (4096, None)), rows=True)
    assert plan.backend == "reference" and "reduces a value that reads a tile operand" in plan.reason
    # a tile operand read after the reductions is fine
    plan = _plan(monkeypatch, lambda acc, bias, c: jax.nn.softmax(acc + bias, axis=-1) * c, 4096, 128, 1024,
                 operands=((1, None), (4096, None)))
    assert plan.backend == "kernel", plan.reason
    # verified on an H200; were it not, the kernel would check itself on first use, saying what
    hopper = policy("sm_90a")
    assert hopper.unverified_reason(plan.problem) is None
    monkeypatch.setattr(type(hopper), "verified_row_stats", False)
    assert "row reductions consumed inside the tile" in hopper.unverified_reason(plan.problem)
    plan = _plan(monkeypatch, softmax_norm, 4096, 128, 1024, arch="sm_100a")
    assert plan.backend == "kernel" and plan.config.tile_n >= 128, plan.reason
    monkeypatch.setattr(type(policy("sm_100a")), "row_stats_kernel", False)
    plan = _plan(monkeypatch, softmax_norm, 2048, 128, 1024, arch="sm_100a")  # (a plan of its own)
    assert plan.backend == "reference" and "does not finish reductions inside its tiles" in plan.reason


def test_the_passes_over_the_tile():
    """A softmax's max and a norm's sum of squares in the first pass, the sum of exponentials
    (which reads the max) in the second; each pass computes only what its reductions read."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.visitor import EpilogueVisitor

    ir = split_at_reductions(_trace(softmax_norm, 128), True).gemm
    visitor = EpilogueVisitor(ir, [False])
    kinds = [[kind for _, kind in p] for p in visitor.row_passes]
    assert kinds == [["max", "sum"], ["sum"]]
    first = visitor.pass_needs[0]
    assert not any(visitor.ir.instrs[v - len(visitor.ir.inputs)].op in ("exp", "div") for v in first
                   if v >= len(visitor.ir.inputs))


WALKS = [  # (epilogue subtile, tile, epilogue threads): Hopper's cooperative and ping-pong tiles
    ((128, 32), (128, 256), 256), ((64, 32), (128, 128), 128), ((128, 64), (128, 192), 256),
    ((64, 16), (192, 64), 128), ((256, 32), (256, 128), 256),
]


def check_row_totals(red, points, rng) -> None:
    """Each thread's totals of a reduction over N (``TileReduction.collect``), spread over its
    values of every subtile as ``RowStats.given`` spreads them, are the totals of the values' rows,
    masked at the N edge (rows past M are never stored), on the layout ``points`` gives."""
    from jax_efc.kernels.reduction import lane_map

    kind, tile, threads = red.kind, red.tile_mn, red.threads
    data = rng.integers(-50, 50, tile).astype(np.float64)
    if kind == "max":
        data[tile[0] // 3, 2] = np.nan
    extent = (tile[0] - 3, tile[1] - 5)
    written = reduce_as_the_kernel(red, points, data, extent)
    cut = np.where(np.arange(tile[1]) < extent[1], data, {"sum": 0.0, "max": -np.inf}[kind])
    want = cut.sum(1) if kind == "sum" else np.where(np.isnan(cut).any(1), np.nan, np.nanmax(cut, 1))
    lanes = lane_map(red, points)
    for t in range(threads):
        pts = points(t)
        totals = [None] * lanes.slots
        for s in range(red.n_sub):
            if red.closes(s):
                for j, v in lanes.closing[s]:
                    totals[j] = written[(s, red.position(s, pts[s][v]))]
        for s in range(red.n_sub):
            for v, (m, _) in enumerate(pts[s]):
                np.testing.assert_array_equal(totals[lanes.slot[s][v]], want[m], err_msg=str((t, s, v)))


@pytest.mark.parametrize("kind", ["sum", "max"])
@pytest.mark.parametrize("epi, tile, threads", WALKS)
def test_every_thread_reads_its_rows_totals(rng, kind, epi, tile, threads):
    """On WGMMA's fragments (Blackwell's tensor-memory rows: ``test_kernel_compile_sm100.py``)."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.reduction import TileReduction

    check_row_totals(TileReduction(kind, ("n",), epi, tile, threads), wgmma_points(tile, epi, threads), rng)
