"""The timing protocol: interleaved rounds of many calls of each side in one process,
inputs rotated beyond L2, the median round; the SM clock and power beside them."""

from __future__ import annotations

import bisect
import itertools
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..primitive import backends
from .problems import Problem
from .report import Result, label, shape_str

PEAK_TFLOPS = 790.0  # measured bf16 dense peak of the reference H200


def peak_tflops(dtype: str) -> float:
    """The tensor cores' peak for A/B of ``dtype``: twice the 16-bit one for 8-bit types."""
    return PEAK_TFLOPS * (2 if jnp.dtype(dtype).itemsize == 1 else 1)
L2_BYTES = 60 * 2**20
# inputs and outputs that ``calls_per_jit`` may hold on the device at once
_CHAIN_BYTES = 16 * 2**30
ROUNDS = 6  # timed rounds by default: whole cycles of timing_order for two to four functions
# functions timed in one set of rounds at most: configs, their baseline and --bound's GEMM
# (timing_order's search for larger sets grows from milliseconds to minutes)
MAX_TIMED = 16


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _rel_err(out: Any, ref: Any) -> float:
    errs = [jnp.linalg.norm((o.astype(jnp.float32) - r.astype(jnp.float32)).ravel())
            / jnp.linalg.norm(r.astype(jnp.float32).ravel())
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


def time_interleaved(fns: Sequence[Callable[..., Any]], input_sets: Sequence[tuple], rounds: int,
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


def moved_bytes(problem: Problem) -> int:
    """The least bytes a call moves: its inputs read and its outputs written (every input of
    ``specs``, those a ``derive`` computes and their sources alike)."""
    return _nbytes(problem.specs) + _nbytes(jax.eval_shape(problem.ours, *problem.specs))


def chain_refusal(problem: Problem, moved: int, calls_per_jit: int) -> str | None:
    """Why ``calls_per_jit`` calls of ``problem``, each moving ``moved`` bytes, cannot be held
    at once (None: they can)."""
    held = calls_per_jit * moved
    if held <= _CHAIN_BYTES:
        return None
    return (f"{calls_per_jit} calls per jit of {shape_str(problem.shape)} would hold "
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
    ``bound``, the time of the problem's GEMMs alone in the same rounds, ours
    (``Problem.gemms_alone``: our plain GEMMs, no epilogue) and XLA's
    (``Problem.baseline_gemms_alone``), where it has them.

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
    moved = moved_bytes(first)
    if calls_per_jit > 1:
        refusal = chain_refusal(first, moved, calls_per_jit)
        if refusal:
            raise ValueError(refusal)
        chained = [first.inputs(k) for k in jax.random.split(jax.random.key(seed), calls_per_jit)]
        input_sets, first_inputs = [(chained,)], chained[0]
    else:
        n_sets = 1 if moved >= L2_BYTES else min(16, math.ceil(2 * L2_BYTES / moved))
        input_sets = [first.inputs(k) for k in jax.random.split(jax.random.key(seed), n_sets)]
        first_inputs = input_sets[0]

    errs: list[float | None] = [None] * len(problems)
    base_err = None
    stage("compiling, and checking against the float32 reference" if check else "compiling")
    if check:
        ref = first.reference(*first_inputs)
        errs = [_rel_err(p.ours(*first_inputs), ref) for p in problems]
        base_err = _rel_err(first.baseline(*first_inputs), ref)
        del ref
    bound = bound and first.gemms_alone is not None
    plain = [first.gemms_alone, first.baseline_gemms_alone] if bound else []
    fns = [p.ours for p in problems] + [first.baseline] + plain
    if calls_per_jit > 1:
        fns = [jax.jit(lambda sets, fn=fn: [fn(*inputs) for inputs in sets]) for fn in fns]
    stage(f"warming up and timing {len(fns)} functions in interleaved rounds")
    times, windows = time_interleaved(fns, input_sets, rounds, calls, min_round_s, warmup)
    times = [t / calls_per_jit for t in times]
    count = len(problems)
    ours_s, base_s = times[:count], times[count]
    plain_s, base_plain_s = times[count + 1:count + 3] if bound else (None, None)
    sampled = [clocks.median(w) if clocks else (None, None) for w in windows]
    power, (base_mhz, base_watts) = sampled[:count], sampled[count]
    plain_mhz, plain_watts = sampled[count + 1] if bound else (None, None)
    m, n, k, l = first.shape
    results = []
    for p, t, err, (mhz, watts) in zip(problems, ours_s, errs, power):
        tflops = 2 * p.gemms * m * n * k * l / t / 1e12
        backend = "; ".join(dict.fromkeys(backends(p.ours, *p.specs))) or "none"
        results.append(Result(p.epilogue, p.shape, p.dtype, p.config, backend, t, base_s, tflops,
                              base_s / t, tflops / peak_tflops(p.dtype), moved / 1e9, err, base_err,
                              mhz, base_mhz, watts, base_watts, plain_s, calls_per_jit, plain_mhz,
                              plain_watts, base_plain_s))
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
            progress(len(results), len(problems), label(group[0]))
        for p, r in zip(group, measure_together(group, **measure_kw)):
            results.append(r)
            if progress:
                progress(len(results), len(problems), f"{label(p)} {r.ratio:.2f}x")
        if checkpoint:
            checkpoint(results)
    return results
