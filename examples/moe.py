"""A Mixture-of-Experts layer whose experts run as grouped GEMMs with fused epilogues, trained
side by side with the same layer built from ``jax.lax.ragged_dot``.

The layer (``MoE``, Flax linen): a softmax router picks ``--top-k`` experts per token (their
weights renormalised to sum to 1); the token copies are sorted by expert, and each expert is a
SwiGLU MLP, ``(silu(x @ gate + b_gate) * (x @ up + b_up)) @ down + b_down``, run over all experts
at once by ``jax_efc.grouped_gemm``:

- the gate projection's epilogue adds the expert's bias and applies silu;
- the up projection's epilogue adds its bias and multiplies by the gate's output (a tile operand);
- the down projection's epilogue adds its bias and scales each row by its router weight (a
  column operand);

the per-expert biases are ``group_operands``. The copies are then unsorted and summed per token.
The baseline is the same layer with each projection a ``ragged_dot`` and the rest plain JAX. Both
train with AdamW from the same initial parameters on the same data (tokens drawn around a few
centres, each centre with its own nonlinear target map); the script prints the loss curves side
by side and the time a step takes, and checks that both learn and agree.

``--expert-parallel D`` adds the layer with its experts sharded over D devices (a mesh axis
"expert", in ``jax.shard_map``): each device routes its share of the tokens, sends each copy to
the device holding its expert with ``jax.lax.all_to_all``, runs ``grouped_gemm`` over its local
experts, and sends the results back. Each device's receive buffer has room for every copy from
every device, so none is dropped however the router skews (a production layer would cap it at a
capacity). It checks the output and gradients against the single-device layer, and trains it as
a third curve.

    python examples/moe.py                                         # small, on a CPU
    python examples/moe.py --expert-parallel 8 --cpu-devices 8     # experts over 8 host devices
    python examples/moe.py --tokens 8192 --width 1024 --hidden 2048 --experts 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jax_efc as efc

Params = dict[str, jax.Array]
# experts(params, rows, group_sizes, expert_of_row, router_weight (rows, 1)) -> outputs, rows
# sorted by expert; rows past sum(group_sizes) belong to no expert and give 0
Experts = Callable[[Params, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _silu_of_sum(acc, bias):
    return jax.nn.silu(acc + bias)


def _gated(acc, gate, bias):
    return gate * (acc + bias)


def _weighted(acc, weight, bias):
    return weight * (acc + bias)


def grouped_experts(p: Params, rows: jax.Array, sizes: jax.Array, expert: jax.Array,
                    weight: jax.Array) -> jax.Array:
    """The SwiGLU experts as three ``efc.grouped_gemm`` calls, everything else in their epilogues."""
    gate = efc.grouped_gemm(rows, p["gate_kernel"], sizes, _silu_of_sum, group_operands=[p["gate_bias"]])
    hidden = efc.grouped_gemm(rows, p["up_kernel"], sizes, _gated, gate, group_operands=[p["up_bias"]])
    return efc.grouped_gemm(hidden, p["down_kernel"], sizes, _weighted, weight, group_operands=[p["down_bias"]])


def ragged_dot_experts(p: Params, rows: jax.Array, sizes: jax.Array, expert: jax.Array,
                       weight: jax.Array) -> jax.Array:
    """The same experts from ``jax.lax.ragged_dot`` and plain JAX."""

    def project(x, name):
        return jax.lax.ragged_dot(x, p[f"{name}_kernel"], sizes) + p[f"{name}_bias"][expert]

    hidden = jax.nn.silu(project(rows, "gate")) * project(rows, "up")
    return weight * project(hidden, "down")


EXPERTS = {"grouped_gemm": grouped_experts, "ragged_dot": ragged_dot_experts}


def _sort_by_expert(x: jax.Array, router: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routes the tokens ``x`` (T, D): returns, for the T * top_k token copies sorted by expert
    (stable), each copy's token, expert and router weight."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router.astype(jnp.float32))
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    experts = experts.reshape(-1)
    order = jnp.argsort(experts, stable=True)
    return order // top_k, experts[order], weights.reshape(-1)[order].astype(x.dtype)


def _counts(ids: jax.Array, n: int) -> jax.Array:
    """How many of ``ids`` equal each of 0..n-1 (others are not counted)."""
    return jnp.sum(ids[:, None] == jnp.arange(n), axis=0, dtype=jnp.int32)


def moe(params: Params, x: jax.Array, top_k: int, experts: Experts) -> jax.Array:
    """The MoE layer on one device: ``x`` (T, D) -> (T, D)."""
    token, expert, weight = _sort_by_expert(x, params["router"], top_k)
    sizes = _counts(expert, params["gate_kernel"].shape[0])
    out = experts(params, x[token], sizes, expert, weight[:, None])
    return jnp.zeros_like(x).at[token].add(out)


def moe_expert_parallel(params: Params, x: jax.Array, top_k: int, experts: Experts, mesh: jax.sharding.Mesh,
                        axis: str = "expert") -> jax.Array:
    """``moe`` with the experts and the tokens sharded over ``mesh``'s ``axis`` (the router
    replicated); tokens travel to their experts' devices and back by ``all_to_all``."""
    specs = {name: P() if name == "router" else P(axis) for name in params}
    body = functools.partial(_expert_parallel_body, top_k=top_k, experts=experts, axis=axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis)), out_specs=P(axis))(params, x)


def _expert_parallel_body(params: Params, x: jax.Array, *, top_k: int, experts: Experts, axis: str) -> jax.Array:
    devices, local = jax.lax.axis_size(axis), params["gate_kernel"].shape[0]
    token, expert, weight = _sort_by_expert(x, params["router"], top_k)
    copies = expert.size
    # each device gets a buffer of `copies` rows from every device, room for all of them, so
    # no copy is dropped however the router skews; a copy's slot is its rank among those sent
    # to the same device (they are contiguous, being sorted by expert)
    dest = expert // local
    slot = jnp.arange(copies) - jnp.searchsorted(dest, dest)

    def exchange(v, fill):
        buffers = jnp.full((devices, copies, *v.shape[1:]), fill, v.dtype).at[dest, slot].set(v)
        return jax.lax.all_to_all(buffers, axis, 0, 0).reshape(devices * copies, *v.shape[1:])

    # empty slots get expert `local`: past every local group, so they sort last and give 0
    ids = exchange(expert % local, local)
    order = jnp.argsort(ids, stable=True)
    rows, weights = exchange(x[token], 0)[order], exchange(weight, 0)[order]
    out = experts(params, rows, _counts(ids, local), ids[order], weights[:, None])
    back = jnp.zeros_like(out).at[order].set(out).reshape(devices, copies, -1)
    back = jax.lax.all_to_all(back, axis, 0, 0)
    return jnp.zeros_like(x).at[token].add(back[dest, slot])


class MoE(nn.Module):
    """A top-k routed layer of SwiGLU experts over tokens ``x`` (T, D) (T divisible by the mesh's
    ``"expert"`` axis when there is one). Parameters: ``router`` (D, E), and for
    ``gate``, ``up`` and ``down`` an ``{name}_kernel`` (E, in, out) and ``{name}_bias`` (E, out).
    ``implementation`` is a key of ``EXPERTS``; ``dtype`` the computation's (the router's is
    float32); with a ``mesh``, the experts and tokens are sharded over its ``"expert"`` axis."""

    num_experts: int
    hidden: int
    top_k: int = 2
    implementation: str = "grouped_gemm"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        e, h, d = self.num_experts, self.hidden, x.shape[-1]
        kernel = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        p = {"router": self.param("router", nn.initializers.lecun_normal(), (d, e), self.param_dtype)}
        for name, (fan_in, fan_out) in {"gate": (d, h), "up": (d, h), "down": (h, d)}.items():
            p[f"{name}_kernel"] = self.param(f"{name}_kernel", kernel, (e, fan_in, fan_out), self.param_dtype)
            p[f"{name}_bias"] = self.param(f"{name}_bias", nn.initializers.zeros, (e, fan_out), self.param_dtype)
        p = {k: v if k == "router" else v.astype(self.dtype) for k, v in p.items()}
        x, experts = x.astype(self.dtype), EXPERTS[self.implementation]
        if self.mesh is None:
            return moe(p, x, self.top_k, experts)
        return moe_expert_parallel(p, x, self.top_k, experts, self.mesh)


def batches(key: jax.Array, tokens: int, width: int, centres: int) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Endless (x, y) batches: tokens around ``centres`` random centres, ``y = tanh(x @ M_c)``
    for the centre c a token is drawn around."""
    k1, k2, key = jax.random.split(key, 3)
    centre = 2 * jax.random.normal(k1, (centres, width))
    maps = jax.random.normal(k2, (centres, width, width)) / np.sqrt(width)

    @jax.jit
    def draw(key):
        kc, kx = jax.random.split(key)
        c = jax.random.randint(kc, (tokens,), 0, centres)
        x = centre[c] + jax.random.normal(kx, (tokens, width))
        # each centre's map on its own tokens (gathering a map per token would take tokens x width^2)
        y = sum(jnp.where((c == i)[:, None], x @ maps[i], 0.0) for i in range(centres))
        return x, jnp.tanh(y)

    while True:
        key, k = jax.random.split(key)
        yield draw(k)


def make_step(apply: Callable[[Params, jax.Array], jax.Array], opt: optax.GradientTransformation) -> Callable:
    """A jitted step of ``opt`` on the squared error of ``apply(params, x)`` against ``y``."""

    def loss_fn(params, x, y):
        return jnp.mean((apply(params, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(apply: Callable[[Params, jax.Array], jax.Array], params: Params,
          args: argparse.Namespace) -> tuple[list[float], float]:
    """``args.steps`` steps on the same batches for every layer; returns (losses, ms a step,
    the median after the first two)."""
    opt = optax.adamw(args.lr)
    step, opt_state = make_step(apply, opt), opt.init(params)
    data = batches(jax.random.key(0), args.tokens, args.width, args.centres)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = next(data)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x.astype(args.dtype), y)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    return losses, 1e3 * float(np.median(times[2:] or times))


def check_expert_parallel(model: MoE, params: Params, x: jax.Array, mesh: jax.sharding.Mesh) -> float:
    """The largest difference between ``model`` with its experts sharded over ``mesh`` and on one
    device, relative to the largest value, over the output and the gradients of a loss in every
    parameter and in ``x``."""

    @functools.partial(jax.jit, static_argnums=0)
    def results(m, params, x):
        f = lambda p, x: m.apply({"params": p}, x)
        loss = lambda p, x: jnp.sum(jnp.sin(f(p, x).astype(jnp.float32)))
        return jax.tree.leaves((f(params, x), jax.grad(loss, (0, 1))(params, x)))

    worst = 0.0
    for a, b in zip(results(model.clone(mesh=mesh), params, x), results(model, params, x)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return worst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256, help="tokens a batch")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64, help="each expert's hidden width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--centres", type=int, default=8, help="clusters in the synthetic data")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--expert-parallel", type=int, default=0, metavar="D",
                   help="also run the layer with its experts sharded over D devices")
    p.add_argument("--cpu-devices", type=int, default=0, help="fake this many host devices")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    args.dtype = jnp.dtype(args.dtype)

    model = MoE(args.experts, args.hidden, args.top_k, dtype=args.dtype)
    x0, _ = next(batches(jax.random.key(0), args.tokens, args.width, args.centres))
    params0 = jax.jit(model.init)(jax.random.key(1), x0)["params"]
    layers = {name: model.clone(implementation=name) for name in EXPERTS}
    print(f"backend: {jax.default_backend()}; {args.tokens} tokens of width {args.width}, {args.experts} "
          f"experts of hidden width {args.hidden}, top-{args.top_k}, {args.dtype.name}, {args.steps} AdamW steps")
    if args.expert_parallel:
        mesh = jax.make_mesh((args.expert_parallel,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
        worst = check_expert_parallel(model, params0, x0.astype(args.dtype), mesh)
        print(f"expert parallel over {args.expert_parallel} devices: output and gradients within {worst:.1e} "
              "of one device's (relative to the largest)")
        assert worst < (1e-5 if args.dtype == jnp.float32 else 2e-2), worst
        layers["expert-parallel"] = model.clone(mesh=mesh)

    curves, ms = {}, {}
    for name, layer in layers.items():
        curves[name], ms[name] = train(lambda p, x: layer.apply({"params": p}, x), params0, args)
    names = list(layers)
    print("mean loss over steps")
    print("           " + "  ".join(f"{k:>15s}" for k in names))
    for i in range(0, args.steps, args.log_every):
        j = min(i + args.log_every, args.steps)
        print(f"{i:4d}-{j - 1:<4d}  " + "  ".join(f"{np.mean(curves[k][i:j]):15.5f}" for k in names))
    for name in names:
        print(f"{name:15s} {ms[name]:8.2f} ms a step ({ms['ragged_dot'] / ms[name]:.2f}x ragged_dot)")
    # every layer learns (its last tenth's loss is well under its first's), and the curves agree
    window = max(1, args.steps // 10)
    head = {k: float(np.mean(curves[k][:window])) for k in names}
    tail = {k: float(np.mean(curves[k][-window:])) for k in names}
    gap = max(abs(a - b) / b for k in names for a, b in zip(curves[k], curves["ragged_dot"]))
    print(f"largest relative difference between the curves: {gap:.1e}")
    assert all(tail[k] < 0.7 * head[k] for k in names), (head, tail)
    assert gap < (1e-4 if args.dtype == jnp.float32 else 5e-2), gap


if __name__ == "__main__":
    main()
