"""Side-by-side speed and correctness of jax_efc's fused GEMMs against plain JAX.

How: jitted functions, a warm-up, an untimed cycle of rounds, then several rounds of many
calls (the median round counts), blocking only at the end of a round, random normal inputs
rotated among several sets when they fit in L2, and every variant checked against a float32
reference in the same run. The baseline is the same epilogue in plain JAX under ``jax.jit``.

    python -m jax_efc.bench [--quick | --shapes M,N,K[,L] ...] [--epilogues gemm,bias+gelu_tanh]
                            [--configs auto 192,128,1,2,pingpong=1 ...] [--clocks]
                            [--also-no-triton] [--json out.json [--resume]]

Several ``--configs`` of one epilogue and shape are timed in the same interleaved rounds;
``--clocks`` adds the SM clock and board power each side held (nvidia-smi); ``--bound`` adds
our plain GEMM's time in the same rounds (and, with ``--clocks``, its clock and power), and the
baseline's time over it: the most fusing the epilogue can gain.

``--resume`` keeps the figures a stopped run left in ``--json``'s file and measures only the
rest, so the same command, run again, finishes the set.

``--also-no-triton`` repeats the run in a subprocess with
``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` (XLA reads its flags once, at start-up), so
the baseline is XLA's cuBLASLt-epilogue path, and prints that second table.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import activations, example_epilogues
from .config import GemmConfig
from .mlp import fused_mlp
from .ops import fused_dense, gemm
from .primitive import backends

__all__ = ["Problem", "Result", "ROUNDS", "STANDARD_SHAPES", "QUICK_SHAPES", "EPILOGUES", "TRAIN_EPILOGUES",
           "SCAN_EPILOGUES", "epilogue_problem", "train_problem", "bench_problem", "random_inputs", "measure", "measure_together", "run", "format_table",
           "fixed_width", "ClockSampler",
           "add_arguments", "run_from_args", "text_progress", "main"]

PEAK_TFLOPS = 790.0  # measured bf16 dense peak of the reference H200
L2_BYTES = 60 * 2**20
# inputs and outputs that ``calls_per_jit`` may hold on the device at once
_CHAIN_BYTES = 16 * 2**30
NO_TRITON_FLAG = "--xla_gpu_enable_triton_gemm=false"
ROUNDS = 6  # timed rounds by default: whole cycles of timing_order for two to four functions
# functions timed in one set of rounds at most: configs, their baseline and --bound's GEMM
# (timing_order's search for larger sets grows from milliseconds to minutes)
MAX_TIMED = 16

Shape = tuple[int, int, int, int]  # M, N, K, L

_FFN = ((4096, 14336), (14336, 4096), (4096, 4096), (8192, 28672))  # (K, N) of LLM FFN layers
STANDARD_SHAPES: list[Shape] = (
    [(8192, 8192, 8192, 1)]
    + [(m, n, k, 1) for m in (4096, 8192, 16384) for k, n in _FFN]
    + [(m, n, k, 1) for m in (128, 1000, 2048) for k, n in ((4096, 4096), (4096, 14336))]
)
QUICK_SHAPES: list[Shape] = [(8192, 8192, 8192, 1), (8192, 14336, 4096, 1), (1000, 4096, 4096, 1)]
EPILOGUES = ("gemm", "bias+gelu_tanh", "bias+gelu", "bias+silu", "alpha-beta")
# a dense layer's training step: its output and the gradients of x, kernel and bias for a given
# output cotangent (three GEMMs); measured only when asked for
TRAIN_EPILOGUES = tuple(f"train:{e}" for e in EPILOGUES if e.startswith("bias+"))
# a two-layer MLP's training step (fused_mlp), K -> N -> K over M rows; measured only when asked for
MLP_STEPS = ("train:mlp+gelu_tanh", "train:gated_mlp+silu")
# L dense layers of width K under lax.scan over stacked kernels and biases (shape M,K,K,L), as
# models that scan their layers run them: the forward, or with "train:" the training step
SCAN_EPILOGUES = tuple(f"{step}scan:{e}" for step in ("", "train:") for e in EPILOGUES if e.startswith("bias+"))
_NAMED = EPILOGUES + TRAIN_EPILOGUES + MLP_STEPS + SCAN_EPILOGUES  # every name --epilogues takes
ALPHA_BETA_SCALARS = {"alpha": 2.0, "beta": 1.0, "x_factor": 3.0}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fused GEMM to measure. ``ours``, ``baseline`` and ``reference`` (float32 math on
    float32 copies of the inputs) are jitted functions of the inputs described by ``specs``
    (``a``, ``b``, then the epilogue's operands). ``gemms``: the M x N x K GEMMs a call runs
    (what its TFLOP/s count). ``stds``: each input's standard deviation (default 1)."""

    epilogue: str
    shape: Shape
    dtype: str
    config: str  # "auto" (the heuristic) or the pinned GemmConfig, as given on the command line
    specs: tuple[jax.ShapeDtypeStruct, ...]
    ours: Callable[..., Any]
    baseline: Callable[..., Any]
    reference: Callable[..., Any]
    gemms: int = 1
    stds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Result:
    """Times are seconds per call (median round); errors are relative Frobenius errors
    against the float32 reference, the worst over the outputs (None when not checked)."""

    epilogue: str
    shape: Shape
    dtype: str
    config: str
    backend: str
    ours_s: float
    baseline_s: float
    tflops: float
    ratio: float  # baseline time / our time: > 1 means we are faster
    peak_fraction: float
    gbytes: float  # least bytes any implementation must move (inputs read, outputs written)
    err: float | None
    baseline_err: float | None
    # with a ClockSampler: median SM clock (MHz) and board power (W) while each side ran
    ours_mhz: float | None = None
    baseline_mhz: float | None = None
    ours_watts: float | None = None
    baseline_watts: float | None = None
    # with ``bound``: our plain GEMM of the same A and B, timed in the same rounds; baseline_s /
    # plain_s bounds the ratio any fusion of this epilogue can reach
    plain_s: float | None = None
    calls_per_jit: int = 1
    # with both: the clock and power while the plain GEMM ran (at the power cap a kernel's
    # clock depends on its work, so a fused epilogue can cost clock as well as cycles)
    plain_mhz: float | None = None
    plain_watts: float | None = None

    @property
    def bound(self) -> float | None:
        return None if self.plain_s is None else self.baseline_s / self.plain_s

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        """A result as ``dataclasses.asdict`` wrote it to the ``--json`` file."""
        return cls(**{**d, "shape": tuple(d["shape"])})


def _identity(acc: Any) -> Any:
    return acc


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
    config: GemmConfig | None = None,
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

    return Problem(name, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(ours), jax.jit(baseline), jax.jit(reference))


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
                  config: GemmConfig | None = None) -> Problem:
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

    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(_training_step(ours)), jax.jit(_training_step(plain)),
                   jax.jit(_in_float32(_training_step(exact))), gemms=3, stds=(1.0, k ** -0.5))


def mlp_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                config: GemmConfig | None = None) -> Problem:
    """``epilogue`` in ``MLP_STEPS``: the training step of a two-layer MLP of width K and
    hidden width N over M rows, ``fused_mlp`` against the same MLP in plain JAX: its output and,
    for a random output cotangent, the gradients of x and of every kernel and bias (six GEMMs
    of M x N x K, nine gated). Kernels are drawn with variance 1 / fan-in, as ``nn.Dense``
    initializes them."""
    if config is not None:
        raise ValueError(f"{epilogue} runs the heuristic's configs: leave --configs at auto.")
    m, n, k, l = shape
    if l > 1:
        raise ValueError(f"{epilogue} is an MLP: give M,N,K without a batch")
    gated = epilogue.startswith("train:gated_mlp+")
    act = epilogue.split("+", 1)[1]
    fn = activations.ACTIVATIONS[act]
    layers = [(k, n), (n,), (n, k), (k,)] + [(k, n), (n,)] * gated
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
    return Problem(epilogue, tuple(shape), np.dtype(dtype).name, config_label(config), specs,
                   jax.jit(_training_step(ours)), jax.jit(_training_step(plain)),
                   jax.jit(_in_float32(_training_step(exact))),
                   gemms=9 if gated else 6, stds=stds)


def scan_problem(epilogue: str, shape: Shape, dtype: Any = jnp.bfloat16,
                 config: GemmConfig | None = None) -> Problem:
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
                  config: GemmConfig | None = None) -> Problem:
    """One of the benchmark epilogues (``EPILOGUES``, ``TRAIN_EPILOGUES``, ``MLP_STEPS``,
    ``SCAN_EPILOGUES``) at one shape; ``config`` pins the kernel's configuration (None: the
    heuristic's)."""
    if epilogue in MLP_STEPS:
        return mlp_problem(epilogue, shape, dtype, config)
    if epilogue in SCAN_EPILOGUES:
        return scan_problem(epilogue, shape, dtype, config)
    if epilogue.startswith("train:"):
        return train_problem(epilogue, shape, dtype, config)
    if epilogue == "gemm":
        return epilogue_problem(epilogue, _identity, shape, dtype, config=config,
                                ours=lambda a, b: gemm(a, b, config=config))
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
    raise ValueError(f"unknown epilogue {epilogue!r}; choose from {', '.join(_NAMED)}.")


def random_inputs(specs: Sequence[jax.ShapeDtypeStruct], key: Any,
                  stds: Sequence[float] = ()) -> tuple[Any, ...]:
    """Normal arrays of ``specs``' shapes with standard deviations ``stds`` (default 1), cast
    to their dtypes."""
    keys = jax.random.split(key, len(specs))
    stds = tuple(stds) + (1.0,) * (len(specs) - len(stds))
    return tuple((sd * jax.random.normal(kk, s.shape, jnp.float32)).astype(s.dtype)
                 for kk, s, sd in zip(keys, specs, stds))


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _rel_err(out: Any, ref: Any) -> float:
    errs = [jnp.linalg.norm((o.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel())
            for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))]
    return float(max(errs))


class ClockSampler:
    """The GPU's SM clock and board power, read by ``nvidia-smi`` every ``period_ms`` while
    the sampler is entered (``with ClockSampler() as clocks:``). At the power cap the clock a
    kernel holds depends on its work, so it explains times that the FLOP count does not.

    ``command`` replaces the nvidia-smi call (each output line: "MHz, W"). The GPU sampled is
    the first of ``CUDA_VISIBLE_DEVICES`` (0 if unset), the one JAX's first device runs on.
    Samples in a round's first ``settle_s`` are left out (the clock moving from the previous
    load). Power is the instantaneous reading where the driver has one: ``power.draw`` is a
    one-second average on current drivers, longer than a round.
    """

    def __init__(self, period_ms: int = 20, settle_s: float = 0.02,
                 command: Sequence[str] | None = None):
        self.settle_s = settle_s
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        if command is None:
            power = "power.draw.instant" if _smi_knows(gpu, "power.draw.instant") else "power.draw"
            command = ["nvidia-smi", f"--id={gpu}", f"--query-gpu=clocks.sm,{power}",
                       "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"]
        self.command = list(command)
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, MHz, W)

    def __enter__(self) -> ClockSampler:
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._proc.terminate()
        self._proc.wait()
        self._reader.join()
        if not self.samples:
            warnings.warn(f"{self.command[0]} gave no clock samples: "
                          f"{self._proc.stderr.read().strip() or 'no output'}", RuntimeWarning, stacklevel=2)

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(v) for v in line.split(","))
            except ValueError:  # a header, "[N/A]" or a cut line
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def median(self, windows: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
        """Median clock and power over the samples inside the (start, end) ``perf_counter``
        windows (past each one's settling time)."""
        # samples arrive in time order: each window is a slice of them
        inside = [(mhz, w) for a, b in windows
                  for _, mhz, w in self.samples[bisect.bisect_left(self.samples, (a + self.settle_s,)):
                                                bisect.bisect_right(self.samples, (b, math.inf))]]
        if not inside:
            return None, None
        return statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside)


def _smi_knows(gpu: str, field: str) -> bool:
    """Whether this nvidia-smi reports ``field`` as a number (older drivers reject the name)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu}", f"--query-gpu={field}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        float(out.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return out.returncode == 0


def timing_order(n: int, rounds: int) -> list[int]:
    """The order in which the rounds of ``n`` functions are timed, back to back: cycles of
    ``n - 1`` rounds (``rounds`` is rounded up to whole cycles), each round timing every
    function once, in which every function is timed right after every other one exactly once,
    across the seams between rounds too. A cycle ends with the last function, the one warmed
    up last, which so precedes the first round as it does in every later cycle.

    On an H200, of three identical kernels timed in the same rounds, the one timed right after
    the baseline came out 2-4% faster than the other two at three of four problems; with
    orders balanced only within rounds, of two identical configs timed with their baseline and
    the plain GEMM, the one that followed the baseline at more seams came out faster in 9 of
    10 (benchmarks/FINDINGS.md, "The order of the timed rounds")."""
    if n > MAX_TIMED:
        raise ValueError(f"{n} functions in one set of rounds; at most {MAX_TIMED} (configs, their "
                         "baseline and the plain GEMM): compare fewer configs at a time.")
    if n == 1:
        return [0] * rounds
    total = n * (n - 1)
    unused = [set(range(n)) - {v} for v in range(n)]  # successors not yet timed after v
    seq = [n - 1]  # the function warmed up last, then the cycle

    def candidates() -> list[int]:
        """The functions that may come next, the one with the fewest successors left last."""
        placed = (len(seq) - 1) % n
        in_round = set(seq[len(seq) - placed:]) if placed else set()
        return sorted(unused[seq[-1]] - in_round, key=lambda v: (-len(unused[v]), -v))

    options = [candidates()]
    while not (len(seq) - 1 == total and seq[-1] == n - 1):
        if len(seq) - 1 < total and options[-1]:
            v = options[-1].pop()
            unused[seq[-1]].discard(v)
            seq.append(v)
            options.append(candidates())
        else:  # a dead end: take the last step back
            options.pop()
            v = seq.pop()
            unused[seq[-1]].add(v)
    return seq[1:] * -(-rounds // (n - 1))


def _time(fns: Sequence[Callable[..., Any]], input_sets: Sequence[tuple], rounds: int,
          calls: int | None, min_round_s: float, warmup: int
          ) -> tuple[list[float], list[list[tuple[float, float]]]]:
    """For each function, the median over the rounds of the mean time per call, and the
    (start, end) ``perf_counter`` window of each of its rounds. Rounds of the functions
    interleave, so a drift in clocks hits them alike, in the order of :func:`timing_order`
    (at least ``rounds`` rounds each). ``calls=None`` picks enough calls for a round to last
    ``min_round_s``; ``warmup`` (>= 1) calls exclude compilation.

    One cycle of rounds runs untimed first: on an H200, of two identical kernels timed in the
    same rounds, the one timed first came out 1% faster without it and as fast with it: the
    GPU, idle while the functions compiled, is not yet in the state it holds under load
    (benchmarks/FINDINGS.md, "The order of the timed rounds")."""
    counts = []
    for fn in fns:
        for i in range(max(1, warmup)):
            jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*input_sets[-1]))
        counts.append(calls or max(1, min(1000, math.ceil(min_round_s / max(time.perf_counter() - t0, 1e-7)))))

    def run_round(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for j in range(counts[i]):
            out = fns[i](*input_sets[j % len(input_sets)])
        jax.block_until_ready(out)
        return t0, time.perf_counter()

    order = timing_order(len(fns), rounds)
    for i in order[:len(fns) * max(1, len(fns) - 1)]:  # the untimed cycle
        run_round(i)
    per_call: list[list[float]] = [[] for _ in fns]
    windows: list[list[tuple[float, float]]] = [[] for _ in fns]
    for i in order:
        t0, t1 = run_round(i)
        per_call[i].append((t1 - t0) / counts[i])
        windows[i].append((t0, t1))
    return [statistics.median(t) for t in per_call], windows


def _moved_bytes(problem: Problem) -> int:
    """The least bytes a call moves: its inputs read and its outputs written."""
    return _nbytes(problem.specs) + _nbytes(jax.eval_shape(problem.ours, *problem.specs))


def _chain_refusal(problem: Problem, moved: int, calls_per_jit: int) -> str | None:
    """Why ``calls_per_jit`` calls of ``problem``, each moving ``moved`` bytes, cannot be held
    at once (None: they can)."""
    held = calls_per_jit * moved
    if held <= _CHAIN_BYTES:
        return None
    return (f"{calls_per_jit} calls per jit of {_shape_str(problem.shape)} would hold "
            f"{held / 2**30:.1f} GiB of inputs and outputs (at most {_CHAIN_BYTES / 2**30:.0f}); "
            "give fewer calls or a smaller shape.")


def measure(problem: Problem, **kw: Any) -> Result:
    """Time ``problem``'s op and baseline side by side, after checking both against the
    reference (unless ``check=False``); the options are :func:`measure_together`'s."""
    return measure_together([problem], **kw)[0]


def measure_together(problems: Sequence[Problem], *, rounds: int = ROUNDS, calls: int | None = None,
                     warmup: int = 1, min_round_s: float = 0.1, check: bool = True,
                     seed: int = 0, clocks: ClockSampler | None = None, bound: bool = False,
                     calls_per_jit: int = 1, stage: Callable[[str], None] | None = None) -> list[Result]:
    """Time several configurations of one epilogue at one shape (problems that differ only in
    ``config``) in the same interleaved rounds as their shared baseline, so the drift of the
    GPU's clock between rounds hits them all alike and their times compare directly. With an
    entered ``clocks`` sampler, each result also holds the clock and power of its rounds; with
    ``bound``, the time of our plain GEMM (``jax_efc.gemm(a, b)``, no epilogue) in the same
    rounds (only for the single GEMMs of ``EPILOGUES``, not for steps of several).

    ``calls_per_jit`` > 1 times that many calls inside one jitted function, each on inputs of
    its own (nothing for XLA to share between them, nothing left in L2 by the previous one),
    as a model's step runs its layers: the time per call is then the GPU's, without the host's
    cost of dispatching a jitted function, which exceeds a small GEMM's. ``stage(text)`` is told
    when each stage begins (inputs, compiling and checking, timing)."""
    stage = stage or (lambda text: None)
    first = problems[0]
    stage("making the inputs")
    if any((p.epilogue, p.shape, p.dtype) != (first.epilogue, first.shape, first.dtype) for p in problems):
        raise ValueError("measure_together takes configurations of one epilogue, shape and dtype")
    moved = _moved_bytes(first)
    if calls_per_jit > 1:
        refusal = _chain_refusal(first, moved, calls_per_jit)
        if refusal:
            raise ValueError(refusal)
        chained = [random_inputs(first.specs, k, first.stds) for k in jax.random.split(jax.random.key(seed), calls_per_jit)]
        input_sets, first_inputs = [(chained,)], chained[0]
    else:
        n_sets = 1 if moved >= L2_BYTES else min(16, math.ceil(2 * L2_BYTES / moved))
        input_sets = [random_inputs(first.specs, k, first.stds) for k in jax.random.split(jax.random.key(seed), n_sets)]
        first_inputs = input_sets[0]

    errs: list[float | None] = [None] * len(problems)
    base_err = None
    stage("compiling, and checking against the float32 reference" if check else "compiling")
    if check:
        ref = first.reference(*first_inputs)
        errs = [_rel_err(p.ours(*first_inputs), ref) for p in problems]
        base_err = _rel_err(first.baseline(*first_inputs), ref)
        del ref
    bound = bound and first.epilogue in EPILOGUES
    plain = [jax.jit(lambda a, b, *_: gemm(a, b))] if bound else []
    fns = [p.ours for p in problems] + [first.baseline] + plain
    if calls_per_jit > 1:
        fns = [jax.jit(lambda sets, fn=fn: [fn(*inputs) for inputs in sets]) for fn in fns]
    stage(f"warming up and timing {len(fns)} functions in interleaved rounds")
    times, windows = _time(fns, input_sets, rounds, calls, min_round_s, warmup)
    times = [t / calls_per_jit for t in times]
    count = len(problems)
    ours_s, base_s, plain_s = times[:count], times[count], times[count + 1] if bound else None
    sampled = [clocks.median(w) if clocks else (None, None) for w in windows]
    power, (base_mhz, base_watts) = sampled[:count], sampled[count]
    plain_mhz, plain_watts = sampled[count + 1] if bound else (None, None)
    m, n, k, l = first.shape
    results = []
    for p, t, err, (mhz, watts) in zip(problems, ours_s, errs, power):
        tflops = 2 * p.gemms * m * n * k * l / t / 1e12
        backend = "; ".join(dict.fromkeys(backends(p.ours, *p.specs))) or "none"
        results.append(Result(p.epilogue, p.shape, p.dtype, p.config, backend, t, base_s, tflops,
                              base_s / t, tflops / PEAK_TFLOPS, moved / 1e9, err, base_err,
                              mhz, base_mhz, watts, base_watts, plain_s, calls_per_jit, plain_mhz,
                              plain_watts))
    return results


def text_progress(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr (no dependency). The label is never cut, so a log
    keeps every ratio and the config it belongs to."""
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<72}{end}")
    sys.stderr.flush()


def run(problems: Sequence[Problem], *, progress: Callable[[int, int, str], None] | None = None,
        checkpoint: Callable[[list[Result]], None] | None = None, **measure_kw: Any) -> list[Result]:
    """Measure each problem, the consecutive configurations of one epilogue and shape together
    (:func:`measure_together`), reporting progress as ``progress(done, total, label)``: the
    problem about to run, then each one just measured with its ratio (so a log of an
    interrupted run still holds every finished figure). ``checkpoint`` gets the results so
    far after each group."""
    groups = [list(g) for _, g in itertools.groupby(problems, key=lambda p: (p.epilogue, p.shape, p.dtype))]
    results: list[Result] = []
    for group in groups:
        if progress:
            progress(len(results), len(problems), _label(group[0]))
        for p, r in zip(group, measure_together(group, **measure_kw)):
            results.append(r)
            if progress:
                progress(len(results), len(problems), f"{_label(p)} {r.ratio:.2f}x")
        if checkpoint:
            checkpoint(results)
    return results


def _label(p: Problem) -> str:
    return f"{_shape_str(p.shape)} {p.epilogue}" + ("" if p.config == "auto" else f" {p.config}")


def _shape_str(shape: Shape) -> str:
    m, n, k, l = shape
    return f"{m}x{n}x{k}" + (f"x{l}" if l > 1 else "")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _optional(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: Sequence[Result], title: str = "") -> str:
    """A fixed-width table of results (shape is M x N x K [x L]); with sampled clocks, also
    each side's median SM clock and board power (and the plain GEMM's, with ``bound``)."""
    head = ("shape", "dtype", "epilogue", "config", "backend", "ours ms", "base ms", "TFLOP/s", "ratio",
            "%peak", "GB", "err", "base err")
    rows = [(_shape_str(r.shape), r.dtype, r.epilogue, r.config, _clip(r.backend, 40), f"{r.ours_s * 1e3:.3f}",
             f"{r.baseline_s * 1e3:.3f}", f"{r.tflops:.4g}", f"{r.ratio:.2f}",
             f"{100 * r.peak_fraction:.3g}", f"{r.gbytes:.2f}", _optional(r.err, ".1e"), _optional(r.baseline_err, ".1e"))
            for r in results]
    if any(r.plain_s is not None for r in results):
        head += ("plain ms", "bound")
        rows = [row + (_optional(None if r.plain_s is None else r.plain_s * 1e3, ".3f"), _optional(r.bound, ".2f"))
                for row, r in zip(rows, results)]
    if any(r.ours_mhz is not None for r in results):
        head += ("ours MHz", "base MHz", "ours W", "base W")
        rows = [row + tuple(_optional(v, ".0f") for v in (r.ours_mhz, r.baseline_mhz, r.ours_watts, r.baseline_watts))
                for row, r in zip(rows, results)]
    if any(r.plain_mhz is not None for r in results):
        head += ("plain MHz", "plain W")
        rows = [row + (_optional(r.plain_mhz, ".0f"), _optional(r.plain_watts, ".0f"))
                for row, r in zip(rows, results)]
    return fixed_width(head, rows, title)


def fixed_width(head: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    """Left-aligned columns as wide as their widest cell, the head ruled off from the rows."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [title] if title else []
    lines += ["  ".join(f"{x:<{w}}" for x, w in zip(row, widths)) for row in (head, *rows)]
    lines.insert(len(lines) - len(rows), "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def baseline_title() -> str:
    """Which XLA configuration the baseline in this process runs with."""
    flags = os.environ.get("XLA_FLAGS", "")
    which = f"XLA with {NO_TRITON_FLAG}" if NO_TRITON_FLAG in flags else "XLA default flags"
    return f"jax_efc vs plain JAX under jit (baseline: {which}) on {jax.devices()[0].device_kind}"


# Command line (shared with `jax-efc bench`) --------------------------------------------------

def parse_shape(text: str) -> Shape:
    """"M,N,K" or "M,N,K,L" -> (M, N, K, L); raises ``argparse.ArgumentTypeError``."""
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) not in (3, 4) or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not M,N,K or M,N,K,L with positive integers")
    return dims if len(dims) == 4 else (*dims, 1)


def parse_config(text: str) -> GemmConfig | None:
    """"auto" -> None; "tile_m,tile_n[,cluster_m,cluster_n][,field=value ...]" -> a GemmConfig,
    e.g. "128,256,2,1,swizzle=8" or "64,256,pingpong=1"."""
    if text == "auto":
        return None
    positional, named = [], {}
    fields = {f.name: f.type for f in dataclasses.fields(GemmConfig)}
    try:
        for part in text.split(","):
            if "=" in part:
                key, value = part.split("=", 1)
                if key not in fields:
                    raise ValueError(f"no GemmConfig field {key!r}")
                kind = fields[key]
                named[key] = value if kind == "str" else bool(int(value)) if kind == "bool" else int(value)
            else:
                positional.append(int(part))
        if len(positional) > 4:
            raise ValueError("at most tile_m,tile_n,cluster_m,cluster_n go by position")
        config = GemmConfig(*positional, **named)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a config ({e}); write 'auto' or "
                                         "tile_m,tile_n[,cluster_m,cluster_n][,field=value...]") from None
    return config


def config_label(config: GemmConfig | None) -> str:
    """The inverse of :func:`parse_config`: only the fields that differ from the defaults."""
    if config is None:
        return "auto"
    default = GemmConfig()
    core = f"{config.tile_m},{config.tile_n},{config.cluster_m},{config.cluster_n}"
    extra = [f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in dataclasses.fields(GemmConfig)[4:]
             if (v := getattr(config, f.name)) != getattr(default, f.name)]
    return ",".join([core, *extra])


def _epilogue_list(text: str) -> list[str]:
    names = [e for e in text.split(",") if e]
    bad = [e for e in names if e not in _NAMED]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown epilogue(s) {bad}; choose from "
                                         f"{','.join(_NAMED)}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options, for ``python -m jax_efc.bench`` and ``jax-efc bench``."""
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="M,N,K[,L]",
                   help="problem shapes (default: the standard set, 8192^3, the LLM FFN shapes "
                        "and small M)")
    p.add_argument("--quick", action="store_true", help=f"a quick subset: {QUICK_SHAPES}")
    p.add_argument("--epilogues", type=_epilogue_list, default=list(EPILOGUES),
                   help=f"comma-separated, from {','.join(_NAMED)} (default: "
                        f"{','.join(EPILOGUES)})")
    p.add_argument("--configs", nargs="+", type=parse_config, default=[None], metavar="CONFIG",
                   help="kernel configs to compare, timed in the same rounds: 'auto' (the "
                        "heuristic, default) or tile_m,tile_n[,cluster_m,cluster_n][,field=value...]")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="timed rounds (at least; rounded up so that each function is timed right "
                        "after every other one equally often); the median counts")
    p.add_argument("--min-round-time", type=float, default=0.1, help="seconds per round (sets the calls)")
    p.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    p.add_argument("--also-no-triton", action="store_true",
                   help=f"also run with XLA_FLAGS={NO_TRITON_FLAG} in a subprocess")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in --json's file (left by a stopped run of the "
                        "same device and XLA flags) and measure only the problems it lacks")
    p.add_argument("--bound", action="store_true",
                   help="also time our plain GEMM of each problem's A and B in the same rounds: the "
                        "baseline's time over it bounds the ratio fusing the epilogue can reach")
    p.add_argument("--calls-per-jit", type=_positive, default=1, metavar="R",
                   help="time R calls inside one jitted function, each on its own inputs, as a "
                        "model's step runs them: the GPU's time per call, without the host's cost "
                        "of a jitted call (which exceeds a small GEMM's)")
    p.add_argument("--clocks", action=_ClocksFlag,
                   help="sample the SM clock and board power (nvidia-smi, every 20 ms) during the "
                        "timed rounds and add their medians to the table")


class _ClocksFlag(argparse.Action):
    """``--clocks``, refused at parse time where there is no nvidia-smi to read them."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if shutil.which("nvidia-smi") is None:
            parser.error("--clocks reads the GPU's clock with nvidia-smi, which is not on PATH")
        setattr(namespace, self.dest, True)


def run_from_args(args: argparse.Namespace,
                  progress: Callable[[int, int, str], None] | None = text_progress) -> dict[str, Any]:
    """Run the benchmark ``args`` ask for, print its table(s) and return {"results": [...],
    "no_triton": [...] or None, "complete": True} as dicts. The JSON file, if asked for, is
    rewritten after every measured problem with ``"complete": false`` until the end, so a
    run that is stopped keeps what it measured."""
    shapes = args.shapes or (QUICK_SHAPES if args.quick else STANDARD_SHAPES)
    if len(args.configs) + 2 > MAX_TIMED:
        raise SystemExit(f"--configs: at most {MAX_TIMED - 2} configs are timed in the same rounds "
                         f"(with their baseline and --bound's GEMM); {len(args.configs)} given.")
    problems = [bench_problem(e, s, args.dtype, c) for s in shapes for e in args.epilogues
                for c in args.configs]
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": [], "no_triton": None,
              "complete": False}
    if args.calls_per_jit > 1:
        refusals = (_chain_refusal(p, _moved_bytes(p), args.calls_per_jit) for p in problems)
        refusal = next(filter(None, refusals), None)
        if refusal:
            raise SystemExit(f"--calls-per-jit: {refusal}")
    done = _resumed(args.json, report) if args.resume else []
    report["results"] = [dataclasses.asdict(r) for r in done]
    measured = {_key(r) for r in done}
    problems = [p for p in problems if _key(p) not in measured]

    def save(**update: Any) -> None:
        report.update(update)
        if args.json:
            # write aside, then rename: a run stopped mid-write leaves the previous file whole
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    with ClockSampler() if args.clocks else contextlib.nullcontext() as clocks:
        results = done + run(problems, progress=progress, rounds=args.rounds,
                             min_round_s=args.min_round_time, check=not args.skip_check, clocks=clocks,
                             bound=args.bound, calls_per_jit=args.calls_per_jit,
                             checkpoint=lambda rs: save(results=[dataclasses.asdict(r) for r in done + rs]))
    title = baseline_title() + (f", {args.calls_per_jit} calls per jit" if args.calls_per_jit > 1 else "")
    print(format_table(results, title), flush=True)
    if args.also_no_triton:
        save(no_triton=_run_without_triton(args, shapes))
    save(complete=True)
    return report


def _key(r: Problem | Result) -> tuple:
    return r.epilogue, tuple(r.shape), r.dtype, r.config


def _resumed(path: str | None, report: dict[str, Any]) -> list[Result]:
    """The results a run left in ``path`` (none if there is no such file), refused with an
    error naming the difference when it ran on another device or with other XLA flags."""
    if not path:
        raise SystemExit("--resume needs --json FILE: the file whose results it keeps")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        old = json.load(f)
    for field in ("device", "xla_flags"):
        if old.get(field) != report[field]:
            raise SystemExit(f"--resume: {path} was measured with {field} {old.get(field)!r}, this "
                             f"run has {report[field]!r}; name another --json file.")
    return [Result.from_json(r) for r in old["results"]]


def _run_without_triton(args: argparse.Namespace, shapes: Sequence[Shape]) -> list[dict[str, Any]]:
    """The same benchmark in a fresh process whose XLA has Triton GEMMs off; its table goes
    to our stdout, its results come back through a JSON file: next to ``--json``'s
    (``<name>.no_triton.json``, kept as it goes, like ours) or a temporary one."""
    with tempfile.TemporaryDirectory() as tmp:
        out = (os.path.splitext(args.json)[0] + ".no_triton.json" if args.json
               else os.path.join(tmp, "no_triton.json"))
        argv = [sys.executable, "-m", "jax_efc.bench", "--shapes", *(",".join(map(str, s)) for s in shapes),
                "--epilogues", ",".join(args.epilogues), "--dtype", args.dtype, "--rounds", str(args.rounds),
                "--configs", *(config_label(c) for c in args.configs),
                "--min-round-time", str(args.min_round_time), "--calls-per-jit", str(args.calls_per_jit),
                "--json", out]
        argv += [flag for flag, on in (("--skip-check", args.skip_check), ("--clocks", args.clocks),
                                       ("--bound", args.bound),
                                       ("--resume", args.resume and args.json)) if on]
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_TRITON_FLAG}".strip())
        # this process keeps its preallocated GPU pool: the child allocates as it goes
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        print(flush=True)
        subprocess.run(argv, env=env, check=True)
        with open(out) as f:
            return json.load(f)["results"]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m jax_efc.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    main()
