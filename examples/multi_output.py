"""One GEMM, two outputs: D = relu(pre) and Y = pre, pre = acc*alpha + C*beta.

A layer that also keeps its pre-activation (for a backward pass) stores both from one kernel,
each in its own dtype. Checks both against the same math in plain JAX and says which backend
ran (the CuTe DSL kernel on Hopper, the XLA reference elsewhere).

    python examples/multi_output.py [--mnkl 2048,2048,1024,1] [--dtype bfloat16]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc
from jax_efc.example_epilogues import multi_output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnkl", default="2048,2048,1024,1", help="M,N,K,L")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=1.0)
    args = p.parse_args()
    m, n, k, l = (int(v) for v in args.mnkl.split(","))
    lead = (l,) if l > 1 else ()
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (*lead, m, k), args.dtype)
    b = jax.random.normal(keys[1], (*lead, k, n), args.dtype)
    c = jax.random.normal(keys[2], (*lead, m, n), args.dtype)
    scalars = dict(alpha=args.alpha, beta=args.beta)
    out_dtypes = {"D": args.dtype, "Y": jnp.float32}  # the activation narrow, the saved input wide

    run = lambda a, b, c: efc.gemm(a, b, multi_output, c, out_dtypes=out_dtypes, **scalars)  # noqa: E731
    out = jax.jit(run)(a, b, c)

    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    ref = multi_output(f64(a) @ f64(b), f64(c), **scalars)
    print(f"jax_efc multi-output, M,N,K,L = {m},{n},{k},{l}, {args.dtype}, on {jax.devices()[0].device_kind}")
    print("backend:", "; ".join(efc.backends(run, a, b, c)))
    ok = True
    for name in ("D", "Y"):
        err = np.linalg.norm(f64(out[name]) - f64(ref[name])) / np.linalg.norm(f64(ref[name]))
        # a float32 output of 16-bit inputs is nearly exact; float32 inputs may use TF32 on the GPU
        tol = 1e-2 if out[name].dtype != jnp.float32 else 5e-3 if args.dtype == "float32" else 1e-4
        ok &= err < tol
        print(f"  {name} ({out[name].dtype}): relative error vs float64 reference {err:.2e} "
              f"({'ok' if err < tol else 'FAIL'})")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
