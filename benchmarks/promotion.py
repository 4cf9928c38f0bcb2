"""8-bit float GEMMs with partial sums promoted into fp32, each k-tile or every second one, against
fast accumulation, ours and XLA's: speed and accuracy.

    python benchmarks/promotion.py [--shapes M,N,K ...] [--rounds 6]

e4m3 A (M, K) and B (N, K), fp32 out (a narrower output would hide the accumulation's error).
Timed in one process, in interleaved rounds: the kernel promoting each k-tile's partial sums
(precision HIGHEST), promoting every second k-tile (Hopper's default) and with fast
accumulation, and XLA's FP8 dot at precision HIGHEST (which promotes) and at its default (fast
accumulation on these shapes). Errors are relative to float64 of the same 8-bit values, over
the first 256 rows.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc
from jax_efc.bench.command import parse_shape
from jax_efc.bench.timing import time_interleaved

FAST = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
ROWS = 256  # rows the float64 oracle checks


def variants() -> dict:
    """name: function of a and b."""
    def ours(precision):
        return lambda a, b: efc.gemm(a, b, transpose_b=True, out_dtypes=jnp.float32, precision=precision)

    def xla(precision):
        return lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                                preferred_element_type=jnp.float32)

    highest = jax.lax.Precision.HIGHEST
    return {"promoted each k-tile": ours(highest), "every second k-tile": ours(None), "fast": ours(FAST),
            "XLA HIGHEST": xla(highest), "XLA default": xla(None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape("8192,8192,8192")])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}: e4m3, B stored (N, K), fp32 out; ms (TFLOP/s), error vs float64")
    for m, n, k, _ in args.shapes:
        a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32).astype(jnp.float8_e4m3fn) for s in ((m, k), (n, k)))
        fns = {name: jax.jit(fn).lower(a, b).compile() for name, fn in variants().items()}
        times, _ = time_interleaved(list(fns.values()), [(a, b)], args.rounds, None, 0.1, 2)
        want = np.asarray(a[:ROWS].astype(jnp.float32), np.float64) @ np.asarray(b.astype(jnp.float32), np.float64).T
        cells = []
        for (name, fn), t in zip(fns.items(), times):
            got = np.asarray(fn(a, b)[:ROWS], np.float64)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            cells.append(f"{name} {t * 1e3:.3f} ({2 * m * n * k / t / 1e12:.0f}) {err:.1e}")
        print(f"{m}x{n}x{k}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
