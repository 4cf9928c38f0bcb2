"""Train a small MLP with Flax and optax, with ``FusedMLP`` and with ``nn.Dense``, side by side.

``jax_efc.flax.linen.FusedMLP`` (``jax_efc.fused_mlp``: the GELU fused into the first GEMM, its
derivative into the backward's data-gradient GEMM) and the same MLP of ``nn.Dense`` start from
the same parameters (``FusedMLP``'s layers keep ``nn.Dense``'s tree) and train on the same
synthetic regression data, one step of each in turn; the losses must agree step by step.
Prints the median step times and which backend ran each GEMM of the training step (forward
and backward).

    python examples/flax_mlp.py [--steps 50] [--batch 256] [--features 64,256,16] [--dtype float32]
"""

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_efc as efc
from jax_efc.flax.linen import FusedMLP


class PlainMLP(nn.Module):
    """The same MLP with nn.Dense, its layers named like FusedMLP's ("up", "down")."""

    hidden: int
    out: int
    dtype: str

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.hidden, dtype=self.dtype, name="up")(x))  # nn.gelu is the tanh form
        return nn.Dense(self.out, dtype=self.dtype, name="down")(h)


def make_step(model: nn.Module, params, data) -> tuple[Callable, Any, list[str]]:
    """A jitted Adam step on the mean squared error, its first optimizer state, and the
    backend of each GEMM in the step."""
    opt = optax.adam(1e-3)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    return jax.jit(step), opt_state, efc.backends(step, params, opt_state, *data)


def train_side_by_side(models: Sequence[nn.Module], params, data, steps: int
                       ) -> tuple[list[list[float]], list[float], list[str]]:
    """Trains the models from the same parameters, one step of each in turn (the order
    reversed every step, so that each follows the other equally often and a drift of the
    GPU's clock hits them alike). Returns each model's losses and median step time, and the
    first model's GEMM backends."""
    runs = [make_step(model, params, data) for model in models]
    states = [[params, opt_state] for _, opt_state, _ in runs]
    losses, times = [[] for _ in models], [[] for _ in models]
    for i in range(steps):
        for j in (range(len(models)) if i % 2 == 0 else reversed(range(len(models)))):
            t0 = time.perf_counter()
            *states[j], loss = runs[j][0](*states[j], *data)
            losses[j].append(float(loss))  # blocks: the step time includes the loss transfer
            times[j].append(time.perf_counter() - t0)
    return losses, [statistics.median(t[1:] or t) for t in times], runs[0][2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--features", default="64,256,16", help="in,hidden,out")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="computation dtype (parameters stay float32)")
    args = p.parse_args()
    d_in, hidden, d_out = (int(v) for v in args.features.split(","))
    kx, kw, kn, kp = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (args.batch, d_in))
    w_true = jax.random.normal(kw, (d_in, d_out)) / np.sqrt(d_in)
    y = jnp.tanh(x @ w_true) + 0.01 * jax.random.normal(kn, (args.batch, d_out))

    fused = FusedMLP(hidden, d_out, activation="gelu_tanh", dtype=args.dtype)
    plain = PlainMLP(hidden, d_out, args.dtype)
    params = plain.init(kp, x)  # the plain model's parameters serve both
    assert jax.tree.structure(fused.init(kp, x)) == jax.tree.structure(params)
    (fused_losses, plain_losses), (fused_t, plain_t), used = train_side_by_side(
        [fused, plain], params, (x, y), args.steps)

    rel = np.abs(np.array(fused_losses) - plain_losses) / np.abs(plain_losses)
    tol = 5e-3 if args.dtype == "float32" else 5e-2  # float32: the GPU may use TF32
    ok = bool(rel.max() < tol) and fused_losses[-1] < fused_losses[0]
    print(f"jax_efc FusedMLP vs nn.Dense: MLP {d_in}->{hidden}->{d_out}, batch {args.batch}, "
          f"{args.dtype}, {args.steps} adam steps, on {jax.devices()[0].device_kind}")
    print(f"backends of the training step's {len(used)} fused GEMMs: {'; '.join(dict.fromkeys(used))}")
    print(f"  loss: first {fused_losses[0]:.4f}, last {fused_losses[-1]:.4f} (nn.Dense: {plain_losses[-1]:.4f})")
    print(f"  largest relative loss difference over the run {rel.max():.2e} ({'ok' if ok else 'FAIL'})")
    print(f"  median step time: FusedMLP {fused_t * 1e3:.3f} ms, nn.Dense {plain_t * 1e3:.3f} ms")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
