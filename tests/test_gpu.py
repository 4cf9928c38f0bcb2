"""The public ops on the kernel path (an SM90 GPU): numerics against the reference, and
dispatch. JAX_EFC_STRICT makes any fallback an error, so a pass means the kernel ran."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import rel_err
from test_gemm import alpha_beta, complex_expr, multi_output

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("JAX_EFC_STRICT", "1")


def rand(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def tol(dtype):
    return 1e-2 if dtype == jnp.bfloat16 else 3e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cutlass_example_epilogues(rng, dtype):
    m, n, k = 512, 384, 256
    a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
    c, x, bias = rand(rng, (m, n), dtype), rand(rng, (m, n), dtype), rand(rng, (n,), dtype)
    acc = f64(a) @ f64(b)
    out = jax.jit(lambda *t: efc.gemm(*t[:2], alpha_beta, *t[2:], alpha=2.0, beta=1.0, x_factor=3.0,
                                      out_dtypes={"D": dtype, "Y": jnp.float32}))(a, b, c, x)
    assert efc.backends(lambda *t: efc.gemm(*t[:2], alpha_beta, *t[2:], alpha=2.0, beta=1.0, x_factor=3.0),
                        a, b, c, x) == ["kernel (sm_90a)"]
    assert rel_err(out["D"], 2 * acc + f64(c) + 3 * f64(x)) < tol(dtype)
    assert out["Y"].dtype == jnp.float32 and rel_err(out["Y"], acc) < 1e-5 * np.sqrt(k)
    relu = jax.jit(lambda a, b: efc.gemm(a, b, jax.nn.relu))(a, b)
    assert rel_err(relu, np.maximum(acc, 0)) < tol(dtype)
    d, d2, e = jax.jit(lambda a, b, c: efc.gemm(a, b, multi_output, c, out_dtypes=(dtype, jnp.float32, dtype)))(a, b, c)
    ref = acc + f64(c)
    assert rel_err(d, ref) < tol(dtype) and rel_err(d2, ref * ref) < tol(dtype)
    assert rel_err(e, np.exp(-np.abs(ref))) < tol(dtype)
    cx = jax.jit(lambda *t: efc.gemm(*t[:2], complex_expr, *t[2:], scale=0.5))(a, b, bias, c, x)
    want = jax.nn.gelu((acc + f64(bias)) * 0.5 + f64(c) + np.tanh(f64(x)))
    assert rel_err(cx, want) < tol(dtype)


@pytest.mark.parametrize("name", sorted(efc.ACTIVATIONS))
def test_activations(rng, name):
    x, w, bias = rand(rng, (2, 256, 512)), rand(rng, (512, 256), scale=0.05), rand(rng, (256,))
    y = jax.jit(lambda x, w, b: efc.fused_dense(x, w, b, activation=name))(x, w, bias)
    ref = efc.ACTIVATIONS[name](jnp.asarray(f64(x) @ f64(w) + f64(bias), jnp.float32))
    assert rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("name", sorted(efc.ACTIVATIONS))
def test_activations_elementwise_over_their_range(name):
    """Each output element is as exact as XLA's fp32 evaluation of the activation rounded to
    bf16, within one bf16 ulp and one fp32 rounding at the pre-activation's scale, for
    pre-activations from -9 to 9: the kernel's hardware approximations must not lose a tail.
    (Where an fp32 formula cancels, as ``1 + tanh`` deep in GELU's negative tail, no fp32
    evaluation does better than that rounding: there the kernel and XLA differ by luck.)"""
    m, n, k = 256, 128, 64
    grid = np.linspace(-9.0, 9.0, m).astype(jnp.bfloat16).astype(np.float64)
    # x @ w is the grid, exactly, whatever the rounding
    x = np.zeros((m, k))
    x[:, 0] = grid
    w = np.zeros((k, n))
    w[0] = 1.0
    x, w, bias = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.zeros((n,), jnp.bfloat16)
    y = jax.jit(lambda x, w, b: efc.fused_dense(x, w, b, activation=name, config=efc.GemmConfig()))(x, w, bias)
    fn = efc.ACTIVATIONS[name]
    pre = np.broadcast_to(grid[:, None], (m, n))
    xla = f64(jax.jit(lambda v: fn(v).astype(jnp.bfloat16))(jnp.asarray(pre, jnp.float32)))
    with jax.enable_x64(True):
        exact = np.asarray(fn(jnp.asarray(pre, jnp.float64)))
    err, xla_err = np.abs(f64(y) - exact), np.abs(xla - exact)
    bad = err > xla_err + 2.0**-7 * np.abs(exact) + 2.0**-24 * (1.0 + np.abs(pre))
    assert not bad.any(), (f"at pre-activation {pre[bad][0]}: {f64(y)[bad][0]} against {exact[bad][0]} "
                           f"(XLA's fp32: {xla[bad][0]})")


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_majors_and_batch(rng, ta, tb):
    L, M, N, K = 3, 256, 128, 192
    a = rand(rng, (L, K, M) if ta else (L, M, K))
    b = rand(rng, (L, N, K) if tb else (L, K, N))
    row, col = rand(rng, (N,)), rand(rng, (M, 1))
    out = jax.jit(lambda a, b, r, c: efc.gemm(a, b, lambda acc, r, c: jnp.tanh(acc + r) * c, r, c,
                                              transpose_a=ta, transpose_b=tb))(a, b, row, col)
    opa = np.swapaxes(f64(a), 1, 2) if ta else f64(a)
    opb = np.swapaxes(f64(b), 1, 2) if tb else f64(b)
    assert rel_err(out, np.tanh(opa @ opb + f64(row)) * f64(col)) < 1e-2


@pytest.mark.parametrize("mnk", [(1024, 1000, 1000), (1000, 1000, 1000), (4096, 4096, 4096), (128, 4096, 4096)])
def test_odd_and_large_shapes(rng, mnk, monkeypatch, caplog):
    m, n, k = mnk
    monkeypatch.delenv("JAX_EFC_STRICT")
    a, b, bias = rand(rng, (m, k)), rand(rng, (k, n), scale=k**-0.5), rand(rng, (n,))
    with caplog.at_level(logging.WARNING, logger="jax_efc"):
        y = jax.jit(lambda a, b, c: efc.fused_dense(a, b, c, activation="gelu_tanh"))(a, b, bias)
    backend = efc.backends(lambda a, b, c: efc.fused_dense(a, b, c, activation="gelu_tanh"), a, b, bias)[0]
    assert backend.startswith("kernel") or backend.startswith("reference: ")
    ref = jax.nn.gelu(jnp.asarray(f64(a) @ f64(b) + f64(bias), jnp.float32))
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(y, ref) < 1e-2


def test_short_gemms_go_to_xla_unless_strict(rng, monkeypatch, caplog):
    x, w, bias = rand(rng, (64, 512)), rand(rng, (512, 1024), scale=0.05), rand(rng, (1024,))
    ref = jax.nn.silu(jnp.asarray(f64(x) @ f64(w) + f64(bias), jnp.float32))

    def layer(x, w, b):
        return efc.fused_dense(x, w, b, activation="silu")

    assert efc.backends(layer, x, w, bias) == ["kernel (sm_90a)"]  # JAX_EFC_STRICT=1
    assert rel_err(jax.jit(layer)(x, w, bias), ref) < 1e-2
    monkeypatch.delenv("JAX_EFC_STRICT")
    (backend,) = efc.backends(layer, x, w, bias)
    assert backend.startswith("reference: 64 rows share each B")
    with caplog.at_level(logging.INFO, logger="jax_efc"):
        y = jax.jit(lambda x, w, b: layer(x, w, b))(x, w, bias)
    assert "64 rows share each B" in caplog.text
    assert rel_err(y, ref) < 1e-2


def test_dynamic_scalars_change_without_recompiling(rng):
    a, b, c = rand(rng, (256, 256)), rand(rng, (256, 256)), rand(rng, (256, 256))
    traces = []

    @jax.jit
    def f(a, b, c, alpha, beta):
        traces.append(1)
        return efc.gemm(a, b, lambda acc, c, *, alpha, beta: acc * alpha + c * beta, c, alpha=alpha, beta=beta)

    acc = f64(a) @ f64(b)
    for alpha, beta in [(1.0, 0.0), (-2.0, 0.5), (0.25, 3.0)]:
        y = f(a, b, c, jnp.float32(alpha), jnp.float32(beta))
        assert rel_err(y, alpha * acc + beta * f64(c)) < 1e-2
    assert len(traces) == 1


def test_grads_through_the_kernel(rng):
    x, w, bias = rand(rng, (512, 256)), rand(rng, (256, 384), scale=0.06), rand(rng, (384,))

    def loss(x, w, b):
        return jnp.sum(efc.fused_dense(x, w, b, activation="gelu_tanh").astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert all(s.startswith("kernel") for s in efc.backends(jax.grad(loss, argnums=(0, 1, 2)), x, w, bias))
    g = grad(x, w, bias)
    up = [jnp.asarray(t, jnp.float32) for t in (x, w, bias)]
    want = jax.grad(lambda x, w, b: jnp.sum(jax.nn.gelu(x @ w + b) ** 2), argnums=(0, 1, 2))(*up)
    for u, v in zip(g, want):
        assert rel_err(u, v) < 2e-2



@pytest.mark.parametrize("gated", [False, True], ids=["gelu_tanh", "gated_silu"])
def test_fused_mlp_output_and_grads_through_the_kernel(rng, gated):
    """Every GEMM of ``fused_mlp``'s forward and backward on the kernel, the backward's with
    the activation's derivative fused; the output and all gradients against float32 autodiff
    of the same MLP."""
    x = rand(rng, (512, 256))
    params = [rand(rng, (256, 384), scale=0.06), rand(rng, (384,)), rand(rng, (384, 128), scale=0.05),
              rand(rng, (128,))] + [rand(rng, (256, 384), scale=0.06), rand(rng, (384,))] * gated
    act = jax.nn.silu if gated else jax.nn.gelu

    def ours(x, *p):
        gate = dict(gate_kernel=p[4], gate_bias=p[5]) if gated else {}
        return efc.fused_mlp(x, *p[:4], activation="silu" if gated else "gelu_tanh", **gate)

    def plain(x, up_k, up_b, down_k, down_b, *gate):
        hidden = act(x @ up_k + up_b) if not gated else act(x @ gate[0] + gate[1]) * (x @ up_k + up_b)
        return hidden @ down_k + down_b

    ct = rand(rng, (512, 128))
    both = (x, *params)
    assert all(s.startswith("kernel") for s in efc.backends(lambda *a: jax.vjp(ours, *a)[1](ct), *both))
    y, pullback = jax.vjp(jax.jit(ours), *both)
    y_ref, pullback_ref = jax.vjp(plain, *[jnp.asarray(t, jnp.float32) for t in both])
    assert rel_err(y, y_ref) < 1e-2
    for i, (g, g_ref) in enumerate(zip(pullback(ct), pullback_ref(jnp.asarray(ct, jnp.float32)))):
        assert g.dtype == jnp.bfloat16 and rel_err(g, g_ref) < 1e-2, i

def test_one_device_shard_map_runs_the_kernel(rng):
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, bias = rand(rng, (256, 256)), rand(rng, (256, 256), scale=0.06), rand(rng, (256,))
    f = jax.jit(jax.shard_map(lambda x, w, b: efc.fused_dense(x, w, b, activation="silu"), mesh=mesh,
                              in_specs=(P("data"), P(), P()), out_specs=P("data")))
    hlo = f.lower(x, w, bias).as_text()
    assert "NvJaxCutlassCall" in hlo
    ref = jax.nn.silu(jnp.asarray(f64(x) @ f64(w) + f64(bias), jnp.float32))
    assert rel_err(f(x, w, bias), ref) < 1e-2


def test_unsupported_dtype_falls_back_and_says_why(rng, monkeypatch, caplog):
    monkeypatch.delenv("JAX_EFC_STRICT")
    # float32 at precision HIGHEST: the kernel multiplies float32 as TF32 only
    a, b = rand(rng, (64, 64), jnp.float32), rand(rng, (64, 64), jnp.float32)
    (reason,) = efc.backends(lambda a, b: efc.gemm(a, b, jnp.tanh, precision="highest"), a, b)
    assert reason.startswith("reference: ") and "float32 inputs at precision=HIGHEST" in reason
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    with pytest.raises(efc.FallbackError, match="float32"):
        jax.jit(lambda a, b: efc.gemm(a, b, jnp.sin, precision="highest"))(a, b)


def test_flax_training_on_the_kernel_matches_plain_flax(rng):
    nn = pytest.importorskip("flax.linen")
    from jax_efc.flax.linen import FusedMLP

    x = rand(rng, (512, 256))
    y = rand(rng, (512, 128))

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(512, name="up", dtype=jnp.bfloat16)(x))
            return nn.Dense(128, name="down", dtype=jnp.bfloat16)(h)

    fused = FusedMLP(512, 128, activation="gelu_tanh", dtype=jnp.bfloat16)
    params = Plain().init(jax.random.key(0), x)

    def losses(model):
        @jax.jit
        def step(p):
            loss, g = jax.value_and_grad(
                lambda p: jnp.mean((model.apply(p, x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2))(p)
            return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), loss

        p, out = params, []
        for _ in range(5):
            p, loss = step(p)
            out.append(float(loss))
        return np.array(out)

    assert all(s.startswith("kernel") for s in efc.backends(lambda p, x: fused.apply(p, x), params, x))
    ours, ref = losses(fused), losses(Plain())
    np.testing.assert_allclose(ours, ref, rtol=2e-2)
    assert ours[-1] < ours[0]



_CACHED_LAYER = """
import sys
import jax, jax.numpy as jnp, numpy as np
cache, inputs, out = sys.argv[1:]
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jax_efc as efc
x, w, b = (jnp.asarray(v, jnp.bfloat16) for v in np.load(inputs).values())
layer = lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu_tanh")
np.save(out, np.asarray(jax.jit(layer)(x, w, b), np.float32))
print(efc.backends(layer, x, w, b))
"""


def test_persistent_compilation_cache_round_trip(rng, tmp_path):
    """A second process finds the executable in JAX's persistent compilation cache: the
    kernel rides inside the custom call, so the cached program runs it and computes what the
    process that compiled it did."""
    x, w, bias = rand(rng, (512, 256)), rand(rng, (256, 384), scale=0.06), rand(rng, (384,))
    inputs, cache = tmp_path / "inputs.npz", tmp_path / "cache"
    np.savez(inputs, x=f64(x), w=f64(w), bias=f64(bias))
    outs, entries = [], []
    for run in range(2):
        out = tmp_path / f"y{run}.npy"
        proc = subprocess.run([sys.executable, "-c", _CACHED_LAYER, str(cache), str(inputs), str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "['kernel (sm_90a)']" in proc.stdout
        outs.append(np.load(out))
        entries.append(sorted(os.listdir(cache)))
    assert entries[0], "the first process wrote no cache entry"
    assert entries[1] == entries[0], "the second process compiled anew instead of reading the cache"
    np.testing.assert_array_equal(outs[1], outs[0])
    assert rel_err(outs[0], jax.nn.gelu(f64(x) @ f64(w) + f64(bias))) < tol(jnp.bfloat16)
