"""How much faster FP8 makes a GPT-style training step: the bound Amdahl's law sets, and the
FP8 steps themselves.

    python benchmarks/fp8_bound.py [--blocks 4 --width 2048 --heads 16 --batch 8 --seq 2048]
                                   [--attention cudnn] [--layers fp8,fp8-fast,flax-fp8]

Times in one process, in interleaved rounds: the bf16 training step of ``examples/gpt_fp8.py``'s
model with ``nn.Dense`` layers; that step's GEMMs alone in bf16 (for each projection the forward
product, the data gradient and the weight gradient, as XLA runs them); the same GEMMs on FP8
operands (XLA's FP8 dot: e4m3 activations and weights, e5m2 gradients, cuBLAS's fast
accumulation, the weight gradient's transposes included); and the step with each FP8 kind of
layer of ``--layers``. An FP8 step that quantised for free could take at best ``step - bf16
GEMMs + FP8 GEMMs``, so no FP8 layer can beat ``step / (step - bf16 GEMMs + FP8 GEMMs)`` on this
model. Every step runs on the same batch and state each call (as timing wants; the example's
own timings advance them).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt_fp8 import timed_step  # noqa: E402

from jax_efc.bench.timing import time_interleaved  # noqa: E402


def projections(width: int, vocab: int, blocks: int) -> list[tuple[int, int]]:
    """(K, N) of every projection of the model: per block qkv, attention output, MLP up and
    down, then the head."""
    return [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)] * blocks + [(width, vocab)]


def gemms(a_dtype, b_dtype):
    """For each (x, w, g): x @ w, g @ w.T and x.T @ g, with x, w in ``a_dtype`` and g in
    ``b_dtype`` (the gradient's), bf16 results."""
    def run(layers):
        out = []
        for x, w, g in layers:
            x, w, g = x.astype(a_dtype), w.astype(a_dtype), g.astype(b_dtype)
            out += [jnp.matmul(x, w, preferred_element_type=jnp.bfloat16),
                    jnp.matmul(g, w.T, preferred_element_type=jnp.bfloat16),
                    jnp.matmul(x.T, g, preferred_element_type=jnp.bfloat16)]
        return out

    return jax.jit(run)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--attention", choices=("xla", "cudnn"), default=None)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--layers", default="fp8,fp8-fast,flax-fp8",
                   help="FP8 kinds of layer of examples/gpt_fp8.py whose steps to time too (comma-separated; "
                        "'' for none)")
    args = p.parse_args(argv)

    kinds = [k for k in args.layers.split(",") if k]
    steps = [timed_step(k, args.attention, blocks=args.blocks, width=args.width, heads=args.heads,
                        batch=args.batch, seq=args.seq, vocab=args.vocab) for k in ["dense", *kinds]]

    t = args.batch * args.seq
    keys = iter(jax.random.split(jax.random.key(2), 3 * (4 * args.blocks + 1)))
    layers = [tuple(jax.random.normal(next(keys), s, jnp.bfloat16) for s in ((t, k), (k, n), (t, n)))
              for k, n in projections(args.width, args.vocab, args.blocks)]
    fns = [steps[0][0], gemms(jnp.bfloat16, jnp.bfloat16), gemms(jnp.float8_e4m3fn, jnp.float8_e5m2),
           *(f for f, _ in steps[1:])]
    inputs = [steps[0][1], (layers,), (layers,), *(x for _, x in steps[1:])]
    times, _ = time_interleaved([lambda *_, f=f, x=x: f(*x) for f, x in zip(fns, inputs)], [()], args.rounds,
                                None, 0.2, 2)
    step_s, bf16_s, fp8_s, *kind_s = times
    flops = 6 * t * sum(k * n for k, n in projections(args.width, args.vocab, args.blocks))
    print(f"{jax.devices()[0].device_kind}; {args.blocks} blocks, width {args.width}, {t} tokens a step")
    print(f"bf16 step (nn.Dense)        {1e3 * step_s:8.2f} ms")
    print(f"its GEMMs alone, bf16       {1e3 * bf16_s:8.2f} ms  ({flops / bf16_s / 1e12:.0f} TFLOP/s, "
          f"{bf16_s / step_s:.0%} of the step)")
    print(f"the same GEMMs in FP8 (XLA) {1e3 * fp8_s:8.2f} ms  ({flops / fp8_s / 1e12:.0f} TFLOP/s)")
    bound = step_s / (step_s - bf16_s + fp8_s)
    print(f"bound on an FP8 step's speedup, quantisation free: {bound:.2f}x")
    for kind, s in zip(kinds, kind_s):
        print(f"{kind + ' step':<28}{1e3 * s:8.2f} ms  ({step_s / s:.2f}x the bf16 step)")
    assert np.isfinite(bound)


if __name__ == "__main__":
    main()
