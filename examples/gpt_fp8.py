"""A GPT-style language model trained in bf16 and in FP8, side by side: the same model, data and
initial parameters with each kind of dense layer, printing the loss curves and the time a step
takes.

Layers (``--layers``, any of):
- ``dense``: ``flax.linen.Dense`` in bf16 (the baseline);
- ``fused``: ``jax_efc.flax.FusedDense`` and ``FusedMLP`` in bf16 (the MLP's activation fused
  into its first GEMM, its derivative into the backward's);
- ``fp8``: the same with ``fp8="delayed"``: e4m3 activations and weights, e5m2 gradients,
  delayed scaling from amax histories, dequantisation and bias fused into each FP8 GEMM; the MLP
  (``jax_efc.fp8_mlp``) writes its hidden value and its gradient only in FP8, their amaxes taken
  in the GEMMs' epilogues; partial sums promoted into fp32 every few k-blocks;
- ``fp8-fast``: ``fp8`` with the tensor cores' fast FP8 accumulation (what XLA's FP8 dot, and so
  ``flax-fp8``, runs);
- ``flax-fp8``: ``nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)``, Flax's FP8 recipe on XLA.

The data is synthetic: each sequence follows ``t[i+1] = (a * t[i] + c) mod vocab`` with a
per-sequence ``a, c``, one token in ten replaced at random, so the loss falls as the model learns
to read the rule from the context. Runs anywhere (the XLA reference off the GPU); the defaults are
small; the benchmark model is

    python examples/gpt_fp8.py --blocks 4 --width 2048 --heads 16 --batch 8 --seq 2048 --steps 300 \\
        --layers dense,fp8,flax-fp8 [--attention cudnn]
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_efc as efc
from jax_efc.flax import FusedDense, FusedMLP

LAYERS = ("dense", "fused", "fp8", "fp8-fast", "flax-fp8")
_FAST = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM


def _ours(layers: str) -> dict | None:
    """FusedDense's and FusedMLP's FP8 arguments for our ``layers``; None for Flax's layers."""
    return {"fused": {}, "fp8": {"fp8": "delayed"},
            "fp8-fast": {"fp8": "delayed", "precision": _FAST}}.get(layers)
_LR = 3e-3  # the peak learning rate at width 128
_OWG = "_overwrite_with_gradient"  # Flax's collection for FP8 state: replaced by its gradient


def make_dense(layers: str):
    """``dense(features, name, activation=None)``: one projection of the chosen kind."""

    def dense(features: int, name: str, activation: str | None = None):
        if (ours := _ours(layers)) is not None:
            return FusedDense(features, dtype=jnp.bfloat16, activation=activation, name=name, **ours)
        extra = {"dot_general_cls": nn.Fp8DirectDotGeneralOp} if layers == "flax-fp8" else {}
        layer = nn.Dense(features, dtype=jnp.bfloat16, name=name, **extra)
        return layer if activation is None else lambda x: efc.ACTIVATIONS[activation](layer(x))

    return dense


class Mlp(nn.Module):
    """``down(gelu_tanh(up(x)))`` from ``make_dense``'s layers (the parameters ``FusedMLP``
    has, so every kind of layer starts from the same ones)."""

    hidden: int
    layers: str

    @nn.compact
    def __call__(self, x):
        dense = make_dense(self.layers)
        return dense(x.shape[-1], "down")(dense(self.hidden, "up", "gelu_tanh")(x))


def make_mlp(layers: str, hidden: int):
    """The block's MLP: ``FusedMLP`` for our layers, else ``Mlp`` of the chosen ``nn.Dense``."""
    if (ours := _ours(layers)) is not None:
        return FusedMLP(hidden, activation="gelu_tanh", dtype=jnp.bfloat16, name="mlp", **ours)
    return Mlp(hidden, layers, name="mlp")


class Block(nn.Module):
    """Pre-norm causal attention and a 4x GELU MLP."""

    width: int
    heads: int
    layers: str
    attention: str

    @nn.compact
    def __call__(self, x):
        dense = make_dense(self.layers)
        b, t, d = x.shape
        h = nn.LayerNorm(dtype=x.dtype)(x)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in jnp.split(dense(3 * d, "qkv")(h), 3, axis=-1))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + dense(d, "proj")(a.reshape(b, t, d))
        return x + make_mlp(self.layers, 4 * d)(nn.LayerNorm(dtype=x.dtype)(x))


class Gpt(nn.Module):
    vocab: int
    blocks: int
    width: int
    heads: int
    layers: str
    attention: str | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, dtype=jnp.bfloat16)(tokens)
        for i in range(self.blocks):
            x = Block(self.width, self.heads, self.layers, self.attention, name=f"block{i}")(x)
        return nn.Dense(self.vocab, dtype=jnp.float32, name="head")(nn.LayerNorm(dtype=x.dtype)(x))


def batches(key, batch: int, seq: int, vocab: int):
    """Endless synthetic batches of ``seq + 1`` tokens (inputs and next-token targets)."""
    while True:
        key, k1, k2, k3, k4, k5 = jax.random.split(key, 6)
        a = jax.random.randint(k1, (batch, 1), 1, vocab)
        c = jax.random.randint(k2, (batch, 1), 0, vocab)
        start = jax.random.randint(k3, (batch, 1), 0, vocab)
        steps = jnp.arange(seq + 1)
        # t[i] = a^i * t0 + c * (a^(i-1) + ... + 1), computed by scanning the rule
        seqs = jax.lax.scan(lambda t, _: ((a[:, 0] * t + c[:, 0]) % vocab,) * 2, start[:, 0], steps)[1].T
        noise = jax.random.bernoulli(k4, 0.1, seqs.shape)
        yield jnp.where(noise, jax.random.randint(k5, seqs.shape, 0, vocab), seqs)


def training_step(model: nn.Module, opt: optax.GradientTransformation):
    """The jitted step ``(variables, opt_state, tokens) -> (variables, opt_state, loss)``:
    next-token cross-entropy, one optimizer update, FP8 state replaced by its gradient."""
    def loss_fn(v, tokens):
        logits = model.apply(v, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(v, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(v, tokens)
        updates, opt_state = opt.update(grads["params"], opt_state, v["params"])
        new = {**v, "params": optax.apply_updates(v["params"], updates)}
        if _OWG in v:  # FP8 state: its gradient is its next value
            new[_OWG] = grads[_OWG]
        return new, opt_state, loss

    return step


def timed_step(layers: str, attention: str | None = None, *, blocks: int = 4, width: int = 2048, heads: int = 16,
               batch: int = 8, seq: int = 2048, vocab: int = 64):
    """(the jitted training step of the model with ``layers``, its arguments: fresh parameters and
    optimizer state and one random batch), to time or profile a step alone; the defaults are the
    benchmark model."""
    model = Gpt(vocab, blocks, width, heads, layers, attention)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, vocab)
    variables = model.init(jax.random.key(1), tokens[:, :-1])
    opt = optax.adamw(1e-4)
    return training_step(model, opt), (variables, opt.init(variables["params"]), tokens)


def train(layers: str, args, params0=None):
    """Train ``args.steps`` steps from ``params0`` (None: a fresh init); returns (losses, ms per
    step after the first two, the initial parameters)."""
    model = Gpt(args.vocab, args.blocks, args.width, args.heads, layers, args.attention)
    data = batches(jax.random.key(0), args.batch, args.seq, args.vocab)
    first = next(data)
    variables = model.init(jax.random.key(1), first[:, :-1])
    if params0 is not None:  # every kind of layer starts from the same parameters
        variables = {**variables, "params": params0}
    params0 = variables["params"]
    lr = args.lr or _LR * min(1.0, 128 / args.width)
    opt = optax.adamw(optax.linear_schedule(0.0, lr, max(1, args.steps // 10)))
    opt_state = opt.init(variables["params"])

    step = training_step(model, opt)
    losses, times = [], []
    tokens = first
    for i in range(args.steps):
        t0 = time.perf_counter()
        variables, opt_state, loss = step(variables, opt_state, tokens)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        # made before the next step's timer starts: the batch's scan runs on the device, and left
        # in flight its time would count in that step's
        tokens = jax.block_until_ready(next(data))
    ms = 1e3 * float(np.median(times[2:])) if len(times) > 2 else float("nan")
    return losses, ms, params0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="dense,fp8", help=f"comma-separated, from {','.join(LAYERS)}")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=None,
                   help=f"AdamW's peak learning rate, reached after a tenth of the steps (default: {_LR} "
                        "at width 128 and below, scaled down as 1/width above: 3e-3 diverged at width 2048)")
    p.add_argument("--attention", choices=("xla", "cudnn"), default=None,
                   help="jax.nn.dot_product_attention's implementation (default: JAX's choice)")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    kinds = args.layers.split(",")
    for kind in kinds:
        if kind not in LAYERS:
            p.error(f"--layers: {kind!r} is not one of {', '.join(LAYERS)}")
    print(f"backend: {jax.default_backend()}; {args.blocks} blocks, width {args.width}, batch {args.batch} x "
          f"{args.seq} tokens, vocab {args.vocab}, {args.steps} AdamW steps")
    curves, ms, start = {}, {}, None
    for kind in kinds:
        curves[kind], ms[kind], start = train(kind, args, start)
    print("mean loss over steps")
    print("           " + "  ".join(f"{k:>9s}" for k in kinds))
    for i in range(0, args.steps, args.log_every):
        j = min(i + args.log_every, args.steps)
        print(f"{i:4d}-{j - 1:<4d}  " + "  ".join(f"{np.mean(curves[k][i:j]):9.4f}" for k in kinds))
    base = kinds[0]
    for kind in kinds:
        print(f"{kind:9s} {ms[kind]:9.2f} ms a step ({ms[base] / ms[kind]:.2f}x {base})")
    # the check: every kind learns (its last tenth's loss is well under its first's) and the
    # kinds agree to a small fraction of chance's loss
    window = max(1, args.steps // 10)
    head = {k: float(np.mean(curves[k][:window])) for k in kinds}
    tail = {k: float(np.mean(curves[k][-window:])) for k in kinds}
    assert all(tail[k] < 0.9 * head[k] for k in kinds), (head, tail)
    assert max(tail.values()) - min(tail.values()) < 0.05 * np.log(args.vocab), tail


if __name__ == "__main__":
    main()
