"""Reductions in the epilogue: outputs that reduce, reductions consumed inside the epilogue,
their gradients, vmap, batching and sharding, against a float64 NumPy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from jax_efc.epilogue import EpilogueError, Output, evaluate, split_at_reductions
from jax_efc.tracing import trace_epilogue

REDUCE = {"sum": (jnp.sum, np.sum), "max": (jnp.max, np.max), "min": (jnp.min, np.min)}


def _operands(rng, m, n, k, batch=None, dtype=jnp.float32):
    lead = () if batch is None else (batch,)
    a = rng.standard_normal((*lead, m, k))
    b = rng.standard_normal((*lead, k, n))
    bias = rng.standard_normal(n)
    a, b = (jnp.asarray(x, dtype) for x in (a, b))
    # the oracle starts from the inputs as rounded to ``dtype``
    return a, b, jnp.asarray(bias, jnp.float32), np.asarray(a, np.float64), np.asarray(b, np.float64)


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1, None, "abs"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_reduction_against_the_oracle(rng, kind, axis, dtype):
    """m and n not multiples of any tile; tanh of a biased accumulator, then each reduction."""
    m, n, k = 77, 45, 24
    a, b, bias, a64, b64 = _operands(rng, m, n, k, dtype=dtype)
    jred, nred = REDUCE[kind]

    def epilogue(acc, bias):
        y = jnp.tanh(acc * 0.25 + bias)
        if axis == "abs":
            return y, jred(jnp.abs(y))
        return y, jred(y, axis=axis)

    y, r = efc.gemm(a, b, epilogue, bias)
    y64 = np.tanh((a64 @ b64) * 0.25 + np.asarray(bias, np.float64))
    want = nred(np.abs(y64)) if axis == "abs" else nred(y64, axis=axis)
    assert r.shape == np.shape(want) and r.dtype == jnp.float32  # reductions default to fp32
    assert y.dtype == dtype
    tol = 1e-5 * (m if kind == "sum" else 1)
    np.testing.assert_allclose(np.asarray(r, np.float64), want, atol=tol, rtol=1e-5)


def test_keepdims_and_out_dtypes(rng):
    a, b, _, a64, b64 = _operands(rng, 40, 24, 16)
    out = efc.gemm(a, b, lambda acc: {"c": jnp.sum(acc, axis=1, keepdims=True),
                                      "r": jnp.max(acc, axis=0, keepdims=True), "t": acc},
                   out_dtypes={"c": jnp.bfloat16, "r": jnp.float32, "t": jnp.bfloat16})
    acc = a64 @ b64
    assert out["c"].shape == (40, 1) and out["c"].dtype == jnp.bfloat16
    assert out["r"].shape == (1, 24) and out["t"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out["c"], np.float64), acc.sum(1, keepdims=True), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out["r"]), acc.max(0, keepdims=True), rtol=1e-5, atol=1e-5)


def test_batched_reductions_are_per_batch(rng):
    """A batched call reduces each batch apart; an axis tuple with the batch reduces it too.
    A 3-D ``a`` against a 2-D ``b`` (otherwise folded into M) still sums per batch."""
    a, _, _, a64, _ = _operands(rng, 33, 20, 16, batch=3)
    b = jnp.asarray(rng.standard_normal((16, 20)), jnp.float32)
    acc = a64 @ np.asarray(b, np.float64)
    cols, rows, each, total, amax = efc.gemm(a, b, lambda acc: (
        jnp.sum(acc, axis=1), jnp.min(acc, axis=2), jnp.max(acc, axis=(1, 2)), jnp.sum(acc),
        jnp.max(jnp.abs(acc))))
    assert (cols.shape, rows.shape, each.shape, total.shape) == ((3, 20), (3, 33), (3,), ())
    np.testing.assert_allclose(np.asarray(cols), acc.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(rows), acc.min(2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(each), acc.max((1, 2)), rtol=1e-6)
    np.testing.assert_allclose(float(total), acc.sum(), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(float(amax), np.abs(acc).max(), rtol=1e-6)


def test_non_finite_values_propagate(rng):
    a, b, _, _, _ = _operands(rng, 16, 16, 8)
    a = a.at[3, 2].set(jnp.nan).at[5, 1].set(jnp.inf)
    s, mx, mn = efc.gemm(a, b, lambda acc: (jnp.sum(acc, 0), jnp.max(acc, 1), jnp.min(acc)))
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    for got, want in ((s, ref.sum(0)), (mx, ref.max(1)), (mn, ref.min())):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(np.nan_to_num(np.asarray(got, np.float64), posinf=1e300, neginf=-1e300),
                                   np.nan_to_num(want, posinf=1e300, neginf=-1e300), rtol=1e-5, atol=1e-4)


CONSUMED = {
    "norm": (lambda acc: acc / jnp.linalg.norm(acc), lambda x: x / np.linalg.norm(x)),
    "row softmax": (lambda acc: jax.nn.softmax(acc, axis=-1),
                    lambda x: np.exp(x - x.max(1, keepdims=True)) / np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)),
    "row norm": (lambda acc: acc * jax.lax.rsqrt(jnp.mean(acc * acc, axis=1, keepdims=True) + 1e-6),
                 lambda x: x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6)),
    "centred columns": (lambda acc: acc - jnp.mean(acc, axis=0), lambda x: x - x.mean(0)),
    "amax scale": (lambda acc: (acc * (448.0 / jnp.max(jnp.abs(acc)))).astype(jnp.float8_e4m3fn).astype(jnp.float32),
                   None),
}


@pytest.mark.parametrize("name", list(CONSUMED))
def test_reductions_consumed_inside_the_epilogue(rng, name):
    fn, oracle = CONSUMED[name]
    a, b, _, a64, b64 = _operands(rng, 50, 36, 16)
    got = efc.gemm(a, b, fn, out_dtypes=jnp.float32)
    ref = jax.jit(fn)(jnp.asarray(a) @ jnp.asarray(b)) if oracle is None else oracle(a64 @ b64)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                               rtol=1e-5 if oracle else 0.07, atol=1e-5)


def test_the_split_gives_the_gemm_what_the_rest_reads():
    """``d / norm(d)``: the GEMM writes d (fp32) and the sum of its squares; the sqrt and the
    division run after. No reduction instruction is left in what the GEMM computes."""
    ir, *_ = trace_epilogue(lambda acc, bias: (acc + bias) / jnp.linalg.norm(acc + bias), (64, 32),
                            [(32,)], [jnp.float32], {}, {}, jnp.bfloat16, jnp.bfloat16)
    split = split_at_reductions(ir)
    assert split.direct == (None,)
    assert [o.reduce for o in split.gemm.outputs] == [None, "sum"]
    assert split.gemm.outputs[1].over == ("m", "n")
    assert split.gemm.outputs[0].dtype == "float32"
    assert not any(i.op == "reduce" for i in split.gemm.instrs)


def test_a_mask_crossing_the_split_is_computed_again_after_it(rng):
    """A comparison of the tile read after a reduction is not a value the GEMM stores (no kernel
    stores bool): XLA compares again what the GEMM gives it, and the result is the epilogue's."""
    def fn(acc, bias):
        x = acc + bias
        return x, jnp.where(x > 0, x - jnp.max(x, axis=1, keepdims=True), 0.0)

    ir, *_ = trace_epilogue(fn, (64, 32), [(32,)], [jnp.float32], {}, {}, jnp.bfloat16, jnp.bfloat16)
    split = split_at_reductions(ir)
    assert "bool" not in [o.dtype for o in split.gemm.outputs]
    assert [o.reduce for o in split.gemm.outputs].count("max") == 1
    a, b, _, a64, b64 = _operands(rng, 50, 36, 16)
    bias = rng.standard_normal(36).astype(np.float32)
    got = efc.gemm(a, b, fn, bias, out_dtypes=jnp.float32)
    x = a64 @ b64 + bias
    for g, want in zip(got, (x, np.where(x > 0, x - x.max(1, keepdims=True), 0.0))):
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-5, atol=1e-5)


def test_gradients_through_reductions(rng):
    a, b, bias, _, _ = _operands(rng, 48, 40, 24)

    def fused(a, b, bias):
        y, s, amax, sm = efc.gemm(a, b, lambda acc, bias: (
            jax.nn.gelu(acc + bias), jnp.sum(jax.nn.gelu(acc + bias), axis=0),
            jnp.max(jnp.abs(acc)), jax.nn.softmax(acc + bias, axis=-1)), bias, out_dtypes=jnp.float32)
        return jnp.sum(y * y) + jnp.sum(s ** 2) + amax + jnp.sum(sm ** 3)

    def plain(a, b, bias):
        acc = a @ b
        y = jax.nn.gelu(acc + bias)
        return (jnp.sum(y * y) + jnp.sum(jnp.sum(y, 0) ** 2) + jnp.max(jnp.abs(acc))
                + jnp.sum(jax.nn.softmax(acc + bias, axis=-1) ** 3))

    got = jax.jit(jax.grad(fused, (0, 1, 2)))(a, b, bias)
    want = jax.grad(plain, (0, 1, 2))(a, b, bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * float(jnp.abs(w).max()))


def test_stop_gradient_inside_the_epilogue_stops_it(rng):
    a, b, _, _, _ = _operands(rng, 16, 8, 8)
    grad = jax.grad(lambda a: jnp.sum(efc.gemm(a, b, lambda acc: acc * jax.lax.stop_gradient(acc))))(a)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jnp.ones((16, 8)) @ b.T * 0 + (a @ b) @ b.T),
                               rtol=1e-5, atol=1e-5)


def test_vmap_reduces_per_example(rng):
    a, b, _, a64, b64 = _operands(rng, 24, 16, 8, batch=4)
    w = b[0]
    got = jax.vmap(lambda x: efc.gemm(x, w, lambda acc: (jnp.sum(acc, 0), jnp.max(acc))))(a)
    acc = a64 @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got[0]), acc.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1]), acc.max((1, 2)), rtol=1e-6)


def test_grouped_gemm_reduces_over_tokens(rng):
    x = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 8, 6)), jnp.float32)
    sizes = jnp.array([4, 0, 5])
    y, s = efc.grouped_gemm(x, w, sizes, lambda acc: (acc, jnp.sum(jnp.abs(acc), axis=0)))
    ref = jax.lax.ragged_dot(x, w, sizes)
    np.testing.assert_allclose(np.asarray(s), np.abs(np.asarray(ref)).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("specs", [
    (P("data", None), P(None, "model")),  # rows and columns sharded
    (P(None, "model"), P("model", None)),  # row-parallel: partials summed, then the epilogue
    (P("data", "model"), P("model", None)),
])
def test_sharded_reductions_are_completed(rng, specs):
    """A reduction over a sharded axis is finished across devices, never left partial; a sum
    is added in float32 even where its output is bf16."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    a, b, bias, _, _ = _operands(rng, 64, 48, 32)

    def fn(a, b, bias):
        return efc.gemm(a, b, lambda acc, bias: {
            "cols": jnp.sum(jnp.tanh(acc + bias), 0), "rows": jnp.max(acc, 1),
            "amax": jnp.max(jnp.abs(acc)), "normed": acc / jnp.linalg.norm(acc, axis=1, keepdims=True)},
            bias, out_dtypes={"cols": jnp.bfloat16, "rows": jnp.float32, "amax": jnp.float32, "normed": jnp.float32})

    want = fn(a, b, bias)
    sa, sb = (jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((a, b), specs))
    got = jax.jit(fn)(sa, sb, bias)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key], np.float64), np.asarray(want[key], np.float64),
                                   rtol=1e-2 if key == "cols" else 1e-5, atol=1e-5)
    assert got["cols"].sharding.spec in (P(None), P("model"), P())


def test_errors_name_the_fix(rng):
    a, b, _, _, _ = _operands(rng, 12, 12, 8)
    with pytest.raises(EpilogueError, match=r"keepdims=True"):
        efc.gemm(a, b, lambda acc: acc - jnp.sum(acc, axis=1))  # (M,) against columns
    with pytest.raises(EpilogueError, match=r"uses `reduce_prod`"):
        efc.gemm(a, b, lambda acc: jnp.prod(acc, axis=0))
    with pytest.raises(EpilogueError, match=r"or a reduction of one"):
        efc.gemm(a, b, lambda acc, v: (acc, v * 2), jnp.ones(12))


def test_backends_of_reductions_in_an_export(monkeypatch):
    """Exported for sm_90a, reductions run in the kernel; were they unverified, the export (no GPU
    to check them on) would take the reference and say why."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.sm90_policy import Sm90Policy

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # as set_target_arch does, planned for an export
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    fn = lambda a, b: efc.gemm(a, b, lambda acc: (acc, jnp.sum(acc, 0)))  # noqa: E731
    assert efc.backends(fn, spec, spec) == ["kernel (sm_90a)"]
    monkeypatch.setattr(Sm90Policy, "verified_reductions", False)
    (why,) = efc.backends(fn, spec, spec)
    assert why.startswith("reference: not yet run on a GPU of its kind: the sm_90a kernel's epilogue reductions; "
                          "there is no sm_90a GPU here to check it on first use")


# The kernel's side (kernels/reduction.py), checked without a GPU ------------------------------

def wgmma_points(tile: tuple[int, int], epi: tuple[int, int], threads: int):
    """``points(t)`` of Hopper's accumulator layout: a WGMMA's C fragment (PTX ISA, "wgmma
    register fragments": lane l of warp w holds rows 16w + l // 4 (+ 8) and columns 2 (l % 4)
    (+ 1) of every 8 of each 64-row block), the tile's 64-row blocks dealt in turn to ``threads
    // 128`` warpgroups; the values of each subtile in one order for every thread."""
    groups = threads // 128

    def points(t):
        g, w, lane = t // 128, t // 32 % 4, t % 32
        values = [((i * groups + g) * 64 + 16 * w + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e)
                  for i in range(tile[0] // 64 // groups) for j in range(tile[1] // 8) for h in (0, 1)
                  for e in (0, 1)]
        sub_m = tile[0] // epi[0]
        subtiles = [[] for _ in range(sub_m * (tile[1] // epi[1]))]
        for m, n in values:
            subtiles[n // epi[1] * sub_m + m // epi[0]].append((m, n))
        return subtiles

    return points


def reduce_as_the_kernel(red, points, data, extent) -> dict:
    """One tile's reduction step by step as ``TileReduction`` runs it (fold, publish, flush) on
    the lane map it reads off ``points``: {(subtile, position): what flush writes}."""
    from jax_efc.kernels.reduction import lane_map

    identity = {"sum": 0.0, "max": -np.inf, "min": np.inf}[red.kind]

    def combine(a, b):
        if red.kind == "sum":
            return a + b
        return b if ((b > a) if red.kind == "max" else (b < a)) or b != b else a

    lanes = lane_map(red, points)
    pts = [points(t) for t in range(red.threads)]
    running = [[identity] * lanes.slots for _ in range(red.threads)]
    written = {}
    for s in range(red.n_sub):
        for t in range(red.threads):
            for v, (m, n) in enumerate(pts[t][s]):
                j = lanes.slot[s][v]
                inside = ("m" not in red.over or m < extent[0]) and ("n" not in red.over or n < extent[1])
                running[t][j] = combine(running[t][j], data[m, n] if inside else identity)
        if not red.closes(s):
            continue
        buf = {}
        for j, v in lanes.closing[s]:
            vals = [running[t][j] for t in range(red.threads)]
            for offset in lanes.shuffle:
                vals = [combine(vals[t], vals[t ^ offset]) for t in range(red.threads)]
            for t in range(red.threads):
                if t & sum(lanes.shuffle) == 0:
                    holder = sum((t >> b & 1) << i for i, b in enumerate(lanes.holders))
                    key = (red.position(s, pts[t][s][v]), holder)
                    assert key not in buf, key
                    buf[key] = vals[t]
                running[t][j] = identity
        for p in range(red.positions):
            total = buf[(p, 0)]
            for h in range(1, 1 << len(lanes.holders)):
                total = combine(total, buf[(p, h)])
            written[(s, p)] = total
    assert all(x == identity for row in running for x in row)  # nothing left unwritten
    return written


def check_tile_reduction(red, points, tile, rng):
    """``reduce_as_the_kernel`` against NumPy on a tile of small integers (sums exact), cut by
    M and N edges inside it, with a NaN for max and min; every position of the tile published
    once, those inside the edges (the ones ``target`` writes) with their totals."""
    data = rng.integers(-50, 50, tile).astype(np.float64)
    if red.kind != "sum":
        data[tile[0] // 3, tile[1] // 5] = np.nan
    extent = (tile[0] - 5, tile[1] - 3)
    inside = np.where((np.arange(tile[0])[:, None] < extent[0]) & (np.arange(tile[1]) < extent[1]), data,
                      {"sum": 0.0, "max": -np.inf, "min": np.inf}[red.kind])
    fold = {"sum": np.sum, "max": np.max, "min": np.min}[red.kind]
    written = reduce_as_the_kernel(red, points, data, extent)
    seen = []
    for (s, p), got in written.items():
        if red.over == ("m",):
            at = s // red.sub_m * red.run + red.spread(p)
            want = fold(inside[:, at])
        elif red.over == ("n",):
            at = s % red.sub_m * red.epi_m + p
            want = fold(inside[at, :])
        else:
            at, want = 0, fold(inside)
        seen.append(at)
        if at < (extent[1] if red.over == ("m",) else extent[0] if red.over == ("n",) else 1):  # else not written
            np.testing.assert_array_equal(got, want, err_msg=str((s, p)))
    assert sorted(seen) == list(range(tile[1] if red.over == ("m",) else tile[0] if red.over == ("n",) else 1))


WALKS = [  # (over, epilogue subtile, tile, epilogue threads)
    (("m",), (128, 32), (128, 128), 128), (("m",), (64, 16), (192, 128), 128),
    (("n",), (128, 32), (128, 192), 128), (("n",), (64, 32), (128, 128), 128),
    (("m", "n"), (128, 32), (128, 256), 256), (("n",), (128, 64), (256, 128), 256),
    (("m", "n"), (64, 16), (64, 256), 128), (("n",), (256, 64), (256, 128), 256),
    (("m",), (128, 64), (256, 128), 256),
]


@pytest.mark.parametrize("kind", ["sum", "max"])
@pytest.mark.parametrize("over, epi, tile, threads", WALKS)
def test_the_kernel_reduction_on_wgmma_fragments(rng, kind, over, epi, tile, threads):
    """On Hopper's accumulator layout: every value folds once, lanes and warps that share a
    position meet, each position is written once with its row's or column's total (masked at
    the M and N edges, NaN kept by max)."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.reduction import TileReduction, lane_map

    red = TileReduction(kind, over, epi, tile, threads)
    check_tile_reduction(red, wgmma_points(tile, epi, threads), tile, rng)
    lanes = lane_map(red, wgmma_points(tile, epi, threads))
    # WGMMA: the four lanes of a quad share a row, the eight quads a column; warps share columns
    assert lanes.shuffle == ((4, 8, 16) if over == ("m",) else (1, 2) if over == ("n",) else (1, 2, 4, 8, 16))
    assert len(lanes.holders) == (0 if over == ("n",) else threads.bit_length() - 1 - 5)


def test_a_layout_the_lane_map_cannot_read_fails_to_compile():
    """A layout whose values do not move with the thread's bits by one offset each is refused
    at trace time, not reduced wrongly."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.reduction import TileReduction, lane_map

    red = TileReduction("sum", ("m",), (64, 32), (64, 32), 128)
    good = wgmma_points((64, 32), (64, 32), 128)
    lane_map(red, good)
    with pytest.raises(RuntimeError, match="bits' offsets"):  # threads 5 and 6 trade values
        lane_map(red, lambda t: good({5: 6, 6: 5}.get(t, t)))
    with pytest.raises(RuntimeError, match="different offsets"):  # thread 1's values out of order
        lane_map(red, lambda t: [sub[::-1] for sub in good(t)] if t == 1 else good(t))


@pytest.mark.parametrize("over", [("m",), ("n",), ("m", "n")])
@pytest.mark.parametrize("cfg, m, n, k", [
    ((128, 128, 1, 2, {"pingpong": True, "epi_m": 64, "epi_n": 16}), 2296, 2824, 1288),  # 23 tile columns in 1x2
    ((256, 128, 2, 1, {"epi_m": 128}), 2296, 1000, 640),  # 9 tile rows in 2x1
    ((128, 128, 2, 2, {}), 1000, 3000, 512),
    ((128, 256, 2, 1, {"swizzle": 8}), 8192, 7936, 8192),  # stream-K: only the first piece of a tile writes
])
def test_every_partial_is_written_once_and_nothing_past_the_partials(over, cfg, m, n, k):
    """The per-tile partials each reducing output leaves: over the grid's walk (clusters cover a
    tile count rounded up to the cluster, so some tiles lie wholly past an edge), every position
    a tile writes (``TileReduction.target``) lies inside the partials' shape, and every partial
    is written exactly once, by the unit that runs its tile's epilogue."""
    pytest.importorskip("cutlass")
    from test_schedule import _walks

    from jax_efc.config import GemmConfig
    from jax_efc.kernels.problem import epilogue_tile
    from jax_efc.kernels.reduction import TileReduction

    config = GemmConfig(*cfg[:4], **cfg[4])
    threads = 128 * (1 if config.pingpong else min(config.tile_m // 64, 2))
    red = TileReduction("max", over, epilogue_tile(config), (config.tile_m, config.tile_n), threads)
    tiles_m, tiles_n = -(-m // config.tile_m), -(-n // config.tile_n)
    shape = (tiles_m if "m" in over else m, tiles_n if "n" in over else n)
    _, units, _, _ = _walks(config, m, n, k, 1, 66)
    written = []
    for ctas in units.values():
        for run in ctas.values():
            for u in run:
                if u.k_begin:  # a stream-K piece past k = 0 leaves its sums to the first piece
                    continue
                for s in range(red.n_sub):
                    if not red.closes(s):
                        continue
                    for p in range(red.positions):
                        at, writes = red.target(s, p, u.m, u.n, (m, n))
                        if writes:
                            assert 0 <= at[0] < shape[0] and 0 <= at[1] < shape[1], (u, s, p, at, shape)
                            written.append(at)
    assert len(written) == len(set(written)) == shape[0] * shape[1]


def _reduction_plan(monkeypatch, fn, m, n, k, unverified="1", **config):
    from jax_efc.config import GemmConfig
    from jax_efc.plan import plan_kernel

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", unverified)
    ir, *_ = trace_epilogue(fn, (m, n), [], [], {}, {}, None, jnp.bfloat16)
    gemm = split_at_reductions(ir).gemm
    specs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    return gemm, plan_kernel(gemm, *specs, [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                             config=GemmConfig(**config) if config else None, arch="sm_90a")


def test_the_kernel_plans_reductions(monkeypatch):
    """The Hopper kernel plans reductions (verified on a GPU: no first-use check), in subtiles
    of any shape; an epilogue of reductions alone runs on the reference, with the reason."""
    from jax_efc.kernels import policy

    fn = lambda acc: (acc, jnp.sum(acc, axis=0))  # noqa: E731
    _, plan = _reduction_plan(monkeypatch, fn, 4096, 4096, 4096, unverified="0")
    assert plan.backend == "kernel", plan.reason
    assert policy("sm_90a").unverified_reason(plan.problem) is None
    _, plan = _reduction_plan(monkeypatch, lambda acc: jnp.max(acc, axis=1), 4096, 4096, 4096)
    assert plan.backend == "reference" and "every output of the epilogue is a reduction" in plan.reason
    _, plan = _reduction_plan(monkeypatch, lambda acc: (acc, jnp.max(acc, axis=1)), 4096, 4096, 4096,
                              tile_m=192, tile_n=128, pingpong=True)
    assert plan.backend == "kernel", plan.reason


@pytest.mark.parametrize("fn", [
    lambda acc: (acc, jnp.sum(acc, axis=0), jnp.max(acc, axis=1), jnp.min(acc)),
    lambda acc: (jnp.max(jnp.abs(acc)), acc * 2, jnp.sum(acc * acc, axis=1)),
], ids=["sum-max-min", "amax-first"])
def test_the_launch_finishes_the_kernels_partials(monkeypatch, rng, fn):
    """The kernel leaves one fp32 partial per tile; the launch reduces them in XLA and puts
    every output back in the epilogue's order and shape. Partials made here from a tile output
    (M and N not multiples of the tile) come out as the oracle's reductions."""
    from jax_efc import ffi

    m, n = 300, 520
    gemm, plan = _reduction_plan(monkeypatch, fn, m, n, 256)
    assert plan.backend == "kernel", plan.reason
    cfg = plan.problem.config
    acc = rng.standard_normal((m, n)).astype(np.float32)
    tiles_m, tiles_n = -(-m // cfg.tile_m), -(-n // cfg.tile_n)
    def value(o):  # the fp32 value an output stores or reduces
        (v,) = evaluate(gemm.with_outputs([Output(o.name, o.value, "float32")]), jnp.asarray(acc), [])
        return np.asarray(v)

    results = [jnp.asarray(value(o))[None].astype(o.dtype) for o in gemm.outputs if not o.reduce]
    value = {o.name: value(o) for o in gemm.outputs if o.reduce}
    for o in gemm.outputs:
        if not o.reduce:
            continue
        red = REDUCE[o.reduce][1]
        v = value[o.name]
        blocks = [[v[i * cfg.tile_m:(i + 1) * cfg.tile_m, j * cfg.tile_n:(j + 1) * cfg.tile_n]
                   for j in range(tiles_n)] for i in range(tiles_m)]
        if o.over == ("m",):
            part = np.stack([np.concatenate([red(b, axis=0) for b in row]) for row in blocks])
        elif o.over == ("n",):
            part = np.concatenate([np.stack([red(b, axis=1) for b in row], axis=1) for row in blocks])
        else:
            part = np.array([[red(b) for b in row] for row in blocks])
        results.append(jnp.asarray(part, jnp.float32)[None])
    outs = ffi._finished(plan.problem, results)
    for o, got in zip(gemm.outputs, outs):
        if o.reduce:
            want = REDUCE[o.reduce][1](value[o.name], axis=tuple("mn".index(d) for d in o.over), keepdims=True)
            assert got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
        else:
            assert got.shape == (m, n)


def test_reductions_of_one_row_and_of_broadcast_values():
    """Found by the fuzzer: with M = 1 a sum over M is still a reduction ((N,), not an error),
    and a value the epilogue broadcast (a scalar, a column) reduces over the tile it was
    broadcast to."""
    a, b = jnp.ones((1, 3)), jnp.ones((3, 4))
    np.testing.assert_allclose(efc.gemm(a, b, lambda acc: jnp.sum(acc, axis=0)), np.full(4, 3.0))
    a = jnp.ones((5, 3))
    s = jnp.float32(2.0)
    got = efc.gemm(a, b, lambda acc, *, s: (acc, jnp.sum(jnp.broadcast_to(s, acc.shape), axis=0)), s=s)[1]
    np.testing.assert_allclose(got, np.full(4, 10.0))
    col = jnp.arange(5.0).reshape(5, 1)
    got = efc.gemm(a, b, lambda acc, c: (acc, jnp.sum(c * jnp.ones_like(acc), axis=0), jnp.sum(c, axis=0)), col)
    np.testing.assert_allclose(got[1], np.full(4, 10.0))
    assert got[2].shape == (1,)
    np.testing.assert_allclose(got[2], [10.0])
