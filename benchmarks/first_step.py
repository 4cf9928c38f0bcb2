"""A GPT-style model's first training step, as a user meets it: the wall time from the first
call of the jitted AdamW step to its result (tracing, lowering, kernel compiles, XLA's compile
and the step itself), with ``jax_efc.flax.linen.FusedDense`` and with ``nn.Dense``, each in a
fresh process; FusedDense three times: with an empty kernel cache, its kernels compiled ahead
while the step is traced (the default) and compiled in turn by the lowering
(``JAX_EFC_COMPILE_AHEAD=0``), and with the cache the first run left (JAX's own compilation
cache stays off). Prints one line per run and the ratios.

``--export`` measures on a machine without a GPU what it can: the time to ``jax.export`` the
step for CUDA (tracing, lowering and the kernels' compiles for sm_90a; no XLA compile, no run).

    python benchmarks/first_step.py [--export] [--blocks 4] [--width 2048] [--batch 8] [--seq 2048]
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


def first_step(which: str, blocks: int, width: int, batch: int, seq: int, export: bool = False) -> dict:
    """Seconds from the first call of the jitted step to its loss, and of the second step; with
    ``export``, seconds to export the step for CUDA."""
    model = Model(blocks, width, max(1, width // 128), FusedDense if which == "fused" else nn.Dense)
    opt = optax.adamw(1e-4)

    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if export:
        import jax_efc as efc

        efc.set_target_arch("sm_90a")
        x = jax.ShapeDtypeStruct((batch, seq, width), jnp.bfloat16)
        params = jax.eval_shape(model.init, jax.random.key(1), x)
        opt_state = jax.eval_shape(opt.init, params)
        t0 = time.perf_counter()
        exported = jax.export.export(step, platforms=["cuda"], disabled_checks=efc.export_checks())(
            params, opt_state, x)
        took = time.perf_counter() - t0
        del exported
        return {"run": which, "export_s": took,
                "kernels": sum(b.startswith("kernel") for b in efc.backends(step, params, opt_state, x))}
    x = jax.random.normal(jax.random.key(0), (batch, seq, width), jnp.bfloat16)
    params = jax.jit(model.init)(jax.random.key(1), x)
    opt_state = jax.jit(opt.init)(params)
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
    p.add_argument("--export", action="store_true", help="time the export for CUDA (no GPU needed)")
    args = p.parse_args(argv)
    shape = ["--blocks", str(args.blocks), "--width", str(args.width), "--batch", str(args.batch),
             "--seq", str(args.seq)] + (["--export"] if args.export else [])
    if args.run:
        print(json.dumps(first_step(args.run, args.blocks, args.width, args.batch, args.seq, args.export)))
        return
    measure = "export_s" if args.export else "first_step_s"
    runs = (("dense", "dense", {}), ("fused, cold, compiled ahead", "fused", {}),
            ("fused, cold, compiled in turn", "fused", {"JAX_EFC_COMPILE_AHEAD": "0"}),
            ("fused, warm kernel cache", "fused", {}))
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for label, which, extra in runs:
            # the cold runs each start from an empty kernel cache; the warm one from the last's
            run_cache = os.path.join(cache, "warm" if "warm" in label or "in turn" in label else label)
            env = dict(os.environ, JAX_EFC_CACHE_DIR=run_cache, JAX_EFC_KERNEL_CACHE="1", **extra)
            if args.export:
                env.update(JAX_PLATFORMS="cpu", JAX_EFC_COMPILE_AHEAD=extra.get("JAX_EFC_COMPILE_AHEAD", "1"))
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--run", which, *shape], env=env,
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t0
            results[label] = r
            detail = (f"GEMMs on the kernel {r['kernels']}" if args.export else
                      f"second {r['second_step_s'] * 1e3:8.1f} ms  loss {r['loss']:.6g}")
            print(f"{label:30s} {'export' if args.export else 'first step'} {r[measure]:7.2f} s  {detail}  "
                  f"process {r['process_s']:6.1f} s", flush=True)
    base = results["dense"][measure]
    for label, _, _ in runs[1:]:
        print(f"{label}: {results[label][measure] / base:.2f}x nn.Dense's")


if __name__ == "__main__":
    main()
