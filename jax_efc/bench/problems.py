"""The problems a benchmark measures: the shape sets, the named epilogues and training steps,
and for each a :class:`Problem` (our jitted function, plain JAX's, and a float32 reference)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import activations, example_epilogues
from ..config import GemmConfig
from ..gated import DEFAULT_BLOCK, interleave_gated, split_gated
from ..grouped import grouped_gemm
from ..mlp import fused_mlp
from ..ops import fused_dense, gemm

Shape = tuple[int, int, int, int]  # M, N, K, L
_FFN = ((4096, 14336), (14336, 4096), (4096, 4096), (8192, 28672))  # (K, N) of LLM FFN layers
STANDARD_SHAPES: list[Shape] = (
    [(8192, 8192, 8192, 1)]
    + [(m, n, k, 1) for m in (4096, 8192, 16384) for k, n in _FFN]
    + [(m, n, k, 1) for m in (128, 1000, 2048) for k, n in ((4096, 4096), (4096, 14336))]
)
QUICK_SHAPES: list[Shape] = [(8192, 8192, 8192, 1), (8192, 14336, 4096, 1), (1000, 4096, 4096, 1)]
EPILOGUES = ("gemm", "bias+gelu_tanh", "bias+gelu", "bias+silu", "alpha-beta")
# a plain GEMM reading A stored (K, M) ("gemm-at": a weight gradient's x^T @ dy) or B stored
# (N, K) ("gemm-bt": a data gradient's dy @ W^T), against XLA's dot of the same transposes: a
# training step's GEMMs one by one; measured only when asked for
TRANSPOSED_GEMMS = ("gemm-at", "gemm-bt")
# a dense layer's training step: its output and the gradients of x, kernel and bias for a given
# output cotangent (three GEMMs); measured only when asked for
TRAIN_EPILOGUES = tuple(f"train:{e}" for e in EPILOGUES if e.startswith("bias+"))
# a two-layer MLP's training step (fused_mlp), K -> N -> K over M rows: plain, gated with the gate
# and up projections as two GEMMs, and gated as one GEMM on their interleaved kernel
# ("interleaved"); measured only when asked for
MLP_STEPS = ("train:mlp+gelu_tanh", "train:gated_mlp+silu", "train:interleaved_mlp+silu")
# a gated layer's forward, act(x @ Wg + bg) * (x @ Wu + bu), hidden width N: one gated GEMM
# (gate and up interleaved in blocks of 64) against plain JAX's two GEMMs and the epilogue;
# measured only when asked for
GATED_EPILOGUES = ("gated:swiglu", "gated:geglu")
# L dense layers of width K under lax.scan over stacked kernels and biases (shape M,K,K,L), as
# models that scan their layers run them: the forward, or with "train:" the training step
SCAN_EPILOGUES = tuple(f"{step}scan:{e}" for step in ("", "train:") for e in EPILOGUES if e.startswith("bias+"))
# 8-bit float (e4m3) A and B whatever --dtype says, against XLA's FP8 dot of the same arithmetic
# in the same layout: B stored (N, K) (K-major, the layout both the WGMMA and XLA's fastest FP8
# dot read) or, with "fp8kn", (K, N); a plain GEMM to bf16, and per-tensor scales (dynamic
# scalars) + bias + gelu_tanh to bf16 or to e4m3. Ours promotes partial sums into fp32 (the
# default), against XLA's dot at precision HIGHEST (which promotes them too), or, "...fast",
# accumulates in the WGMMA alone, against XLA's default (fast accumulation, its fastest). And
# int8 A and B (K-major) to int32 against XLA's int8 dot.
EIGHT_BIT_EPILOGUES = tuple(f"{layout}{mode}:{e}" for mode in ("", "fast") for layout, e in (
    ("fp8", "gemm"), ("fp8kn", "gemm"), ("fp8", "scaled+bias+gelu_tanh"), ("fp8", "scaled+bias+gelu_tanh->fp8"))
) + ("int8:gemm",)
# an epilogue with a reduction beside its tile: bias+gelu_tanh and the column sums of its output
# (a bias gradient's shape, in fp32), against plain JAX's gelu and sum; set against bias+gelu_tanh
# in one run, what the reduction costs the kernel (run only when asked); "-atomic": the sums
# folded across tiles by atomics (gemm(deterministic=False))
REDUCTION_EPILOGUES = ("bias+gelu_tanh+colsum", "bias+gelu_tanh+colsum-atomic")
# a row softmax of a narrow layer (a router's or a classifier's logits), which the kernel finishes
# in tiles that span the rows (N <= epilogue.ROW_TILE_N), against plain JAX's softmax; run only
# when asked
ROW_EPILOGUES = ("bias+softmax",)
# fp8_dense's training step (output, gradients of x, kernel and bias; delayed scaling from a
# one-entry history): "fp8train:" against Flax's FP8 Dense on XLA with the same meta,
# "fp8train-fast:" the same with fast accumulation (as XLA's FP8 dot), and "fp8train-bf16:"
# against the bf16 dense layer in plain JAX; measured only when asked for
FP8_TRAIN_STEPS = ("fp8train:bias+gelu_tanh", "fp8train-fast:bias+gelu_tanh", "fp8train-bf16:bias+gelu_tanh")
# a Mixture-of-Experts layer's expert GEMM (shape M,N,K,G: M tokens sorted by expert over G
# experts, each (K, N) with its own bias), silu(ragged_dot + bias[expert]): ours one grouped GEMM,
# against XLA's ragged_dot and the epilogue after it; "grouped" gives the experts equal shares of
# the tokens, "grouped-skewed" shares falling by 0.6 an expert (the last ones nearly empty); the
# "grouped-wgrad" ones time the experts' weight gradient (G, K, N), each expert's rows of x
# transposed times the output gradient's, against ragged_dot's own (its VJP)
GROUPED_EPILOGUES = ("grouped:bias+silu", "grouped-skewed:bias+silu", "grouped-wgrad:gemm",
                     "grouped-wgrad-skewed:gemm")
NAMED_EPILOGUES = (EPILOGUES + TRANSPOSED_GEMMS + TRAIN_EPILOGUES + MLP_STEPS + SCAN_EPILOGUES
                   + EIGHT_BIT_EPILOGUES + REDUCTION_EPILOGUES + ROW_EPILOGUES + FP8_TRAIN_STEPS + GATED_EPILOGUES
                   + GROUPED_EPILOGUES)  # every name --epilogues takes
ALPHA_BETA_SCALARS = {"alpha": 2.0, "beta": 1.0, "x_factor": 3.0}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fused GEMM to measure. ``ours``, ``baseline`` and ``reference`` (float32 math on
    float32 copies of the inputs) are jitted functions of the inputs described by ``specs``
    (``a``, ``b``, then the epilogue's operands). ``gemms``: the M x N x K GEMMs a call runs
    (what its TFLOP/s count, of the shape's L each; a grouped GEMM's L groups share M: 1 / L).
    ``stds``: each input's standard deviation (default 1). ``derive``: maps the random inputs
    to the ones both functions take, where some are computed from others (a gated GEMM's
    interleaved weight from the two halves plain JAX multiplies). ``gemms_alone``: the
    problem's GEMMs without their epilogues (our plain GEMMs of the same operands), for
    ``--bound``: the baseline's time over it bounds the ratio fusing the rest can reach;
    ``baseline_gemms_alone``: the same GEMMs as XLA's dots, whose bound is the ratio fusing
    the rest could reach with GEMMs at XLA's speed."""

    epilogue: str
    shape: Shape
    dtype: str
    config: str  # "auto" (the heuristic) or the pinned GemmConfig, as given on the command line
    specs: tuple[jax.ShapeDtypeStruct, ...]
    ours: Callable[..., Any]
    baseline: Callable[..., Any]
    reference: Callable[..., Any]
    gemms: float = 1
    stds: tuple[float, ...] = ()
    derive: Callable[..., tuple[Any, ...]] | None = None
    gemms_alone: Callable[..., Any] | None = None
    baseline_gemms_alone: Callable[..., Any] | None = None

    def inputs(self, key: Any) -> tuple[Any, ...]:
        """A set of inputs drawn with ``key``."""
        drawn = random_inputs(self.specs, key, self.stds)
        return self.derive(*drawn) if self.derive else drawn


def _our_matmul(a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False) -> Any:
    return gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def _xla_matmul(a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False) -> Any:
    return (jnp.swapaxes(a, -1, -2) if transpose_a else a) @ (jnp.swapaxes(b, -1, -2) if transpose_b else b)


def _gemms_alone(gemms: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """``Problem``'s ``gemms_alone`` and ``baseline_gemms_alone`` from ``gemms(matmul, *inputs)``,
    which runs a problem's GEMMs through ``matmul(a, b, transpose_a, transpose_b)``."""
    return {"gemms_alone": jax.jit(functools.partial(gemms, _our_matmul)),
            "baseline_gemms_alone": jax.jit(functools.partial(gemms, _xla_matmul))}


def _identity(acc: Any) -> Any:
    return acc


def _bias_softmax(acc: Any, bias: Any) -> Any:
    return jax.nn.softmax(acc + bias, axis=-1)


@functools.lru_cache(maxsize=None)
def _bias_activation(name: str) -> Callable[..., Any]:
    act = activations.resolve(name)

    def epilogue(acc, bias):
        return act(acc + bias)

    return epilogue


def _cast(tree: Any, out_dtypes: Any, default: Any) -> Any:
    """Each output of an epilogue converted as ``gemm(out_dtypes=...)`` would store it."""
    if isinstance(out_dtypes, dict):
        return {k: v.astype(out_dtypes.get(k, default)) for k, v in tree.items()}
    if isinstance(out_dtypes, (tuple, list)):
        return type(tree)(v.astype(d) for v, d in zip(tree, out_dtypes))
    return jax.tree.map(lambda v: v.astype(out_dtypes or default), tree)


def epilogue_problem(
    name: str,
    fn: Callable[..., Any],
    shape: Shape,
    dtype: Any,
    operands: Sequence[tuple[str, Any]] = (),
    *,
    scalars: dict[str, Any] | None = None,
    out_dtypes: Any = None,
    acc_dtype: Any = None,
    epi_dtype: Any = None,
    config: GemmConfig | str | None = None,
    ours: Callable[..., Any] | None = None,
    majors: tuple[str, str, str] = ("k", "n", "n"),
) -> Problem:
    """A problem for ``fn(acc, *operands, **scalars)``: ours is ``jax_efc.gemm`` (or the
    given ``ours``), the baseline is ``fn(a @ b, ...)`` in plain JAX. ``operands`` are
    (role, dtype) with role "tile" ((L,) M, N) or "row" (N,). ``majors`` are the contiguous
    dimensions of A ("k" or "m"), B ("n" or "k") and the tile operands ("n" or "m"), as in
    CUTLASS's examples: A and B are read in place either way; M-major tile operands are
    transposed before our GEMM (jax_efc reads them N-major), and the time counts it."""
    m, n, k, l = shape
    a_major, b_major, c_major = majors
    ta, tb, tc = a_major == "m", b_major == "k", c_major == "m"
    lead = (l,) if l > 1 else ()
    dims = {"tile": (*lead, n, m) if tc else (*lead, m, n), "row": (n,)}
    specs = (jax.ShapeDtypeStruct((*lead, k, m) if ta else (*lead, m, k), dtype),
             jax.ShapeDtypeStruct((*lead, n, k) if tb else (*lead, k, n), dtype),
             *(jax.ShapeDtypeStruct(dims[role], dt) for role, dt in operands))
    scalars = scalars or {}
    tiles = [role == "tile" for role, _ in operands]

    def stored(a, b, ops):
        """A, B and the operands as the math reads them: (M, K), (K, N), tiles (M, N)."""
        a = jnp.swapaxes(a, -1, -2) if ta else a
        b = jnp.swapaxes(b, -1, -2) if tb else b
        return a, b, [jnp.swapaxes(x, -1, -2) if tc and t else x for x, t in zip(ops, tiles)]

    if ours is None:
        def ours(a, b, *ops):
            ops = [jnp.swapaxes(x, -1, -2) if tc and t else x for x, t in zip(ops, tiles)]
            return gemm(a, b, fn, *ops, out_dtypes=out_dtypes, acc_dtype=acc_dtype, epi_dtype=epi_dtype,
                        config=config, transpose_a=ta, transpose_b=tb, **scalars)

    def baseline(a, b, *ops):
        a, b, ops = stored(a, b, ops)
        return _cast(fn(a @ b, *ops, **scalars), out_dtypes, a.dtype)

    def reference(a, b, *ops):
        a, b, ops = stored(*(x.astype(jnp.float32) for x in (a, b)), [x.astype(jnp.float32) for x in ops])
        acc = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        return fn(acc, *ops, **scalars)

    def gemm_alone(mm, a, b, *ops):
        return mm(a, b, ta, tb)

    return Problem(name, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(ours), jax.jit(baseline), jax.jit(reference), **_gemms_alone(gemm_alone))


def _training_step(layer: Callable[..., Any]) -> Callable[..., Any]:
    """``f(*inputs, dy)``: ``layer``'s output and the gradients of all its inputs for the
    output cotangent ``dy``."""
    def f(*inputs):
        *args, dy = inputs
        y, pullback = jax.vjp(layer, *args)
        return (y, *pullback(dy))
    return f


def _in_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on float32 copies of its inputs: the reference a step problem is checked against."""
    def f(*inputs):
        return fn(*(v.astype(jnp.float32) for v in inputs))
    return f


def train_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                  config: GemmConfig | str | None = None) -> Problem:
    """``epilogue`` = "train:bias+<activation>": a dense layer's training step, the output of
    ``activation(x @ kernel + bias)`` and, for a random output cotangent, the gradients of x,
    kernel and bias (``jax.vjp``). Ours is ``fused_dense`` (forward kernel, then two
    backward GEMMs), the baseline the same layer in plain JAX.

    The kernel is drawn with variance 1/K, as ``nn.Dense`` initializes it, so the
    pre-activations are of order 1, as in a model. With a standard-normal kernel they are of
    order sqrt(K): the activation saturates, and the backward GEMMs multiply a derivative
    that is about half zeros (GELU; silu: nearly) and half copies of the output cotangent."""
    act = epilogue.removeprefix("train:bias+")
    m, n, k, l = shape
    if l > 1:
        raise ValueError(f"{epilogue} is a dense layer: give M,N,K without a batch")
    fn = _bias_activation(act)
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,), (m, n)))

    def ours(x, kernel, bias):
        return fused_dense(x, kernel, bias, activation=act, config=config)

    def plain(x, kernel, bias):
        return fn(x @ kernel, bias)

    def exact(x, kernel, bias):
        return fn(jnp.matmul(x, kernel, precision=jax.lax.Precision.HIGHEST), bias)

    def gemms_alone(mm, x, kernel, bias, dy):  # the forward's, x's gradient's and the kernel's
        return mm(x, kernel), mm(dy, kernel, transpose_b=True), mm(x, dy, transpose_a=True)

    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(_training_step(ours)), jax.jit(_training_step(plain)),
                   jax.jit(_in_float32(_training_step(exact))), gemms=3, stds=(1.0, k ** -0.5),
                   **_gemms_alone(gemms_alone))


def fp8_train_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                      config: GemmConfig | str | None = None) -> Problem:
    """One of ``FP8_TRAIN_STEPS``: the training step of ``fp8_dense(x, kernel, bias,
    activation)`` with delayed scaling, its histories holding one amax each (about the inputs'
    largest values), against Flax's ``nn.Dense`` with ``Fp8DirectDotGeneralOp`` given the same
    meta, or against the bf16 layer in plain JAX."""
    import flax.linen as nn

    from ..fp8 import Fp8Meta, fp8_dense

    if config is not None:
        raise ValueError(f"{epilogue} runs the heuristic's configs: leave --configs at auto.")
    act = epilogue.split(":")[1].removeprefix("bias+")
    m, n, k, l = shape
    if l > 1:
        raise ValueError(f"{epilogue} is a dense layer: give M,N,K without a batch")
    fn = _bias_activation(act)
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,), (m, n)))
    history = jnp.zeros((16,), jnp.float32)
    amaxes = (5.0, 5.0 / k ** 0.5, 5.0)  # input, kernel, output gradient: ~5 standard deviations
    meta = Fp8Meta(*(v for a in amaxes for v in (jnp.ones((1,), jnp.float32), history.at[0].set(a))))

    fast = epilogue.startswith("fp8train-fast:")
    precision = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM if fast else None

    def ours(x, kernel, bias):
        return fp8_dense(x, kernel, bias, activation=act, meta=meta, precision=precision)

    dense = nn.Dense(n, dtype=dtype, param_dtype=dtype, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    fp8_vars = {"Fp8DirectDotGeneralOp_0": meta._asdict()}

    def flax_fp8(x, kernel, bias):
        y = dense.apply({"params": {"kernel": kernel, "bias": bias}, "_overwrite_with_gradient": fp8_vars}, x)
        return activations.resolve(act)(y)

    def plain(x, kernel, bias):
        return fn(x @ kernel, bias)

    def exact(x, kernel, bias):
        return fn(jnp.matmul(x, kernel, precision=jax.lax.Precision.HIGHEST), bias)

    baseline = plain if epilogue.startswith("fp8train-bf16:") else flax_fp8
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(_training_step(ours)), jax.jit(_training_step(baseline)),
                   jax.jit(_in_float32(_training_step(exact))), gemms=3, stds=(1.0, k ** -0.5))


def mlp_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                config: GemmConfig | str | None = None) -> Problem:
    """``epilogue`` in ``MLP_STEPS``: the training step of a two-layer MLP of width K and
    hidden width N over M rows, ``fused_mlp`` against the same MLP in plain JAX: its output and,
    for a random output cotangent, the gradients of x and of every kernel and bias (six GEMMs
    of M x N x K, nine gated). Kernels are drawn with variance 1 / fan-in, as ``nn.Dense``
    initializes them. "interleaved" takes the gate and up kernels and biases interleaved (as
    ``FusedMLP(gated=True)`` holds them) and splits their gradients, to compare with the rest."""
    if config is not None:
        raise ValueError(f"{epilogue} runs the heuristic's configs: leave --configs at auto.")
    m, n, k, l = shape
    if l > 1:
        raise ValueError(f"{epilogue} is an MLP: give M,N,K without a batch")
    interleaved = epilogue.startswith("train:interleaved_mlp+")
    gated = interleaved or epilogue.startswith("train:gated_mlp+")
    act = epilogue.split("+", 1)[1]
    fn = activations.ACTIVATIONS[act]
    layers = [(k, n), (n,), (n, k), (k,)] + [(k, n), (n,)] * gated + [(k, 2 * n), (2 * n,)] * interleaved
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in [(m, k), *layers, (m, k)])
    stds = (1.0, k ** -0.5, 1.0, n ** -0.5, 1.0) + (k ** -0.5, 1.0) * gated

    def ours(x, up_k, up_b, down_k, down_b, *gate):
        return fused_mlp(x, up_k, up_b, down_k, down_b, activation=act,
                         **dict(zip(("gate_kernel", "gate_bias"), gate)))

    def plain(x, up_k, up_b, down_k, down_b, *gate, precision=None):
        def lin(h, kernel, bias):
            return jnp.matmul(h, kernel, precision=precision) + bias
        hidden = fn(lin(x, *gate)) * lin(x, up_k, up_b) if gated else fn(lin(x, up_k, up_b))
        return lin(hidden, down_k, down_b)

    exact = functools.partial(plain, precision=jax.lax.Precision.HIGHEST)
    ours_step, plain_step, exact_step = (_training_step(f) for f in (ours, plain, exact))
    derive = None
    if interleaved:
        def ours_step(x, up_k, up_b, down_k, down_b, gate_k, gate_b, w, b, dy):
            def layer(x, w, b, down_k, down_b):
                return fused_mlp(x, w, b, down_k, down_b, activation=act, gated=DEFAULT_BLOCK)

            y, dx, dw, db, d_down_k, d_down_b = _training_step(layer)(x, w, b, down_k, down_b, dy)
            (d_gate_k, d_up_k), (d_gate_b, d_up_b) = split_gated(dw, DEFAULT_BLOCK), split_gated(db, DEFAULT_BLOCK)
            return y, dx, d_up_k, d_up_b, d_down_k, d_down_b, d_gate_k, d_gate_b

        def without_interleaved(step):
            return lambda *inputs: step(*inputs[:7], inputs[-1])

        plain_step, exact_step = without_interleaved(plain_step), without_interleaved(exact_step)

        def derive(x, up_k, up_b, down_k, down_b, gate_k, gate_b, w, b, dy):
            return (x, up_k, up_b, down_k, down_b, gate_k, gate_b, interleave_gated(gate_k, up_k, DEFAULT_BLOCK),
                    interleave_gated(gate_b, up_b, DEFAULT_BLOCK), dy)

    def gemms_alone(mm, x, up_k, up_b, down_k, down_b, *rest):
        """The step's GEMMs, each plain, with the forward's hidden product standing in for every
        (M, N) matrix (the hidden activation and its gradients): the forward's (gated: and the
        gate's), then the hidden gradient's, the down kernel's, x's and the up kernel's (gated:
        x's through the gate, and the gate kernel's)."""
        dy = rest[-1]
        h = mm(x, up_k)
        outs = [h, mm(h, down_k), mm(dy, down_k, transpose_b=True), mm(h, dy, transpose_a=True),
                mm(h, up_k, transpose_b=True), mm(x, h, transpose_a=True)]
        if gated:
            gate_k = rest[0]
            outs += [mm(x, gate_k), mm(h, gate_k, transpose_b=True), mm(x, h, transpose_a=True)]
        return outs

    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(ours_step), jax.jit(plain_step), jax.jit(_in_float32(exact_step)),
                   gemms=9 if gated else 6, stds=stds, derive=derive, **_gemms_alone(gemms_alone))


def gated_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                  config: GemmConfig | str | None = None) -> Problem:
    """``epilogue`` in ``GATED_EPILOGUES``: ``act(x @ Wg + bg) * (x @ Wu + bu)`` over M rows of
    width K into N hidden columns: ours one gated GEMM on the weight (K, 2N) that interleaves
    Wg and Wu (as a model stores it), the baseline plain JAX's two GEMMs and the epilogue."""
    m, n, k, l = shape
    if l > 1:
        raise ValueError(f"{epilogue} is a dense layer: give M,N,K without a batch")
    act = activations.resolve({"swiglu": "silu", "geglu": "gelu_tanh"}[epilogue.split(":")[1]])
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (k, n), (k, 2 * n), (n,), (n,)))

    def fn(g, u, bg, bu):
        return act(g + bg) * (u + bu)

    def ours(x, wg, wu, w, bg, bu):
        return gemm(x, w, fn, bg, bu, gated=DEFAULT_BLOCK, config=config)

    def plain(x, wg, wu, w, bg, bu, precision=None):
        return fn(jnp.matmul(x, wg, precision=precision), jnp.matmul(x, wu, precision=precision),
                  bg, bu).astype(x.dtype)

    def derive(x, wg, wu, w, bg, bu):
        return x, wg, wu, interleave_gated(wg, wu, DEFAULT_BLOCK), bg, bu

    exact = functools.partial(plain, precision=jax.lax.Precision.HIGHEST)
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs, jax.jit(ours),
                   jax.jit(plain), jax.jit(_in_float32(exact)), gemms=2, stds=(1.0, k ** -0.5, k ** -0.5),
                   derive=derive)


def group_sizes(m: int, groups: int, skewed: bool) -> np.ndarray:
    """Rows of each of ``groups`` groups, ``m`` in all: equal shares, or shares falling by 0.6 a
    group; what rounding leaves goes to the first."""
    weights = 0.6 ** np.arange(groups) if skewed else np.ones(groups)
    sizes = np.floor(m * weights / weights.sum()).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return sizes


def grouped_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                    config: GemmConfig | str | None = None) -> Problem:
    """``epilogue`` in ``GROUPED_EPILOGUES``: ``silu(x @ w[e] + b[e])`` for the rows of each expert
    e (shape M,N,K,G), ours one ``grouped_gemm``, the baseline ``jax.lax.ragged_dot`` and the
    epilogue in XLA; or (``grouped-wgrad``) the weight gradient of ``x @ w[e]`` for an output
    gradient ``dy``, ours the grouped kernel over groups of the contraction. The group sizes are
    fixed per problem (a device array, read at run time)."""
    m, n, k, groups = shape
    sizes = jnp.asarray(group_sizes(m, groups, "skewed" in epilogue))
    if "wgrad" in epilogue:
        return _grouped_wgrad_problem(epilogue, shape, sizes, dtype, config)
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (groups, k, n), (groups, n)))
    fn = _bias_activation("silu")

    def ours(x, w, b):
        return grouped_gemm(x, w, sizes, fn, group_operands=[b], out_dtypes=x.dtype, config=config)

    def plain(x, w, b, precision=None):
        acc = jax.lax.ragged_dot(x, w, sizes, precision=precision, preferred_element_type=jnp.float32)
        return fn(acc, jnp.repeat(b, sizes, axis=0, total_repeat_length=m)).astype(x.dtype)

    exact = functools.partial(plain, precision=jax.lax.Precision.HIGHEST)
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs, jax.jit(ours),
                   jax.jit(plain), jax.jit(_in_float32(exact)), gemms=1 / groups, stds=(1.0, k ** -0.5))


def _grouped_wgrad_problem(epilogue: str, shape: Shape, sizes: Any, dtype: Any,
                           config: GemmConfig | str | None) -> Problem:
    m, n, k, groups = shape
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (m, n)))

    def weight_gradient(product):
        def f(x, dy):
            w = jnp.zeros((groups, k, n), x.dtype)  # (the product is linear in w: any point)
            return jax.vjp(lambda w: product(x, w), w)[1](dy)[0]
        return f

    ours = weight_gradient(lambda x, w: grouped_gemm(x, w, sizes, out_dtypes=x.dtype, config=config))
    plain = weight_gradient(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
    exact = weight_gradient(lambda x, w: jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST))
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs, jax.jit(ours),
                   jax.jit(plain), jax.jit(_in_float32(exact)), gemms=1 / groups)


def scan_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                 config: GemmConfig | str | None = None) -> Problem:
    """``epilogue`` in ``SCAN_EPILOGUES``: L dense layers ``activation(h @ kernel + bias)`` of
    width K (shape M,K,K,L) applied by ``lax.scan`` over kernels stacked (L, K, K) and biases
    (L, K); with "train:", their training step (the output and, for a random output
    cotangent, the gradients of x and of both stacks). Ours is ``fused_dense`` in the scanned
    body, the baseline the same layer in plain JAX. Kernels are drawn with variance 1/K."""
    m, n, k, l = shape
    if n != k or l < 2:
        raise ValueError(f"{epilogue} stacks L >= 2 layers of width K: give M,K,K,L")
    train = epilogue.startswith("train:")
    act = epilogue.split("bias+", 1)[1]
    fn = _bias_activation(act)
    shapes = [(m, k), (l, k, k), (l, k)] + [(m, k)] * train  # x, the stacks, and the cotangent
    specs = tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)

    def scanned(layer):
        def f(x, kernels, biases):
            y, _ = jax.lax.scan(lambda h, params: (layer(h, *params), None), x, (kernels, biases))
            return y
        return f

    ours = scanned(lambda h, kernel, bias: fused_dense(h, kernel, bias, activation=act, config=config))
    plain = scanned(lambda h, kernel, bias: fn(h @ kernel, bias))
    exact = scanned(lambda h, kernel, bias: fn(jnp.matmul(h, kernel, precision=jax.lax.Precision.HIGHEST), bias))
    step = _training_step if train else (lambda f: f)
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(step(ours)), jax.jit(step(plain)), jax.jit(_in_float32(step(exact))),
                   gemms=3 if train else 1, stds=(1.0, k ** -0.5))


def bench_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                  config: GemmConfig | str | None = None) -> Problem:
    """One of the benchmark epilogues (``NAMED_EPILOGUES``) at one shape; ``config`` pins the
    kernel's configuration (None: the heuristic's)."""
    if epilogue in MLP_STEPS:
        return mlp_problem(epilogue, shape, dtype, config)
    if epilogue in GATED_EPILOGUES:
        return gated_problem(epilogue, shape, dtype, config)
    if epilogue in GROUPED_EPILOGUES:
        return grouped_problem(epilogue, shape, dtype, config)
    if epilogue in SCAN_EPILOGUES:
        return scan_problem(epilogue, shape, dtype, config)
    if epilogue.startswith("train:"):
        return train_problem(epilogue, shape, dtype, config)
    if epilogue in FP8_TRAIN_STEPS:
        return fp8_train_problem(epilogue, shape, dtype, config)
    if epilogue == "gemm":
        return epilogue_problem(epilogue, _identity, shape, dtype, config=config,
                                ours=lambda a, b: gemm(a, b, config=config))
    if epilogue in TRANSPOSED_GEMMS:
        ta, tb = epilogue == "gemm-at", epilogue == "gemm-bt"
        return epilogue_problem(epilogue, _identity, shape, dtype, config=config,
                                majors=("m" if ta else "k", "k" if tb else "n", "n"),
                                ours=lambda a, b: gemm(a, b, config=config, transpose_a=ta, transpose_b=tb))
    if epilogue in REDUCTION_EPILOGUES:
        layer = _bias_activation("gelu_tanh")

        def with_colsum(acc, bias):
            y = layer(acc, bias)
            return y, jnp.sum(y, axis=-2)

        atomic = None
        if epilogue.endswith("-atomic"):
            def atomic(a, b, bias):
                return gemm(a, b, with_colsum, bias, out_dtypes=(dtype, jnp.float32), config=config,
                            deterministic=False)

        return epilogue_problem(epilogue, with_colsum, shape, dtype, [("row", dtype)],
                                out_dtypes=(dtype, jnp.float32), config=config, ours=atomic)
    if epilogue in ROW_EPILOGUES:
        return epilogue_problem(epilogue, _bias_softmax, shape, dtype, [("row", dtype)], config=config)
    if epilogue.startswith("bias+"):
        act = epilogue[len("bias+"):]
        fn = _bias_activation(act)
        batched = shape[3] > 1  # fused_dense takes a 2-D kernel; a batched b goes through gemm
        ours = None if batched else (lambda a, b, bias: fused_dense(a, b, bias, activation=act, config=config))
        return epilogue_problem(epilogue, fn, shape, dtype, [("row", dtype)], config=config, ours=ours)
    if epilogue == "alpha-beta":
        return epilogue_problem(epilogue, example_epilogues.alpha_beta, shape, dtype,
                                [("tile", dtype), ("tile", dtype)], scalars=ALPHA_BETA_SCALARS,
                                config=config)
    if epilogue in EIGHT_BIT_EPILOGUES:
        return eight_bit_problem(epilogue, shape, config)
    raise ValueError(f"unknown epilogue {epilogue!r}; choose from {', '.join(NAMED_EPILOGUES)}.")


def eight_bit_problem(epilogue: str, shape: Shape, config: GemmConfig | str | None = None) -> Problem:
    """One of ``EIGHT_BIT_EPILOGUES`` at one shape (L = 1): e4m3 (or int8) A (M, K) and B (N, K)
    or, for "fp8kn", (K, N); the scaled epilogues take the scales of A and B as float32 scalars
    and a bf16 bias. The baseline is ``lax.dot_general`` of the 8-bit operands in the same
    layout."""
    m, n, k, l = shape
    if l != 1:
        raise ValueError(f"{epilogue} takes no batch; got L={l}.")
    if epilogue.startswith("int8:"):
        return _int8_problem(epilogue, shape, config)
    e4m3, bf16 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16)
    k_major = not epilogue.startswith("fp8kn")
    fast = epilogue.split(":")[0].endswith("fast")
    precision = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM if fast else None
    xla_precision = None if fast else jax.lax.Precision.HIGHEST
    contract = (((1,), (1,)), ((), ())) if k_major else (((1,), (0,)), ((), ()))
    b_shape = (n, k) if k_major else (k, n)
    to = e4m3 if epilogue.endswith("->fp8") else bf16
    S = jax.ShapeDtypeStruct
    if epilogue.endswith(":gemm"):
        specs = (S((m, k), e4m3), S(b_shape, e4m3))

        def ours(a, b):
            return gemm(a, b, transpose_b=k_major, out_dtypes=bf16, config=config, precision=precision)

        def baseline(a, b):
            return jax.lax.dot_general(a, b, contract, precision=xla_precision, preferred_element_type=bf16)

        def reference(a, b):
            return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), contract,
                                       precision=jax.lax.Precision.HIGHEST)

        return Problem(epilogue, tuple(shape), e4m3.name, config_label(config), specs, jax.jit(ours),
                       jax.jit(baseline), jax.jit(reference))
    specs = (S((m, k), e4m3), S(b_shape, e4m3), S((n,), bf16), S((), jnp.float32), S((), jnp.float32))
    gelu = activations.resolve("gelu_tanh")
    top = float(jnp.finfo(e4m3).max)

    def stored(y):  # as the kernels store an 8-bit output: saturated, then rounded
        return (jnp.clip(y, -top, top) if to == e4m3 else y).astype(to)

    def ours(a, b, bias, sa, sb):
        return gemm(a, b, lambda acc, bias, *, sa, sb: gelu(acc * (sa * sb) + bias), bias, transpose_b=k_major,
                    sa=sa, sb=sb, out_dtypes=to, config=config, precision=precision)

    def baseline(a, b, bias, sa, sb):
        acc = jax.lax.dot_general(a, b, contract, precision=xla_precision, preferred_element_type=jnp.float32)
        return stored(gelu(acc * (sa * sb) + bias))

    def reference(a, b, bias, sa, sb):
        acc = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), contract,
                                  precision=jax.lax.Precision.HIGHEST)
        return gelu(acc * (sa * sb) + bias.astype(jnp.float32))

    # the scales keep the accumulator's magnitude (about sqrt(K)) near 1 before the bias
    return Problem(epilogue, tuple(shape), e4m3.name, config_label(config), specs, jax.jit(ours),
                   jax.jit(baseline), jax.jit(reference), stds=(1.0, 1.0, 1.0, 1 / k ** 0.5, 1.0))


def _int8_problem(epilogue: str, shape: Shape, config: GemmConfig | str | None) -> Problem:
    m, n, k, _ = shape
    i8, i32 = jnp.dtype(jnp.int8), jnp.dtype(jnp.int32)
    contract = (((1,), (1,)), ((), ()))
    specs = (jax.ShapeDtypeStruct((m, k), i8), jax.ShapeDtypeStruct((n, k), i8))

    def ours(a, b):
        return gemm(a, b, transpose_b=True, out_dtypes=i32, config=config)

    def baseline(a, b):
        return jax.lax.dot_general(a, b, contract, preferred_element_type=i32)

    def reference(a, b):  # exact: |sum| < 2**31, and the oracle is compared in float32
        return jax.lax.dot_general(a, b, contract, preferred_element_type=i32).astype(jnp.float32)

    # a standard deviation of 20 keeps the int8 values within range (127 is six deviations)
    return Problem(epilogue, tuple(shape), i8.name, config_label(config), specs, jax.jit(ours),
                   jax.jit(baseline), jax.jit(reference), stds=(20.0, 20.0))


def random_inputs(specs: Sequence[jax.ShapeDtypeStruct], key: Any,
                  stds: Sequence[float] = ()) -> tuple[Any, ...]:
    """Normal arrays of ``specs``' shapes with standard deviations ``stds`` (default 1), cast
    to their dtypes."""
    keys = jax.random.split(key, len(specs))
    stds = tuple(stds) + (1.0,) * (len(specs) - len(stds))
    return tuple((sd * jax.random.normal(kk, s.shape, jnp.float32)).astype(s.dtype)
                 for kk, s, sd in zip(keys, specs, stds))


def config_label(config: GemmConfig | str | None) -> str:
    """The inverse of :func:`parse_config`: only the fields that differ from the defaults."""
    if config is None:
        return "auto"
    if isinstance(config, str):
        return config
    default = GemmConfig()
    core = f"{config.tile_m},{config.tile_n},{config.cluster_m},{config.cluster_n}"
    extra = [f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in dataclasses.fields(GemmConfig)[4:]
             if (v := getattr(config, f.name)) != getattr(default, f.name)]
    return ",".join([core, *extra])
