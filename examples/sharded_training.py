"""Data + tensor parallel training of a small MLP with jax_efc layers, against plain JAX.

The first layer is column-parallel (its kernel and bias sharded over "model"), the second
row-parallel (its kernel sharded over "model" along K); the batch is sharded over "data".
Both models take the same steps from the same initialization; the script checks that their
losses agree, times a step of each, and shows that jax_efc's forward pass gathers no
activations.

    python examples/sharded_training.py --mesh 2,4 --cpu-devices 8   # on a CPU
    python examples/sharded_training.py --mesh 1,1                   # on one GPU
"""

import argparse
import statistics
import time

import jax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2,4", help="data,model mesh shape")
    p.add_argument("--cpu-devices", type=int, default=0, help="fake this many host devices")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="steps checked, and steps per timed round")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_efc as efc

    dp, tp = (int(v) for v in args.mesh.split(","))
    mesh = jax.make_mesh((dp, tp), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dt = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    d, h = args.width, args.hidden
    params = {
        "w1": jax.random.normal(keys[0], (d, h), dt) * d**-0.5,
        "b1": jnp.zeros((h,), dt),
        "w2": jax.random.normal(keys[1], (h, d), dt) * h**-0.5,
    }
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    batch = NamedSharding(mesh, P("data", None))
    x = jax.device_put(jax.random.normal(keys[2], (args.batch, d), dt), batch)
    y = jax.device_put(jax.random.normal(keys[3], (args.batch, d), dt), batch)

    def make_step(dense):
        def loss(params, x, y):
            hidden = dense(x, params["w1"], params["b1"], "gelu_tanh")
            out = dense(hidden, params["w2"], None, None)
            return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

        @jax.jit
        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return value, jax.tree.map(lambda p, g: (p - 0.05 * g).astype(p.dtype), params, grads)

        return step

    def plain_dense(x, w, b, act):
        z = x @ w + (0 if b is None else b)
        return efc.ACTIVATIONS[act or "identity"](z)

    def fused(x, w, b, act):
        return efc.fused_dense(x, w, b, activation=act)

    steps, losses, state = {}, {}, {}
    for name, dense in (("jax_efc", fused), ("plain JAX", plain_dense)):
        steps[name], losses[name], state[name] = make_step(dense), [], params
        for _ in range(args.steps):
            value, state[name] = steps[name](state[name], x, y)
            losses[name].append(float(value))

    # timed in rounds of --steps steps, the two models alternating (and which goes first
    # alternating too), so a drift in the GPUs' clocks hits both alike; the median round counts
    times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in list(steps)[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                _, state[name] = steps[name](state[name], x, y)
            jax.block_until_ready(state[name])
            times[name].append((time.perf_counter() - t0) / args.steps)
    results = {name: (losses[name], statistics.median(times[name])) for name in steps}

    ours, base = results["jax_efc"], results["plain JAX"]
    fwd = jax.jit(lambda p, x: fused(x, p["w1"], p["b1"], "gelu_tanh"))
    hlo = fwd.lower(params, x).compile().as_text()
    print(f"mesh data={dp} x model={tp} on {jax.devices()[0].device_kind}, {args.dtype}, "
          f"batch {args.batch}, {d} -> {h} -> {d}")
    print("backend:", "; ".join(efc.backends(lambda x, w, b: fused(x, w, b, "gelu_tanh"),
                                              x, params["w1"], params["b1"])))
    print("losses jax_efc  :", " ".join(f"{v:.5f}" for v in ours[0]))
    print("losses plain JAX:", " ".join(f"{v:.5f}" for v in base[0]))
    print(f"step time (median of {args.rounds} alternating rounds of {args.steps} steps): "
          f"jax_efc {ours[1] * 1e3:.2f} ms, plain JAX {base[1] * 1e3:.2f} ms, ratio {base[1] / ours[1]:.3f}")
    print("forward all-gathers an activation:", "all-gather" in hlo)
    tol = 1e-4 if args.dtype == "float32" else 3e-2
    ok = all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(ours[0], base[0]))
    ok &= "all-gather" not in hlo
    print("ok" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
