"""Reductions folded across the kernel's tiles by atomics (``gemm(deterministic=False)``), checked
without a GPU: the argument, the values on the reference (those of the deterministic mode), the
program the primitive receives, every key that decides a kernel, the first-use check, and the
launch's identity-filled results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_efc as efc
from jax_efc.epilogue import split_at_reductions
from jax_efc.primitive import fused_gemm, fused_gemm_eqns
from jax_efc.tracing import trace_epilogue


def _epilogue(acc, bias):
    y = jnp.tanh(acc * 0.25 + bias)
    return {"y": y, "cols": jnp.sum(y, axis=-2), "rows": jnp.max(y, axis=-1), "lo": jnp.min(acc, axis=(-2, -1)),
            "amax": jnp.max(jnp.abs(y)), "norm": y / jnp.linalg.norm(y)}


def _inputs(rng, m=77, n=45, k=24, batch=None):
    lead = () if batch is None else (batch,)
    a = jnp.asarray(rng.standard_normal((*lead, m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((*lead, k, n)), jnp.float32)
    return a, b, jnp.asarray(rng.standard_normal(n), jnp.float32)


def test_the_argument_is_validated(rng):
    a, b, bias = _inputs(rng)
    for bad in ("no", None, 2, jnp.bool_(False)):
        with pytest.raises(TypeError, match="deterministic must be a Python bool"):
            efc.gemm(a, b, _epilogue, bias, deterministic=bad)


def test_only_reductions_are_atomic(rng):
    a, b, _ = _inputs(rng)
    ir, *_ = trace_epilogue(lambda acc: acc, (77, 45), [], [], {}, {}, jnp.float32, jnp.float32)
    bad = ir.with_outputs([dataclasses.replace(ir.outputs[0], atomic=True)])
    with pytest.raises(ValueError, match="marked atomic but does not reduce"):
        fused_gemm(a, b, ir=bad)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_gemm_marks_its_reductions(rng, deterministic):
    """``deterministic=False`` marks what the GEMM reduces, and nothing else: its tile outputs,
    and what XLA computes past a reduction (the norm's division), are as they were."""
    a, b, bias = _inputs(rng)
    (eqn,) = fused_gemm_eqns(jax.make_jaxpr(lambda a, b, c: efc.gemm(a, b, _epilogue, c,
                                                                     deterministic=deterministic))(a, b, bias))
    outputs = eqn.params["ir"].outputs
    assert [o.atomic for o in outputs] == [bool(o.reduce) and not deterministic for o in outputs]
    assert sum(bool(o.reduce) for o in outputs) == 5  # four returned, and the norm's sum of squares


def test_the_reference_computes_the_same_values(rng):
    """On the reference both modes are one program: the same values, against the float64 oracle,
    with partial tiles, a batch, NaN and infinities."""
    a, b, bias = _inputs(rng, batch=2)
    a = a.at[1, 3, 2].set(jnp.nan).at[0, 5, 1].set(jnp.inf)
    det = efc.gemm(a, b, _epilogue, bias)
    fast = efc.gemm(a, b, _epilogue, bias, deterministic=False)
    for key in det:
        np.testing.assert_array_equal(np.asarray(det[key]), np.asarray(fast[key]), err_msg=key)
    with np.errstate(invalid="ignore"):  # inf * 0
        y = np.tanh(np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64)) * 0.25 + np.asarray(bias))
    want = {"cols": y.sum(-2), "rows": y.max(-1)}
    for key, w in want.items():
        got = np.asarray(fast[key], np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(w))
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(w), rtol=1e-5, atol=1e-4)


def test_gradients_vmap_and_sharding_are_unchanged(rng):
    a, b, bias = _inputs(rng, m=64, n=32, k=16)

    def loss(deterministic):
        def f(a, b, c):
            out = efc.gemm(a, b, _epilogue, c, deterministic=deterministic)
            return out["cols"].sum() + out["rows"].sum() + out["amax"] + out["norm"].sum()
        return f

    for got, want in zip(jax.grad(loss(False), argnums=(0, 1, 2))(a, b, bias),
                         jax.grad(loss(True), argnums=(0, 1, 2))(a, b, bias)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xs = jnp.stack([a, 2 * a])
    mapped = [jax.vmap(lambda x: efc.gemm(x, b, _epilogue, bias, deterministic=d)["cols"])(xs) for d in (False, True)]
    np.testing.assert_array_equal(*map(np.asarray, mapped))
    mesh = jax.make_mesh((4,), ("data",))
    sharded = jax.device_put(a, NamedSharding(mesh, P("data", None)))
    got = jax.jit(lambda a: efc.gemm(a, b, _epilogue, bias, deterministic=False))(sharded)
    want = efc.gemm(a, b, _epilogue, bias)
    for key in ("cols", "rows", "lo", "amax"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-5)


# The kernel's side, planned for sm_90a without a GPU --------------------------------------------

FN = lambda acc: (acc, jnp.sum(acc, axis=0), jnp.max(acc, axis=1), jnp.min(acc))  # noqa: E731


def _plans(monkeypatch, m=300, n=520, k=256, arch="sm_90a"):
    """The kernel's plans of ``FN``'s GEMM: deterministic, then by atomics."""
    pytest.importorskip("cutlass")
    from jax_efc.plan import plan_kernel

    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    ir, *_ = trace_epilogue(FN, (m, n), [], [], {}, {}, None, jnp.bfloat16)
    gemm = split_at_reductions(ir).gemm
    atomic = gemm.with_outputs([dataclasses.replace(o, atomic=bool(o.reduce)) for o in gemm.outputs])
    specs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    plans = [plan_kernel(g, *specs, [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=None,
                         arch=arch) for g in (gemm, atomic)]
    assert all(p.backend == "kernel" for p in plans), [p.reason for p in plans]
    return plans


def test_every_key_that_decides_the_kernel_tells_the_modes_apart(monkeypatch):
    from jax_efc import autotune, ffi, self_check

    det, fast = _plans(monkeypatch)
    assert det.problem != fast.problem and det.problem.config == fast.problem.config
    assert det.problem.compile_key != fast.problem.compile_key
    gpu = ("NVIDIA H100 80GB HBM3", 132)
    assert autotune.record_key(det, gpu) != autotune.record_key(fast, gpu)
    assert self_check._key(det, gpu) != self_check._key(fast, gpu)
    assert ffi._kernel(det, False)[0] != ffi._kernel(fast, False)[0]


def test_atomic_reductions_are_checked_on_first_use(monkeypatch):
    """Where no GPU of the kind has run them they check themselves first: on Hopper while the
    policy says so, on Blackwell once all else has run there. Planned without a GPU (an
    export), the call then takes the reference and says why."""
    from jax_efc.kernels import policy
    from jax_efc.kernels.sm90_policy import Sm90Policy
    from jax_efc.kernels.sm100_policy import Sm100Policy

    det, fast = _plans(monkeypatch)
    assert policy("sm_90a").unverified_reason(det.problem) is None
    assert policy("sm_90a").unverified_reason(fast.problem) is None
    monkeypatch.setattr(Sm90Policy, "verified_atomic_reductions", False)
    assert policy("sm_90a").unverified_reason(det.problem) is None
    assert policy("sm_90a").unverified_reason(fast.problem) == \
        "the sm_90a kernel's epilogue reductions folded across tiles by atomics"
    monkeypatch.setattr(Sm100Policy, "unverified_ab_dtypes", ())
    monkeypatch.setattr(Sm100Policy, "verified_reductions", True)
    det, fast = _plans(monkeypatch, arch="sm_100a")
    assert policy("sm_100a").unverified_reason(det.problem) is None
    assert policy("sm_100a").unverified_reason(fast.problem) == \
        "the sm_100a kernel's epilogue reductions folded across tiles by atomics"

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)

    def fn(deterministic):
        return lambda a, b: efc.gemm(a, b, lambda acc: (acc, jnp.sum(acc, 0)), deterministic=deterministic)

    assert efc.backends(fn(True), spec, spec) == ["kernel (sm_90a)"]
    (why,) = efc.backends(fn(False), spec, spec)
    assert why.startswith("reference: not yet run on a GPU of its kind: the sm_90a kernel's epilogue reductions "
                          "folded across tiles by atomics; there is no sm_90a GPU here"), why
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    assert efc.backends(fn(False), spec, spec) == ["kernel (sm_90a)"]
    monkeypatch.undo()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "0")
    assert efc.backends(fn(False), spec, spec) == ["kernel (sm_90a)"]  # verified: the export holds it


def test_the_launch_starts_each_result_at_its_identity(monkeypatch):
    """Folded by atomics, a reduction's result is an input of the kernel aliased to its output,
    filled with the reduction's identity before the kernel runs (its CTAs cannot know which comes
    first), one value along the axes it reduces; the launch then only converts it."""
    pytest.importorskip("cutlass.jax")
    from jax_efc import ffi

    det, fast = _plans(monkeypatch)
    m, n, k, _ = fast.mnkl
    a, b = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    call = ffi._assemble(fast, a, b, (), False)
    assert len(call.inputs) == 2 + 3 and call.aliases == {2: 1, 3: 2, 4: 3}
    for x, fill, shape in zip(call.inputs[2:], (0.0, -np.inf, np.inf), ((1, 1, n), (1, m, 1), (1, 1, 1))):
        assert x.shape == shape and x.dtype == jnp.float32 and (np.asarray(x) == fill).all()
    assert [tuple(s.shape) for s in call.out_shapes] == [(1, m, n), (1, 1, n), (1, m, 1), (1, 1, 1)]
    # deterministic: per-tile partials, with no inputs past A and B
    tiles = -(-m // det.config.tile_m), -(-n // det.config.tile_n)
    call = ffi._assemble(det, a, b, (), False)
    assert len(call.inputs) == 2 and call.aliases == {}
    assert [tuple(s.shape) for s in call.out_shapes] == [(1, m, n), (1, tiles[0], n), (1, m, tiles[1]),
                                                         (1, tiles[0], tiles[1])]
    results = [jnp.ones((1, m, n), jnp.bfloat16), jnp.full((1, 1, n), 2.0), jnp.full((1, m, 1), 3.0),
               jnp.full((1, 1, 1), 4.0)]
    outs = ffi._finished(fast.problem, results)
    assert [o.shape for o in outs] == [(m, n), (1, n), (m, 1), (1, 1)]
    assert [float(o.ravel()[0]) for o in outs[1:]] == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("over", [("m",), ("n",), ("m", "n")])
@pytest.mark.parametrize("cfg, m, n, k, split", [
    ((128, 128, 1, 2, {"pingpong": True, "epi_m": 64, "epi_n": 16}), 2296, 2824, 1288, False),  # 23 tile columns in 1x2
    ((256, 128, 2, 1, {"epi_m": 128}), 2296, 1000, 640, False),  # 9 tile rows in 2x1
    ((128, 256, 2, 1, {"swizzle": 8}), 8192, 7936, 8192, True),  # stream-K: a tile's first piece runs its epilogue
])
def test_every_tile_folds_into_each_result_once(over, cfg, m, n, k, split):
    """Over the grid's walk (clusters cover a tile count rounded up to the cluster, so some tiles
    lie wholly past an edge; stream-K splits tiles into pieces), each value of a result folded by
    atomics receives exactly one fold from every tile along the axes it reduces, and nothing
    lands outside it."""
    pytest.importorskip("cutlass")
    from collections import Counter

    from test_schedule import _walks

    from jax_efc.config import GemmConfig
    from jax_efc.kernels.problem import epilogue_tile
    from jax_efc.kernels.reduction import TileReduction

    config = GemmConfig(*cfg[:4], **cfg[4])
    threads = 128 * (1 if config.pingpong else min(config.tile_m // 64, 2))
    red = TileReduction("sum", over, epilogue_tile(config), (config.tile_m, config.tile_n), threads, atomic=True)
    tiles_m, tiles_n = -(-m // config.tile_m), -(-n // config.tile_n)
    shape = (1 if "m" in over else m, 1 if "n" in over else n)
    folds, pieces = Counter(), 0
    for ctas in _walks(config, m, n, k, 1, 66)[1].values():
        for run in ctas.values():
            for u in run:
                if u.k_begin:  # a stream-K piece past k = 0 leaves its sums to the first piece
                    pieces += 1
                    continue
                for s in (s for s in range(red.n_sub) if red.closes(s)):
                    for p in range(red.positions):
                        at, writes = red.target(s, p, u.m, u.n, (m, n))
                        if writes:
                            assert 0 <= at[0] < shape[0] and 0 <= at[1] < shape[1], (u, s, p, at, shape)
                            folds[at] += 1
    assert (pieces > 0) == split
    per_value = (tiles_m if "m" in over else 1) * (tiles_n if "n" in over else 1)
    assert len(folds) == shape[0] * shape[1] and set(folds.values()) == {per_value}
