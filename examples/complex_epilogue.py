"""A richer epilogue: D = gelu((acc + bias)*scale + C + tanh(X)), in one kernel.

A row vector (bias), two tiles (C, X), a scalar and two transcendental functions. The scale is
passed once as a Python number (baked into the kernel) and once as a JAX array (read at run
time: changing it does not recompile). Checks against the same math in plain JAX and says which
backend ran (the CuTe DSL kernel on Hopper, the XLA reference elsewhere).

    python examples/complex_epilogue.py [--mnk 2048,2048,1024] [--dtype bfloat16]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc
from jax_efc.example_epilogues import complex_epilogue


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnk", default="2048,2048,1024", help="M,N,K")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--scale", type=float, default=0.125)
    args = p.parse_args()
    m, n, k = (int(v) for v in args.mnk.split(","))
    keys = jax.random.split(jax.random.key(0), 5)
    a = jax.random.normal(keys[0], (m, k), args.dtype)
    b = jax.random.normal(keys[1], (k, n), args.dtype)
    bias = jax.random.normal(keys[2], (n,), args.dtype)
    c = jax.random.normal(keys[3], (m, n), args.dtype)
    x = jax.random.normal(keys[4], (m, n), args.dtype)

    run = jax.jit(lambda a, b, bias, c, x, scale: efc.gemm(a, b, complex_epilogue, bias, c, x, scale=scale))
    static = jax.jit(lambda a, b, bias, c, x: efc.gemm(a, b, complex_epilogue, bias, c, x, scale=args.scale))

    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    acc = jnp.asarray(f64(a) @ f64(b), jnp.float32)
    ref = f64(complex_epilogue(acc, bias.astype(jnp.float32), c.astype(jnp.float32), x.astype(jnp.float32),
                               scale=args.scale)["D"])
    print(f"jax_efc complex epilogue, M,N,K = {m},{n},{k}, {args.dtype}, on {jax.devices()[0].device_kind}")
    print("backend:", "; ".join(efc.backends(run, a, b, bias, c, x, jnp.float32(args.scale))))
    tol = 5e-3 if args.dtype == "float32" else 1e-2  # float32: the GPU may use TF32
    ok = True
    for label, out in (("scale baked in", static(a, b, bias, c, x)),
                       ("scale at run time", run(a, b, bias, c, x, jnp.float32(args.scale)))):
        err = np.linalg.norm(f64(out["D"]) - ref) / np.linalg.norm(ref)
        ok &= err < tol
        print(f"  D, {label}: relative error vs float64 reference {err:.2e} ({'ok' if err < tol else 'FAIL'})")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
