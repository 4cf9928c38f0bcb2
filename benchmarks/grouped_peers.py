"""The grouped GEMM against its peers and against a dense GEMM of the same FLOPs.

    python benchmarks/grouped_peers.py [--shapes M,N,K,G ...] [--routing balanced skewed]
                                       [--configs auto CONFIG ...]

For each shape (M rows sorted over G groups, each group's (K, N) matrix) and routing (equal
shares, or shares falling by 0.6 a group), times in one process, in interleaved rounds:
``efc.grouped_gemm`` without an epilogue; XLA's ``jax.lax.ragged_dot``; JAX's Pallas Mosaic GPU
ragged-dot kernel (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``; the fastest of a few
of its configs, each timed once beforehand, as its own ``main`` sweeps them); tokamax's
``ragged_dot`` on its Pallas Mosaic GPU kernel, where the ``tokamax`` package is installed
(its own config choice); and ``efc.gemm``
of one (M, K) x (K, N) product, the same FLOPs with one matrix. ``--configs`` times our
kernel in each config given (as ``bench --configs`` writes them; ``auto``: the heuristic's),
the first one's time the ratios' reference. Every result is compared with
``ragged_dot`` at ``HIGHEST`` precision. bf16 inputs and outputs, fp32 accumulation.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

import jax_efc as efc
from jax_efc.bench.command import parse_config
from jax_efc.bench.problems import config_label, group_sizes
from jax_efc.bench.timing import time_interleaved

# the configs of the Pallas kernel tried (block_m, block_n, block_k, max_concurrent_steps,
# grid_block_n): from the ranges its own sweep covers
PALLAS_CONFIGS = list(itertools.product((128,), (128, 256), (64,), (4,), (1, 4)))


def pallas_ragged_dot(lhs, rhs, sizes):
    """The fastest config of the Pallas kernel on these operands (and its time), or why none ran."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    best, why = None, "no config fits"
    for bm, bn, bk, steps, gbn in PALLAS_CONFIGS:
        if rhs.shape[2] % (bn * gbn):
            continue
        fn = jax.jit(lambda x, w, s, c=(bm, bn, bk, steps, gbn): ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=s, block_m=c[0], block_n=c[1], block_k=c[2], max_concurrent_steps=c[3],
            grid_block_n=c[4]))
        try:
            jax.block_until_ready(fn(lhs, rhs, sizes))
            t0 = time.perf_counter()
            for _ in range(5):
                out = fn(lhs, rhs, sizes)
            jax.block_until_ready(out)
            t = (time.perf_counter() - t0) / 5
        except Exception as e:  # a config that does not fit shared memory, or no Mosaic GPU here
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            continue
        if best is None or t < best[1]:
            best = ((bm, bn, bk, steps, gbn), t, fn)
    return best, why


def tokamax_ragged_dot(lhs, rhs, sizes):
    """tokamax's Mosaic GPU ragged_dot, jitted and run once on these operands, or why it did not run."""
    try:
        import tokamax
    except ImportError as e:
        return None, f"tokamax is not installed ({e})"
    fn = jax.jit(lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation="mosaic"))
    try:
        jax.block_until_ready(fn(lhs, rhs, sizes))
    except Exception as e:  # no Mosaic GPU kernel for these operands or this GPU
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return fn, ""


def rel_err(out, want):
    out, want = out.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16384,3584,4096,8", "16384,3584,4096,64"])
    p.add_argument("--routing", nargs="+", choices=("balanced", "skewed"), default=["balanced"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--configs", nargs="+", type=parse_config, default=[None], metavar="CONFIG",
                   help="our kernel's configs, timed in the same rounds ('auto': the heuristic's)")
    args = p.parse_args(argv)

    print(f"{jax.devices()[0].device_kind}; bf16; TFLOP/s count 2*M*N*K; err vs ragged_dot at HIGHEST")
    print(f"{'shape':<20}{'routing':<10}{'who':<44}{'ms':>8}{'TFLOP/s':>9}{'t/ours':>9}{'err':>10}")
    for text in args.shapes:
        m, n, k, g = (int(v) for v in text.split(","))
        keys = jax.random.split(jax.random.key(0), 3)
        lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        dense_b = rhs[0]
        for routing in args.routing:
            sizes = jnp.asarray(group_sizes(m, g, routing == "skewed"))
            want = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST,
                                                              preferred_element_type=jnp.float32))(lhs, rhs, sizes)
            runs = {f"ours: efc.grouped_gemm {config_label(c)}":
                    (jax.jit(lambda x, w, s, c=c: efc.grouped_gemm(x, w, s, config=c)), (lhs, rhs, sizes))
                    for c in args.configs}
            runs["XLA: ragged_dot"] = (jax.jit(jax.lax.ragged_dot), (lhs, rhs, sizes))
            pallas, why = pallas_ragged_dot(lhs, rhs, sizes)
            if pallas:
                runs[f"Pallas MGPU {'x'.join(map(str, pallas[0]))}"] = (pallas[2], (lhs, rhs, sizes))
            tokamax_fn, tokamax_why = tokamax_ragged_dot(lhs, rhs, sizes)
            if tokamax_fn:
                runs["tokamax: ragged_dot (mosaic)"] = (tokamax_fn, (lhs, rhs, sizes))
            runs["dense: efc.gemm, same FLOPs"] = (jax.jit(lambda x, w: efc.gemm(x, w)), (lhs, dense_b))
            fns = list(runs.values())
            times, _ = time_interleaved([lambda f=f, a=a: f(*a) for f, a in fns], [()], args.rounds, None, 0.2, 2)
            flops = 2 * m * n * k
            for (name, (fn, a)), t in zip(runs.items(), times):
                err = "" if name.startswith("dense") else f"{rel_err(fn(*a), want):.1e}"
                print(f"{text:<20}{routing:<10}{name:<44}{1e3 * t:8.3f}{flops / t / 1e12:9.1f}"
                      f"{t / times[0]:9.2f}{err:>10}")
            if not pallas:
                print(f"{text:<20}{routing:<10}Pallas MGPU: did not run ({why})")
            if not tokamax_fn:
                print(f"{text:<20}{routing:<10}tokamax: did not run ({tokamax_why})")


if __name__ == "__main__":
    main()
