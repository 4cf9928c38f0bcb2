"""A GPT-style model's first training step, as a user meets it: the wall time from the first
call of the jitted AdamW step to its result (tracing, lowering, kernel compiles, XLA's compile
and the step itself), with ``jax_efc.flax.linen.FusedDense`` and with ``nn.Dense``, each in a
fresh process; FusedDense twice, with an empty kernel cache and again with the cache the
first run left (JAX's own compilation cache stays off). Prints one line per run and the ratios.

    python benchmarks/first_step.py [--blocks 4] [--width 2048] [--batch 8] [--seq 2048]
    python benchmarks/first_step.py --run fused|dense ...   (one measurement, in this process)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jax_efc.flax.linen import FusedDense


class Block(nn.Module):
    """Pre-norm attention and GELU MLP; every projection is ``dense``."""

    width: int
    heads: int
    dense: type

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.LayerNorm(dtype=x.dtype)(x)
        q, k, v = jnp.split(self.dense(3 * d, dtype=x.dtype, name="qkv")(h), 3, axis=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in (q, k, v))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + self.dense(d, dtype=x.dtype, name="proj")(a)
        h = nn.LayerNorm(dtype=x.dtype)(x)
        if self.dense is FusedDense:
            h = FusedDense(4 * d, dtype=x.dtype, activation="gelu_tanh", name="up")(h)
        else:
            h = nn.gelu(nn.Dense(4 * d, dtype=x.dtype, name="up")(h))
        return x + self.dense(d, dtype=x.dtype, name="down")(h)


class Model(nn.Module):
    blocks: int
    width: int
    heads: int
    dense: type

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = Block(self.width, self.heads, self.dense, name=f"block{i}")(x)
        return x


def first_step(which: str, blocks: int, width: int, batch: int, seq: int) -> dict:
    """Seconds from the first call of the jitted step to its loss, and of the second step."""
    model = Model(blocks, width, max(1, width // 128), FusedDense if which == "fused" else nn.Dense)
    x = jax.random.normal(jax.random.key(0), (batch, seq, width), jnp.bfloat16)
    params = jax.jit(model.init)(jax.random.key(1), x)
    opt = optax.adamw(1e-4)
    opt_state = jax.jit(opt.init)(params)

    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, x)
    loss.block_until_ready()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(params, opt_state, x)[2].block_until_ready()
    return {"run": which, "first_step_s": first, "second_step_s": time.perf_counter() - t0,
            "loss": float(loss)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", choices=("fused", "dense"), help="one measurement in this process")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args(argv)
    shape = ["--blocks", str(args.blocks), "--width", str(args.width), "--batch", str(args.batch),
             "--seq", str(args.seq)]
    if args.run:
        print(json.dumps(first_step(args.run, args.blocks, args.width, args.batch, args.seq)))
        return
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_EFC_CACHE_DIR=cache, JAX_EFC_KERNEL_CACHE="1")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        results = {}
        for label, which in (("dense", "dense"), ("fused, cold kernel cache", "fused"),
                             ("fused, warm kernel cache", "fused")):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--run", which, *shape], env=env,
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t0
            results[label] = r
            print(f"{label:26s} first step {r['first_step_s']:7.2f} s  second {r['second_step_s'] * 1e3:8.1f} ms  "
                  f"process {r['process_s']:6.1f} s  loss {r['loss']:.6g}", flush=True)
    base = results["dense"]["first_step_s"]
    for label in ("fused, cold kernel cache", "fused, warm kernel cache"):
        print(f"{label}: first step {results[label]['first_step_s'] / base:.2f}x nn.Dense's")


if __name__ == "__main__":
    main()
