"""vmap of gemm: folded into M, folded into the batch L, mapped scalars and vectors, and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import rel_err
from jax_efc.primitive import fused_gemm_eqns


def arrays(rng, *shapes):
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def epi(acc, bias, c, *, s):
    return jnp.tanh(acc + bias) * s + c


def plain(a, b, bias, c, s):
    return epi(a @ b, bias, c, s=s)


def ours(a, b, bias, c, s):
    return efc.gemm(a, b, epi, bias, c, s=s)


@pytest.mark.parametrize(
    "in_axes",
    [
        (0, None, None, 0, None),  # only the M side mapped: folds into M
        (0, 0, None, None, None),  # a and b mapped: the batch L
        (None, 0, 0, None, None),  # weights and bias mapped: L, x shared
        (1, None, None, 1, 0),  # a non-leading axis, and a mapped scalar
        (0, 0, 0, 0, 0),  # everything
    ],
)
def test_vmap(rng, in_axes):
    B, M, N, K = 3, 10, 12, 8
    shapes = {0: [(B, M, K), (B, K, N), (B, N), (B, M, N), (B,)],
              1: [(M, B, K), None, None, (M, B, N), None]}
    base = [(M, K), (K, N), (N,), (M, N), ()]
    args = []
    for i, ax in enumerate(in_axes):
        shape = base[i] if ax is None else shapes[ax][i] or shapes[0][i]
        args.append(arrays(rng, shape)[0])
    got = jax.vmap(ours, in_axes=in_axes)(*args)
    want = jax.vmap(plain, in_axes=in_axes)(*args)
    assert rel_err(got, want) < 1e-5
    g = jax.grad(lambda *t: jnp.sum(jax.vmap(ours, in_axes=in_axes)(*t) ** 2), argnums=(0, 1, 2, 3, 4))(*args)
    r = jax.grad(lambda *t: jnp.sum(jax.vmap(plain, in_axes=in_axes)(*t) ** 2), argnums=(0, 1, 2, 3, 4))(*args)
    for u, v in zip(g, r):
        assert rel_err(u, v) < 1e-5


def test_vmap_folds_into_m(rng):
    a, b, bias, c = arrays(rng, (4, 6, 8), (8, 5), (5,), (4, 6, 5))
    jaxpr = jax.make_jaxpr(jax.vmap(lambda a, c: ours(a, b, bias, c, 2.0)))(a, c)
    (eqn,) = fused_gemm_eqns(jaxpr)
    assert eqn.invars[0].aval.shape == (24, 8)


def test_vmap_of_batched_gemm(rng):
    B, L, M, N, K = 2, 3, 4, 6, 5
    a, b, t = arrays(rng, (B, L, M, K), (L, K, N), (B, L, M, N))
    got = jax.vmap(lambda a, t: efc.gemm(a, b, lambda acc, t: acc * t, t))(a, t)
    assert got.shape == (B, L, M, N)
    assert rel_err(got, np.einsum("blmk,lkn->blmn", a, b) * t) < 1e-5


def test_nested_vmap(rng):
    a, b = arrays(rng, (2, 3, 4, 5), (5, 6))
    got = jax.vmap(jax.vmap(lambda a: efc.gemm(a, b, jax.nn.relu)))(a)
    assert rel_err(got, jax.nn.relu(a @ b)) < 1e-6
