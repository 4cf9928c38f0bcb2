"""The alpha-beta epilogue of CUTLASS's custom-epilogue example: D = acc*alpha + C*beta + X*x_factor, and Y = acc.

Runs it through jax_efc, checks it against the same math in plain JAX, and says which backend
ran (the CuTe DSL kernel on Hopper, the XLA reference elsewhere).

    python examples/alpha_beta.py [--mnkl 2048,2048,1024,1] [--dtype bfloat16]
"""

import argparse

import jax
import numpy as np

import jax_efc as efc
from jax_efc.example_epilogues import alpha_beta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnkl", default="2048,2048,1024,1", help="M,N,K,L")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--alpha", type=float, default=2.0)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--x_factor", type=float, default=3.0)
    args = p.parse_args()
    m, n, k, l = (int(v) for v in args.mnkl.split(","))
    lead = (l,) if l > 1 else ()
    keys = jax.random.split(jax.random.key(0), 4)
    a = jax.random.normal(keys[0], (*lead, m, k), args.dtype)
    b = jax.random.normal(keys[1], (*lead, k, n), args.dtype)
    c = jax.random.normal(keys[2], (*lead, m, n), args.dtype)
    x = jax.random.normal(keys[3], (*lead, m, n), args.dtype)
    scalars = dict(alpha=args.alpha, beta=args.beta, x_factor=args.x_factor)

    fused = jax.jit(lambda a, b, c, x: efc.gemm(a, b, alpha_beta, c, x, **scalars))
    out = fused(a, b, c, x)

    f32 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    acc = f32(a) @ f32(b)
    ref = alpha_beta(acc, f32(c), f32(x), **scalars)
    print(f"jax_efc alpha-beta, M,N,K,L = {m},{n},{k},{l}, {args.dtype}, on {jax.devices()[0].device_kind}")
    print("backend:", "; ".join(efc.backends(lambda *t: efc.gemm(*t[:2], alpha_beta, *t[2:], **scalars), a, b, c, x)))
    ok = True
    for name in ("D", "Y"):
        err = np.linalg.norm(f32(out[name]) - ref[name]) / np.linalg.norm(ref[name])
        tol = 5e-3 if args.dtype == "float32" else 1e-2  # float32: the GPU may use TF32
        ok &= err < tol
        print(f"  {name}: relative error vs float64 reference {err:.2e} ({'ok' if err < tol else 'FAIL'})")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
