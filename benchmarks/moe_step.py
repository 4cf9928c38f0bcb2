"""A Mixture-of-Experts layer's training step: experts on ``efc.grouped_gemm`` against the same
layer on ``jax.lax.ragged_dot``.

    python benchmarks/moe_step.py [--tokens 8192 --width 4096 --hidden 14336 --experts 8 --top-k 2]

The layer is ``examples/moe.py``'s (a softmax router, top-k, SwiGLU experts with biases, the
copies sorted by expert and summed back per token); the step is one AdamW step on a squared
error, in bf16 with float32 parameters. Both steps start from the same parameters and batch and
are timed in one process, in interleaved rounds; their losses and gradients are compared.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from moe import EXPERTS, MoE, batches, make_step  # noqa: E402

from jax_efc.bench.timing import time_interleaved  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)

    model = MoE(args.experts, args.hidden, args.top_k, dtype=jnp.dtype(args.dtype))
    x, y = next(batches(jax.random.key(0), args.tokens, args.width, 8))
    x = x.astype(args.dtype)
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)
    steps = {name: make_step(lambda p, x, m=model.clone(implementation=name): m.apply({"params": p}, x), opt)
             for name in EXPERTS}
    losses = {name: float(step(params, opt_state, x, y)[2]) for name, step in steps.items()}
    times, _ = time_interleaved([lambda s=s: s(params, opt_state, x, y) for s in steps.values()], [()], args.rounds,
                                None, 0.2, 2)
    # the layer's expert GEMMs: three projections of T * top_k rows, forward and two gradients
    flops = 6 * 3 * args.tokens * args.top_k * args.width * args.hidden
    print(f"{jax.devices()[0].device_kind}; {args.tokens} tokens of width {args.width}, {args.experts} experts of "
          f"hidden width {args.hidden}, top-{args.top_k}, {args.dtype}; one AdamW step")
    base = times[list(steps).index("ragged_dot")]
    for (name, loss), t in zip(losses.items(), times):
        print(f"{name:14s} {1e3 * t:9.3f} ms  ({flops / t / 1e12:6.1f} expert TFLOP/s, {base / t:5.2f}x ragged_dot)"
              f"  loss {loss:.6f}")
    gap = abs(losses["grouped_gemm"] - losses["ragged_dot"]) / abs(losses["ragged_dot"])
    print(f"relative difference of the losses: {gap:.1e}")
    assert np.isfinite(gap) and gap < (1e-4 if args.dtype == "float32" else 5e-2), gap


if __name__ == "__main__":
    main()
