"""Tensor-parallel layers on every GPU of the host, timed side by side in interleaved rounds:
the column-parallel layer (activations gathered, kernel split by columns) and the row-parallel
one (activations and kernel split along K, partial sums reduced and scattered), each as

- ``plain``: plain JAX under ``jit`` with sharded inputs (XLA's collectives and dots),
- ``efc``: ``efc.fused_dense`` under ``jit`` (our partitioner: an all-gather, or partial
  products summed, beside our kernel),
- ``collective``: ``efc.all_gather_dense`` / ``efc.dense_reduce_scatter`` in ``shard_map``
  (ring exchanges beside the GEMMs).

    python benchmarks/collective.py [--tokens 8192] [--width 4096] [--hidden 14336]

Run with NCCL_NVLS_ENABLE=0 (NVLink multicast off). ``--cpu-devices 8`` runs it on host devices
(a check that it runs; the times mean nothing there).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cpu-devices", type=int, default=0, help="fake this many host devices (no GPU)")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_efc as efc
    from jax_efc.bench.timing import time_interleaved

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    keys = jax.random.split(jax.random.key(0), 4)
    t, d, h = args.tokens, args.width, args.hidden
    x = jax.random.normal(keys[0], (t, d), jnp.bfloat16)
    w_up = (jax.random.normal(keys[1], (d, h), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
    b_up = jnp.zeros((h,), jnp.bfloat16)
    hid = jax.random.normal(keys[2], (t, h), jnp.bfloat16)
    w_down = (jax.random.normal(keys[3], (h, d), jnp.float32) / h ** 0.5).astype(jnp.bfloat16)
    b_down = jnp.zeros((d,), jnp.bfloat16)

    def put(v, *spec):
        return jax.device_put(v, NamedSharding(mesh, P(*spec)))

    column = (put(x, "model"), put(w_up, None, "model"), put(b_up, "model"))
    row = (put(hid, None, "model"), put(w_down, "model"), put(b_down))
    out_column, out_row = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model"))

    def sharded(fn, out):
        return jax.jit(fn, out_shardings=out)

    layers = {
        "column": (column, {
            "plain": sharded(lambda x, w, b: jax.nn.gelu(x @ w + b), out_column),
            "efc": sharded(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu_tanh"), out_column),
            "collective": jax.jit(jax.shard_map(
                lambda x, w, b: efc.all_gather_dense(x, w, b, axis_name="model", activation="gelu_tanh"), mesh=mesh,
                in_specs=(P("model"), P(None, "model"), P("model")), out_specs=P(None, "model"))),
        }),
        "row": (row, {
            "plain": sharded(lambda x, w, b: jax.nn.gelu(x @ w + b), out_row),
            "efc": sharded(lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu_tanh"), out_row),
            "collective": jax.jit(jax.shard_map(
                lambda x, w, b: efc.dense_reduce_scatter(x, w, b, axis_name="model", activation="gelu_tanh"),
                mesh=mesh, in_specs=(P(None, "model"), P("model"), P()), out_specs=P("model"))),
        }),
    }
    flops = 2 * t * d * h
    print(f"{len(devices)} x {devices[0].device_kind}; tokens {t}, width {d}, hidden {h}, bf16, gelu_tanh")
    for name, (inputs, fns) in layers.items():
        # (host devices run one call at a time: queued calls of collectives can stall their rendezvous)
        times, _ = time_interleaved(list(fns.values()), [inputs], args.rounds, 1 if args.cpu_devices else None, 0.1, 2)
        base = times[0]
        for label, seconds in zip(fns, times):
            print(f"{name:7s} {label:11s} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s  "
                  f"{base / seconds:5.2f}x plain")


if __name__ == "__main__":
    main(sys.argv[1:])
