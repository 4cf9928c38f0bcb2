"""What rounding a float32 operand to TF32 costs the pass that transposes it for the kernel.

    python benchmarks/tf32_rounding.py [--sizes 4096 8192]

The TF32 WGMMA reads both operands K-major, so B stored (K, N) is transposed once before the
kernel, and rounded to TF32 in that pass (the WGMMA alone would truncate it). Times in
interleaved rounds, for square float32 matrices: a copy (x * 2, the memory's pace), the plain
transpose, the transpose with ``jax_efc.ffi.tf32_rounded`` (what the kernel's callers run), the
same rounding alone, and ``lax.reduce_precision`` to TF32's 10 mantissa bits (round to nearest
even; differs from ``tf32_rounded`` only at ties) with and without the transpose.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_efc.bench.timing import time_interleaved
from jax_efc.ffi import tf32_rounded


def _reduced(x):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


VARIANTS = {
    "copy": lambda x: x * 2,
    "transpose": lambda x: x.T,
    "tf32_rounded, transposed": lambda x: tf32_rounded(x).T,
    "tf32_rounded": tf32_rounded,
    "reduce_precision, transposed": lambda x: _reduced(x).T,
    "reduce_precision": _reduced,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, float32")
    for n in args.sizes:
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        times, _ = time_interleaved([jax.jit(f) for f in VARIANTS.values()], [(x,)], args.rounds, None, 0.1, 2)
        for name, t in zip(VARIANTS, times):
            print(f"{n}^2  {name:<30}{1e3 * t:8.4f} ms  {2 * x.nbytes / t / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()
