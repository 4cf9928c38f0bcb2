"""Timing a GEMM's candidate configs on the GPU and recording the fastest (``autotune``).

Run as ``python -m jax_efc.tuning JOB`` by the plan at a call's first use, and by
``jax-efc tune`` ahead of time. Each candidate is the kernel the plan makes with that config,
timed on the same random inputs as the others in interleaved rounds (``bench.timing``); the
record keeps the heuristic's config unless another was faster by more than
``autotune.NOISE``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import jax

from jax_efc import autotune, compile_ahead

__all__ = ["tune_call"]

# timed as the benchmark times (bench.timing: its rounds, 0.1 s each), so that the two agree: a
# config kept after rounds of 0.05 s ran up to 4% slower than the heuristic's in the benchmark
# on an H100 (benchmarks/FINDINGS.md)
_ROUND_S = 0.1


def tune_call(specs: Sequence[tuple], params: dict[str, Any]) -> tuple[Any, list[Any], list[float]]:
    """Time the candidates of the fused-GEMM call with inputs ``specs`` ((shape, dtype) each, in
    the primitive's canonical shapes) and ``params``; record and return (the config kept, the
    candidates, their times in seconds)."""
    from jax_efc import device, ffi
    from jax_efc.bench.problems import random_inputs
    from jax_efc.bench.timing import ROUNDS, time_interleaved
    from jax_efc.ffi import kernel_cache
    from jax_efc.kernels import policy
    from jax_efc.plan import plan_kernel, sm_margin

    avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
    a, b, *operands = avals
    kw = dict(transpose_a=params["transpose_a"], transpose_b=params["transpose_b"], acc_dtype=params["acc_dtype"],
              arch=device.arch(), precision=params["precision"], sm_margin=sm_margin(params))
    heuristic = plan_kernel(params["ir"], a, b, operands, config=None, **kw)
    if heuristic.backend != "kernel":
        raise ValueError(f"no kernel to tune: {heuristic.reason}")
    pol = policy(heuristic.arch)
    margin = heuristic.config.sm_margin  # the candidates leave the SMs the heuristic's does
    configs = [dataclasses.replace(c, sm_margin=margin) for c in pol.candidate_configs(
        heuristic.problem, *heuristic.mnkl, sm_count=device.sm_count(pol.default_sm_count) - margin)]
    plans = [plan_kernel(params["ir"], a, b, operands, config=c, **kw) for c in configs]
    kept = [(c, p) for c, p in zip(configs, plans) if p.backend == "kernel"]
    configs = [c for c, _ in kept]
    # the candidates' kernels are built side by side by the compile-ahead workers; each
    # candidate's first call below then finds its kernel in the cache
    specs = tuple((tuple(x.shape), str(x.dtype)) for x in avals)
    builds = [compile_ahead.workers(None).submit(specs, p) for _, p in kept
              if kernel_cache.enabled() and not ffi.in_cache(p, avals)]
    for build in builds:
        build.result()
    fns = [jax.jit(lambda *args, plan=p: ffi.fused_gemm(*args, plan=plan)) for _, p in kept]
    inputs = random_inputs(avals, jax.random.key(0))
    times, _ = time_interleaved(fns, [inputs], ROUNDS, None, _ROUND_S, 1)
    config = autotune.choose(configs, times, lambda i: tuple(
        time_interleaved([fns[0], fns[i]], [inputs], 2 * ROUNDS, None, _ROUND_S, 1)[0]))
    autotune.store(autotune.record_key(heuristic, autotune.gpu()), heuristic.mnkl, config, configs, times)
    return config, configs, times


if __name__ == "__main__":
    from jax_efc import device

    tune_call(*device.read_job(sys.argv[1]))
