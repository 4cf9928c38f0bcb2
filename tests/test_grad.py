"""Gradients through gemm and fused_dense against jax.grad of the same math in plain JAX."""

import jax
import jax.numpy as jnp
import pytest

import jax_efc as efc
from conftest import rel_err
from jax_efc.primitive import fused_gemm_eqns
from test_gemm import alpha_beta, complex_expr, multi_output


def arrays(rng, *shapes):
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def check_grads(ours, plain, args, tol=1e-5):
    """Compare grads of a scalar loss (a random projection of every output) for all args."""
    argnums = tuple(range(len(args)))
    g_ours = jax.grad(ours, argnums)(*args)
    g_ref = jax.grad(plain, argnums)(*args)
    for i, (u, v) in enumerate(zip(g_ours, g_ref)):
        assert u.shape == v.shape, i
        assert rel_err(u, v) < tol, (i, rel_err(u, v))


def loss(tree, seed=0):
    leaves = jax.tree.leaves(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return sum(jnp.sum(x.astype(jnp.float32) * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys))


@pytest.mark.parametrize("recompute", [False, True])
def test_alpha_beta_grads(rng, recompute):
    a, b, c, x = arrays(rng, (32, 24), (24, 40), (32, 40), (32, 40))

    def ours(a, b, c, x, beta):
        return loss(efc.gemm(a, b, alpha_beta, c, x, alpha=2.0, beta=beta, x_factor=3.0,
                             recompute_acc=recompute))

    def plain(a, b, c, x, beta):
        return loss(alpha_beta(a @ b, c, x, alpha=2.0, beta=beta, x_factor=3.0))

    check_grads(ours, plain, (a, b, c, x, jnp.float32(0.7)))


@pytest.mark.parametrize("recompute", [False, True])
def test_complex_grads_with_vectors(rng, recompute):
    a, b, bias, c, x = arrays(rng, (32, 24), (24, 40), (40,), (32, 40), (32, 40))
    col = arrays(rng, (32, 1))[0]

    def ours(a, b, bias, c, x, col, scale):
        y = efc.gemm(a, b, lambda acc, bias, c, x, col, *, scale: complex_expr(acc, bias, c, x, scale=scale) * col,
                     bias, c, x, col, scale=scale, recompute_acc=recompute)
        return loss(y)

    def plain(a, b, bias, c, x, col, scale):
        return loss(complex_expr(a @ b, bias, c, x, scale=scale) * col)

    check_grads(ours, plain, (a, b, bias, c, x, col, jnp.float32(0.5)))


@pytest.mark.parametrize("m", [16, 300, 384])
def test_batched_grads_with_mixed_operands(rng, m):
    """Tiles, shared and per-batch vectors and scalars interleaved: each cotangent reaches its
    operand (the backward takes the tiles' and the summed ones' from separate VJPs, the sums
    over 16 rows in one, over 300 and 384 rows in partials of 100 and 128)."""
    a, b, c, bias, x, col, shift, gain = arrays(
        rng, (2, m, 24), (2, 24, 40), (2, m, 40), (2, 1, 40), (2, m, 40), (2, m, 1), (40,), (2, 1, 1))

    def epilogue(acc, c, bias, x, col, shift, gain, *, scale):
        return {"y": jnp.tanh(acc * scale + bias) * col + c * x + shift,
                "z": jax.nn.sigmoid(acc + x) * bias * gain}

    def ours(a, b, c, bias, x, col, shift, gain, scale):
        return loss(efc.gemm(a, b, epilogue, c, bias, x, col, shift, gain, scale=scale))

    def plain(a, b, c, bias, x, col, shift, gain, scale):
        return loss(epilogue(a @ b, c, bias, x, col, shift, gain, scale=scale))

    check_grads(ours, plain, (a, b, c, bias, x, col, shift, gain, jnp.float32(0.8)))


@pytest.mark.parametrize("m, partials", [(512, 4), (1000, 8), (4100, 41), (1009, None)])
def test_bias_gradient_summed_in_partials(rng, m, partials):
    """A bias's gradient is summed in partials of the divisor of M nearest to 128 rows (128,
    125, 100; none for a prime M, summed at once), kept apart from the final sum (XLA fuses
    such partial sums with the derivative)."""
    x, w, bias = arrays(rng, (m, 16), (16, 24), (24,))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w, bias: loss(efc.fused_dense(x, w, bias, activation="gelu")),
                                    (0, 1, 2)))(x, w, bias)
    shapes = [v.aval.shape for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier"
              for v in e.invars]
    assert [s for s in shapes if s[-2:] == (1, 24)] == ([] if partials is None else [(partials, 1, 24)])


def test_multi_output_grads(rng):
    a, b, c = arrays(rng, (16, 24), (24, 8), (16, 8))
    check_grads(lambda a, b, c: loss(efc.gemm(a, b, multi_output, c)),
                lambda a, b, c: loss(multi_output(a @ b, c)), (a, b, c))


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_transposed_grads(rng, ta, tb, batched):
    M, N, K = 12, 20, 16
    lead = (2,) if batched else ()
    a, b = arrays(rng, (*lead, K, M) if ta else (*lead, M, K), (*lead, N, K) if tb else (*lead, K, N))
    opa = (lambda t: jnp.swapaxes(t, -1, -2)) if ta else (lambda t: t)
    opb = (lambda t: jnp.swapaxes(t, -1, -2)) if tb else (lambda t: t)
    check_grads(
        lambda a, b: loss(efc.gemm(a, b, jnp.tanh, transpose_a=ta, transpose_b=tb)),
        lambda a, b: loss(jnp.tanh(opa(a) @ opb(b))), (a, b))


@pytest.mark.parametrize("name", sorted(efc.ACTIVATIONS))
def test_fused_dense_grads(rng, name):
    x, w, bias, r = arrays(rng, (2, 8, 16), (16, 24), (24,), (2, 8, 24))
    act = efc.ACTIVATIONS[name]
    check_grads(lambda x, w, bias, r: loss(efc.fused_dense(x, w, bias, activation=name, residual=r)),
                lambda x, w, bias, r: loss(act(x @ w + bias) + r), (x, w, bias, r), tol=2e-5)


def test_residual_policy(rng):
    """The accumulator is saved only when the VJP needs it, and never with recompute_acc."""
    a, b, c = arrays(rng, (8, 16), (16, 8), (8, 8))

    def n_outputs(fn, **kw):
        jaxpr = jax.make_jaxpr(lambda a, b: jax.vjp(lambda a, b: efc.gemm(a, b, fn, c, **kw), a, b))(a, b)
        return len(fused_gemm_eqns(jaxpr)[0].outvars)

    assert n_outputs(lambda acc, c: jax.nn.gelu(acc) + c) == 2
    assert n_outputs(lambda acc, c: jax.nn.gelu(acc) + c, recompute_acc=True) == 1
    assert n_outputs(lambda acc, c: 2.0 * acc + c) == 1


@pytest.mark.parametrize("m", [64, 256])
def test_bf16_grads_close(rng, m):
    a, b, bias = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(m, 32), (32, 48), (48,)])
    g = jax.grad(lambda a, b, bias: loss(efc.fused_dense(a, b, bias, activation="gelu_tanh")), (0, 1, 2))(a, b, bias)
    up = [x.astype(jnp.float32) for x in (a, b, bias)]
    ref = jax.grad(lambda a, b, bias: loss(jax.nn.gelu(a @ b + bias)), (0, 1, 2))(*up)
    for u, v in zip(g, ref):
        assert u.dtype == jnp.bfloat16 and rel_err(u, v) < 2e-2


def test_scan_remat_and_loops(rng):
    """Layers stacked with lax.scan under jax.checkpoint, as Flax's nn.scan/nn.remat build them."""
    W, B, x = (jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32) for s in [(3, 24, 24), (3, 24), (8, 24)])

    def net(dense):
        def f(x, W, B):
            def body(h, wb):
                return jax.checkpoint(lambda h: dense(h, *wb))(h), None
            return loss(jax.lax.scan(body, x, (W, B))[0])
        return f

    check_grads(net(lambda h, w, b: efc.fused_dense(h, w, b, activation="gelu_tanh")),
                net(lambda h, w, b: jax.nn.gelu(h @ w + b)), (x, W, B))
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, h: efc.fused_dense(h, W[i], B[i], activation="tanh"), x))
    want = x
    for i in range(3):
        want = jnp.tanh(want @ W[i] + B[i])
    assert rel_err(looped(x), want) < 1e-5


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_checkpoint_policies_save_the_fused_gemm(rng, policy):
    """Under jax.checkpoint with jax_efc's dot policies the backward pass reuses the forward
    GEMM's output and accumulator, as JAX's policies reuse a dot's; under JAX's own it runs
    the GEMM again. Batched GEMMs count as dots with batch dimensions."""
    x, w, bias, w2 = arrays(rng, (16, 8), (8, 24), (24,), (24, 4))
    xb, wb = arrays(rng, (2, 16, 8), (2, 8, 24))

    def fused_gemms_in_grad(pol, *args):
        def layer(x, w):
            if x.ndim == 3:
                return efc.gemm(x, w, jnp.tanh).sum(0) @ w2
            return efc.fused_dense(x, w, bias, activation="gelu") @ w2
        f = jax.checkpoint(layer, policy=pol)
        jaxpr = jax.make_jaxpr(jax.grad(lambda *a: loss(f(*a)), (0, 1)))(*args)
        return len(fused_gemm_eqns(jaxpr))

    ours, theirs = getattr(efc.checkpoint_policies, policy), getattr(jax.checkpoint_policies, policy)
    everything = jax.checkpoint_policies.everything_saveable
    assert fused_gemms_in_grad(ours, x, w) == fused_gemms_in_grad(everything, x, w) == 3
    assert fused_gemms_in_grad(theirs, x, w) == 4
    assert fused_gemms_in_grad(ours, xb, wb) == (4 if "batch" in policy else 3)
    g = jax.grad(lambda x, w: loss(jax.checkpoint(lambda x, w: efc.fused_dense(x, w, bias, activation="gelu"),
                                                  policy=ours)(x, w)), (0, 1))(x, w)
    want = jax.grad(lambda x, w: loss(jax.nn.gelu(x @ w + bias, approximate=False)), (0, 1))(x, w)
    for u, v in zip(g, want):
        assert rel_err(u, v) < 1e-5


def test_forward_mode_is_refused_clearly(rng):
    x, w = arrays(rng, (4, 8), (8, 8))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: efc.fused_dense(x, w), (x,), (x,))
