"""A dense layer with a fused activation: y = act(x @ W + b), one kernel per activation.

Runs ``jax_efc.fused_dense`` with built-in activations (by name) and a callable, checks each
against the same math in plain JAX, and says which backend ran (the CuTe DSL kernel on
Hopper, the XLA reference elsewhere).

    python examples/activation.py [--mnk 2048,2048,1024] [--dtype bfloat16]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc


def quick_gelu(z):
    """A user-written activation: any function of elementwise JAX ops works."""
    return z * jax.nn.sigmoid(1.702 * z)


ACTIVATIONS = {"relu": "relu", "gelu (erf)": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu",
               "quick_gelu (callable)": quick_gelu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnk", default="2048,2048,1024", help="M,N,K")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    m, n, k = (int(v) for v in args.mnk.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), args.dtype)
    w = (jax.random.normal(keys[1], (k, n)) / np.sqrt(k)).astype(args.dtype)
    b = jax.random.normal(keys[2], (n,), args.dtype)

    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    z = f64(x) @ f64(w) + f64(b)
    print(f"jax_efc fused_dense, M,N,K = {m},{n},{k}, {args.dtype}, on {jax.devices()[0].device_kind}")
    tol = 5e-3 if args.dtype == "float32" else 1e-2  # float32: the GPU may use TF32
    ok = True
    for label, act in ACTIVATIONS.items():
        layer = lambda x, w, b, act=act: efc.fused_dense(x, w, b, activation=act)  # noqa: E731
        y = jax.jit(layer)(x, w, b)
        ref = f64(efc.activations.resolve(act)(jnp.asarray(z, jnp.float32)))
        err = np.linalg.norm(f64(y) - ref) / np.linalg.norm(ref)
        ok &= err < tol
        print(f"  {label:<22} relative error vs float64 reference {err:.2e} ({'ok' if err < tol else 'FAIL'})"
              f"; backend: {'; '.join(efc.backends(layer, x, w, b))}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
