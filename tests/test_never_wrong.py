"""Inputs that once gave a silently wrong answer or a raw internal error: each now gives the
right answer or an error that names the argument and what it may be."""

from __future__ import annotations

import math
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import rel_err
from jax_efc import plan, primitive
from jax_efc.epilogue import identity_ir


def arrays(rng, *shapes, dtype=jnp.float32):
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


# 1. an epilogue's trace follows the Python state it reads --------------------------------

def test_a_changed_closure_gives_the_new_result(rng):
    a, b, bias = arrays(rng, (16, 8), (8, 12), (12,))
    scale = [1.0]

    class Layer:
        shift = 0.0

        def __call__(self, acc):
            return acc * scale[0] + self.shift

    layer = Layer()
    first = efc.gemm(a, b, layer)
    scale[0], Layer.shift = 3.0, 2.0
    np.testing.assert_allclose(efc.gemm(a, b, layer), 3.0 * first + 2.0, rtol=1e-5, atol=1e-5)

    def act(x):
        return jnp.tanh(x) * scale[0]

    y1 = efc.fused_dense(a, b, bias, activation=act)
    scale[0] = -1.0
    y2 = efc.fused_dense(a, b, bias, activation=act)
    np.testing.assert_allclose(y2, -y1 / 3.0, rtol=1e-5, atol=1e-6)


# 2, 3. dtypes at every entry point ---------------------------------------------------------

def test_mixed_input_dtypes_are_refused_at_every_entry_point(rng):
    a, b = arrays(rng, (16, 8), (8, 12))
    ir = identity_ir(jnp.float32)
    for a_, b_ in ((a.astype(jnp.bfloat16), b.astype(jnp.float16)), (a.astype(jnp.bfloat16), b)):
        with pytest.raises(TypeError, match=f"a is {a_.dtype} but b is {b_.dtype}"):
            efc.gemm(a_, b_)
        with pytest.raises(TypeError, match=f"a is {a_.dtype} but b is {b_.dtype}"):
            primitive.fused_gemm(a_, b_, ir=ir)
        with pytest.raises(TypeError, match=f"a is {a_.dtype} but b is {b_.dtype}"):
            jax.jit(lambda x, y: primitive.fused_gemm(x, y, ir=ir))(a_, b_)
        with pytest.raises(TypeError, match=f"a is {a_.dtype} but b is {b_.dtype}"):
            plan.plan_kernel(ir, a_, b_, [], transpose_a=False, transpose_b=False, acc_dtype=jnp.float32,
                             config=None, arch="sm_90a")
    with pytest.raises(TypeError, match="x is bfloat16 but kernel is float32"):
        efc.fused_dense(a.astype(jnp.bfloat16), b)


@pytest.mark.parametrize("acc", [jnp.int32, jnp.bool_, jnp.bfloat16, jnp.int8])
def test_acc_dtype_must_accumulate_floats(rng, acc):
    a, b = arrays(rng, (16, 8), (8, 12))
    with pytest.raises(TypeError, match=r"acc_dtype=\w+ cannot accumulate float32 inputs; allowed: float32"):
        efc.gemm(a, b, acc_dtype=acc)
    with pytest.raises(TypeError, match="acc_dtype"):
        primitive.fused_gemm(a, b, ir=identity_ir(jnp.float32), acc_dtype=acc)


def test_acc_dtype_float16_for_float16_inputs(rng):
    a, b = arrays(rng, (16, 8), (8, 12), dtype=jnp.float16)
    got = efc.gemm(a, b, acc_dtype=jnp.float16)
    want = jnp.matmul(a, b, preferred_element_type=jnp.float16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="allowed: float32, float64"):
        efc.gemm(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), acc_dtype=jnp.float16)


# 4. float64 all the way through the gradient -----------------------------------------------

def test_float64_gradients_are_float64_accurate(rng):
    with jax.enable_x64(True):
        a, b, bias, c = arrays(rng, (24, 16), (16, 20), (20,), (24, 20), dtype=jnp.float64)

        def fused(a, b, bias, c):
            y = efc.gemm(a, b, lambda acc, bias, c, *, s: jnp.tanh(acc + bias) * c * s, bias, c, s=0.7)
            return jnp.sum(y ** 2)

        def plain(a, b, bias, c):
            return jnp.sum((jnp.tanh(a @ b + bias) * c * 0.7) ** 2)

        got = jax.grad(fused, argnums=(0, 1, 2, 3))(a, b, bias, c)
        want = jax.grad(plain, argnums=(0, 1, 2, 3))(a, b, bias, c)
        for g, w in zip(got, want):
            assert g.dtype == jnp.float64
            assert rel_err(g, w) < 1e-12
        for fn in (lambda x, w: efc.fused_dense(x, w, bias, activation="gelu"),):
            g = jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), (0, 1))(a, b)
            w = jax.grad(lambda x, w: jnp.sum(jax.nn.gelu(x @ w + bias, approximate=False) ** 2), (0, 1))(a, b)
            assert all(rel_err(u, v) < 1e-12 for u, v in zip(g, w))


def test_64_bit_dtypes_without_x64_are_refused(rng):
    a, b = arrays(rng, (16, 8), (8, 12))
    with pytest.raises(TypeError, match="float64 needs 64-bit types.*jax_enable_x64"):
        efc.gemm(a, b, out_dtypes=jnp.float64)
    with pytest.raises(TypeError, match="float64 needs 64-bit types"):
        efc.gemm(a, b, acc_dtype=jnp.float64)


# 5. static scalars that == cannot tell apart -----------------------------------------------

def test_signed_zeros_and_nan_scalars_are_distinct_programs(rng):
    a, b = arrays(rng, (16, 8), (8, 12))
    acc = np.asarray(a @ b)
    scaled = lambda acc, *, s: acc * s  # noqa: E731
    plus = np.asarray(efc.gemm(a, b, scaled, s=0.0))
    minus = np.asarray(efc.gemm(a, b, scaled, s=-0.0))
    again = np.asarray(efc.gemm(a, b, scaled, s=0.0))
    np.testing.assert_array_equal(np.signbit(plus), np.signbit(acc))
    np.testing.assert_array_equal(np.signbit(minus), ~np.signbit(acc))
    np.testing.assert_array_equal(np.signbit(again), np.signbit(acc))
    assert np.isnan(np.asarray(efc.gemm(a, b, lambda acc, *, s: acc + s, s=float("nan")))).all()
    assert np.isfinite(np.asarray(efc.gemm(a, b, lambda acc, *, s: acc + s, s=1.0))).all()

    from jax_efc.tracing import trace_epilogue

    def ir(s):
        return trace_epilogue(scaled, (16, 12), [], [], {"s": s}, {}, None, jnp.float32)[0]

    assert ir(0.0) != ir(-0.0) and ir(0.0).fingerprint != ir(-0.0).fingerprint
    assert ir(float("nan")) == ir(float("nan")) and hash(ir(float("nan"))) == hash(ir(float("nan")))
    assert ir(1) == ir(1.0)  # one float32 constant either way


# 7. empty problems on the reference path, forward and backward -----------------------------

@pytest.mark.parametrize("m, k, n", [(0, 8, 12), (16, 0, 12), (16, 8, 0)])
def test_empty_problems(rng, m, k, n):
    x, w, bias = arrays(rng, (m, k), (k, n), (n,))
    y = efc.fused_dense(x, w, bias, activation="gelu")
    np.testing.assert_allclose(y, jax.nn.gelu(x @ w + bias, approximate=False), atol=1e-6)
    grads = jax.grad(lambda *a: efc.fused_dense(*a, activation="gelu").sum(), (0, 1, 2))(x, w, bias)
    want = jax.grad(lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=False).sum(), (0, 1, 2))(x, w, bias)
    for g, v in zip(grads, want):
        assert g.shape == v.shape
        np.testing.assert_allclose(g, v, atol=1e-6)
    assert efc.gemm(jnp.ones((0, m, k)), jnp.ones((0, k, n))).shape == (0, m, n)


# 10. a batched A against a 2-D B reads B once ----------------------------------------------

def _broadcasts(jaxpr) -> list:
    return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "broadcast_in_dim"]


def test_batched_a_with_shared_b_folds_the_batch_into_m(rng):
    a, b, c, col = arrays(rng, (3, 16, 8), (8, 12), (3, 16, 12), (3, 16, 1))
    bias = jnp.asarray(rng.standard_normal(12), jnp.float32)
    fn = lambda acc, c, col, bias: acc * col + c + bias  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda *x: efc.gemm(*x[:2], fn, *x[2:]))(a, b, c, col, bias)
    (eqn,) = primitive.fused_gemm_eqns(jaxpr)
    assert eqn.invars[0].aval.shape == (48, 8) and eqn.invars[1].aval.shape == (8, 12)
    assert not _broadcasts(jaxpr)
    want = (a @ b) * col + c + bias
    np.testing.assert_allclose(efc.gemm(a, b, fn, c, col, bias), want, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda a, b: efc.gemm(a, b, fn, c, col, bias).sum(), (0, 1))(a, b)
    w = jax.grad(lambda a, b: ((a @ b) * col + c + bias).sum(), (0, 1))(a, b)
    assert all(rel_err(u, v) < 1e-6 for u, v in zip(g, w))
    # a per-batch row vector cannot fold: B is shared by broadcasting, and the answer holds
    rows = jnp.asarray(rng.standard_normal((3, 1, 12)), jnp.float32)
    np.testing.assert_allclose(efc.gemm(a, b, lambda acc, r: acc + r, rows), a @ b + rows, rtol=1e-5, atol=1e-5)
    at = jnp.swapaxes(a, 1, 2)
    np.testing.assert_allclose(efc.gemm(at, b, transpose_a=True), a @ b, rtol=1e-5, atol=1e-5)


# 11. past 32-bit indexing the kernel is not asked -------------------------------------------

def test_tensors_past_32_bit_indexing_are_refused_by_the_kernel():
    pytest.importorskip("cutlass")
    ir = identity_ir(jnp.bfloat16)
    kw = dict(transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=None, arch="sm_90a")
    big = jax.ShapeDtypeStruct((65536, 32768), jnp.bfloat16)  # 2^31 elements
    why = plan.plan_kernel(ir, big, jax.ShapeDtypeStruct((32768, 256), jnp.bfloat16), [], **kw).reason
    assert why is not None and "32-bit indexing" in why and "A would hold 2147483648" in why
    small = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    assert plan.plan_kernel(ir, small, small, [], **kw).backend == "kernel"


# 12. arguments of the wrong kind -----------------------------------------------------------

def test_wrong_kinds_of_argument_are_named(rng):
    a, b = arrays(rng, (16, 8), (8, 12))
    cases = [
        (dict(transpose_a=jnp.array(True)), "transpose_a must be a Python bool"),
        (dict(recompute_acc="yes"), "recompute_acc must be a Python bool"),
        (dict(out_dtypes=jnp.ones(3)), "out_dtypes must be a dtype, got an array"),
        (dict(out_dtypes="bogus"), "out_dtypes must be a dtype"),
        (dict(out_dtypes=jnp.complex64), "out_dtypes must be a real numeric dtype"),
        (dict(epi_dtype=jnp.int32), "epi_dtype must be a floating dtype"),
        (dict(config=(128, 128)), "config must be a jax_efc.GemmConfig, 'autotune' or None"),
        (dict(precision="bogus"), "precision must be None, a jax.lax.Precision"),
    ]
    for kwargs, message in cases:
        with pytest.raises(TypeError, match=message):
            efc.gemm(a, b, **kwargs)
    with pytest.raises(TypeError, match="transpose_b must be a Python bool"):
        jax.jit(lambda a, b, t: efc.gemm(a, b, transpose_b=t))(a, b, False)
    with pytest.raises(TypeError, match="scalar 's' is complex"):
        efc.gemm(a, b, lambda acc, *, s: acc * s, s=1 + 2j)
    with pytest.raises(TypeError, match="scalar 's' is complex"):
        efc.gemm(a, b, lambda acc, *, s: acc * s, s=jnp.asarray(1 + 2j))
    with pytest.raises(TypeError, match="scalar 's' must be an array, got str"):
        efc.gemm(a, b, lambda acc, *, s: acc * s, s="2")
    with pytest.raises(TypeError, match="epilogue must be a callable"):
        efc.gemm(a, b, "gelu")
    with pytest.raises(TypeError, match="epilogue operand 0 must be an array, got NoneType"):
        efc.gemm(a, b, lambda acc, c: acc, None)
    with pytest.raises(TypeError, match="activation must be a name, a callable or None"):
        efc.fused_dense(a, b, activation=jnp.ones(3))
    assert np.isfinite(np.asarray(efc.gemm(a, b, precision="highest"))).all()
    assert np.isfinite(np.asarray(efc.gemm(a, b, precision=(jax.lax.Precision.HIGH, "highest")))).all()


# 13. second order --------------------------------------------------------------------------

def test_hessians_of_gemm_fused_dense_and_fused_mlp_match_plain_jax(rng):
    x, w, bias, w2, b2 = arrays(rng, (6, 4), (4, 5), (5,), (5, 3), (3,))
    c = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    cases = [
        (lambda x, w: efc.gemm(x, w, lambda acc, c, *, s: jnp.tanh(acc) * c + s * acc * acc, c, s=0.5),
         lambda x, w: jnp.tanh(x @ w) * c + 0.5 * (x @ w) ** 2),
        (lambda x, w: efc.fused_dense(x, w, bias, activation="gelu"),
         lambda x, w: jax.nn.gelu(x @ w + bias, approximate=False)),
        (lambda x, w: efc.gemm(w, x, transpose_a=True, transpose_b=True).T ** 2,
         lambda x, w: (x @ w) ** 2),
        (lambda x, w: efc.fused_mlp(x, w, bias, w2, b2, activation="silu"),
         lambda x, w: jax.nn.silu(x @ w + bias) @ w2 + b2),
        (lambda x, w: efc.fused_mlp(x, w, bias, w2, b2, activation="gelu_tanh", gate_kernel=w, gate_bias=bias),
         lambda x, w: (jax.nn.gelu(x @ w + bias) * (x @ w + bias)) @ w2 + b2),
    ]
    for fused, plain in cases:
        for f in (fused, plain):
            f.loss = lambda x, w, f=f: jnp.sum(jnp.sin(f(x, w)))
        hess = jax.jacrev(jax.jacrev(fused.loss, (0, 1)), (0, 1))(x, w)
        want = jax.jacrev(jax.jacrev(plain.loss, (0, 1)), (0, 1))(x, w)
        for got_row, want_row in zip(hess, want):
            for got, ref in zip(got_row, want_row):
                assert rel_err(got, ref) < 1e-4
        v = arrays(rng, x.shape)[0]
        hvp = jax.grad(lambda x: jnp.vdot(jax.grad(fused.loss)(x, w), v))(x)
        assert rel_err(hvp, jax.grad(lambda x: jnp.vdot(jax.grad(plain.loss)(x, w), v))(x)) < 1e-4


def test_forward_mode_says_what_to_use_instead(rng):
    x, w = arrays(rng, (4, 8), (8, 8))
    with pytest.raises(TypeError, match="reverse mode only.*VJP of the VJP"):
        jax.jvp(lambda x: efc.fused_dense(x, w), (x,), (x,))
    # the recipe the message gives is right
    t = arrays(rng, x.shape)[0]
    y, vjp = jax.vjp(lambda x: efc.fused_dense(x, w, activation="tanh"), x)
    jvp = jax.vjp(vjp, y)[1]((t,))[0]
    np.testing.assert_allclose(jvp, jax.jvp(lambda x: jnp.tanh(x @ w), (x,), (t,))[1], rtol=1e-5, atol=1e-6)


# 14. bounded caches, private cache directory -----------------------------------------------

def _problem(cfg):
    from jax_efc.kernels import KernelProblem

    return KernelProblem(ir=identity_ir(jnp.bfloat16), ab_dtype="bfloat16", acc_dtype="float32",
                         a_major="k", b_major="n", batched=False, a_batched=False, b_batched=False,
                         operand_batched=(), arch="sm_90a", config=cfg)


def test_the_kernel_cache_is_bounded(monkeypatch):
    pytest.importorskip("cutlass")
    from jax_efc import ffi
    from jax_efc.kernels.schedule import plan_schedule

    built = []

    class Fake:
        def __init__(self, problem, schedule, timeline):
            built.append(problem)
            self.schedule = schedule

    import jax_efc.kernels.sm90 as sm90

    monkeypatch.setattr(sm90, "Sm90FusedGemm", Fake)
    monkeypatch.setattr(ffi, "KERNEL_CACHE_SIZE", 3)
    monkeypatch.setattr(ffi, "_KERNELS", type(ffi._KERNELS)())
    mnkl = (1024, 1024, 1024, 1)
    for tile_n in (64, 128, 192, 256, 64):
        cfg = efc.GemmConfig(tile_n=tile_n)
        ffi._kernel(plan.Plan("kernel", arch="sm_90a", problem=_problem(cfg), mnkl=mnkl,
                              schedule=plan_schedule(cfg, *mnkl, 132, 64)), False)
    assert len(ffi._KERNELS) == 3 and len(built) == 5  # 64 was evicted, then built again


def test_the_cache_directory_is_private(tmp_path, monkeypatch):
    from jax_efc.config import private_cache_dir

    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path / "efc"))
    path = private_cache_dir("cute_dsl")
    assert path == str(tmp_path / "efc" / "cute_dsl")
    for p in (path, os.path.dirname(path)):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
    os.chmod(path, 0o755)
    private_cache_dir("cute_dsl")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    os.symlink(tmp_path, tmp_path / "efc" / "planted")
    with pytest.raises(PermissionError, match="link or another user's"):
        private_cache_dir("planted")


def test_the_dsl_cache_goes_to_the_private_directory(tmp_path, monkeypatch):
    from jax_efc import device

    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUTE_DSL_CACHE_DIR", raising=False)
    device.use_private_dsl_cache()
    assert os.environ["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cute_dsl")
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", "/somewhere/else")
    device.use_private_dsl_cache()
    assert os.environ["CUTE_DSL_CACHE_DIR"] == "/somewhere/else"


# 9. the persistent grid and its residency --------------------------------------------------

def test_residency_is_measured_on_the_devices_the_call_runs_on(monkeypatch):
    from jax_efc import device

    answers = {(1, 0): 132, (1, 1): 66, (2, 0): 66, (2, 1): None}
    monkeypatch.setattr(device, "_measured_clusters", lambda size, ordinal: answers[size, ordinal])
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    assert device.residency(1, (0,), 120) == (132, True)
    assert device.residency(1, (0, 1), 120) == (66, True)  # the smallest device decides
    assert device.residency(2, (0, 1), 60) == (60, False)  # one device unknown: the assumed grid
    assert device.residency(1, (), 120) == (120, False)  # exporting: not known
    assert device.residency(1, None, 120) == (132, True)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert device.residency(1, (0,), 120) == (120, False)


def test_no_stream_k_without_known_residency():
    pytest.importorskip("cutlass")
    cfg = efc.GemmConfig(128, 128, 1, 2, pingpong=True, swizzle=8)
    spec = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)

    def schedule(devices):
        return plan.plan_kernel(identity_ir(jnp.bfloat16), spec, spec, [], transpose_a=False, transpose_b=False,
                                acc_dtype=jnp.float32, config=cfg, arch="sm_90a", devices=devices).schedule

    assert schedule(None).stream_k is not None
    assert schedule(()).stream_k is None
    assert math.isfinite(schedule(()).clusters)


def test_float64_inputs_planned_for_a_gpu_fall_back_with_the_reason(monkeypatch):
    """float64 GEMMs planned for the kernel's architecture: the reference, saying the kernel takes
    no float64 (the plan used to read the dtype's width before asking, and crashed)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with jax.enable_x64(True):
        spec = jax.ShapeDtypeStruct((256, 256), jnp.float64)
        (why,) = efc.backends(lambda a, b: efc.gemm(a, b), spec, spec)
    assert why.startswith("reference: A/B dtype float64 is not supported"), why
