"""Train a small MLP with Flax and optax, with ``FusedDense`` and with ``nn.Dense``, side by side.

``jax_efc.flax.linen.FusedMLP`` (two ``FusedDense``, the GELU fused into the first) and the same
MLP of ``nn.Dense`` start from the same parameters (``FusedDense`` has ``nn.Dense``'s tree)
and train on the same synthetic regression data; the losses must agree step by step. Prints
the step times and which backend ran each GEMM of the training step (forward and backward).

    python examples/flax_mlp.py [--steps 50] [--batch 256] [--features 64,256,16] [--dtype float32]
"""

import argparse
import statistics
import time

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


def train(model: nn.Module, params, data, steps: int) -> tuple[list[float], float, list[str]]:
    """Adam on the mean squared error; returns the losses, the median step time and the
    backend of each GEMM in the step."""
    opt = optax.adam(1e-3)
    x, y = data

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    used = efc.backends(step, params, opt_state, x, y)
    step = jax.jit(step)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))  # blocks: the step time includes the loss transfer
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[1:] or times), used


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
    fused_losses, fused_t, used = train(fused, params, (x, y), args.steps)
    plain_losses, plain_t, _ = train(plain, params, (x, y), args.steps)

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
