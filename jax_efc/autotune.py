"""Autotuning: the heuristic's candidate configs for one GEMM timed on the GPU at first use, the
fastest kept on disk.

``config="autotune"`` (or ``JAX_EFC_AUTOTUNE=1`` for calls without a config) asks for it. The
plan (``jax_efc.plan``) first makes the heuristic's plan; :func:`tuned_config` then looks for a
record of that GEMM on this GPU model and, if there is none and a GPU is present, has a tuning
process (``python -m jax_efc.tuning``: a fresh interpreter on the same GPU, so nothing runs
inside the program being traced or lowered) time the policy's candidates in interleaved
rounds and write one. A candidate replaces the heuristic's config only if it was faster by
more than ``NOISE``, so tuning never picks a config slower than the heuristic's beyond the
timing noise. Without a GPU (an export), the heuristic's config stands unless a record says
otherwise.

A record's key covers what decides the timing: the GPU model and SM count, the kernel's
problem without its config (epilogue IR, dtypes, majors, arch), the GEMM's sizes, and the
versions of jax_efc, the DSL and JAX with a digest of the kernel sources. Records live
owner-only under ``jax_efc.config.cache_dir()/autotune``, written atomically; one that does not
parse is ignored and tuned again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["requested", "gpu", "record_key", "choose", "tuned_config", "store", "load", "records", "directory",
           "NOISE"]

# a candidate must beat the heuristic's time by this fraction to replace it: about the spread of
# repeated timings of one kernel in interleaved rounds on the H200 (benchmarks/FINDINGS.md)
NOISE = 0.01

_memo: dict[str, Any] = {}


def requested(config: Any) -> bool:
    """Whether a call's ``config`` asks for autotuning: ``"autotune"``, or None with
    ``JAX_EFC_AUTOTUNE=1``."""
    if config == "autotune":
        return True
    return config is None and os.environ.get("JAX_EFC_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")


def gpu() -> tuple[str, int] | None:
    """(model, SM count) of the first CUDA device, or None."""
    from jax_efc import device

    return device.gpu_model()


def record_key(plan: Any, gpu: tuple[str, int]) -> str:
    """The record name of ``plan``'s GEMM on ``gpu``: everything its timing depends on but the
    config."""
    from jax_efc import device
    from jax_efc.config import GemmConfig

    problem = dataclasses.replace(plan.problem, config=GemmConfig())
    text = repr(("jax_efc autotune v1", gpu, problem.compile_key, plan.mnkl, device.build_versions()))
    return hashlib.sha256(text.encode()).hexdigest()


def choose(configs: Sequence[Any], times: Sequence[float],
           retime: Callable[[int], tuple[float, float]] | None = None) -> Any:
    """Of ``configs`` (the heuristic's first) timed ``times``, the one to keep: the fastest, if
    it beat the heuristic's by more than ``NOISE`` and, given ``retime`` (candidate ``i`` -> the
    heuristic's and its times in a sitting of their own), by as much again there; else the
    heuristic's. (On an H100 a lead seen once among many candidates did not always hold: a
    kept config ran 2.5% slower than the heuristic's in the benchmark; benchmarks/FINDINGS.md.)"""
    best = min(range(len(configs)), key=lambda i: times[i])
    if best == 0 or times[best] >= times[0] * (1 - NOISE):
        return configs[0]
    if retime is not None:
        heuristic, candidate = retime(best)
        if candidate >= heuristic * (1 - NOISE):
            return configs[0]
    return configs[best]


def directory() -> str:
    """Where the records are kept."""
    from jax_efc.config import private_cache_dir

    return private_cache_dir("autotune")


def store(key: str, mnkl: Sequence[int], config: Any, configs: Sequence[Any], times: Sequence[float]) -> None:
    """Write the record ``key`` of an M x N x K x L GEMM (atomically): the config kept, and every
    candidate's time (the heuristic's first)."""
    from jax_efc.config import write_record

    write_record(directory(), key, {"mnkl": list(mnkl), "config": dataclasses.asdict(config),
                                     "timed": [[dataclasses.asdict(c), t] for c, t in zip(configs, times)]})
    _memo.pop(key, None)


def load(key: str) -> Any:
    """The config the record ``key`` keeps, or None (no record, or one that does not parse)."""
    from jax_efc.config import GemmConfig, read_record

    try:
        return GemmConfig(**read_record(directory(), key)["config"])
    except (ValueError, KeyError, TypeError):
        return None


def records() -> dict[str, dict[str, Any]]:
    """Every record on disk that parses, by key: its ``mnkl``, ``config`` and ``timed``."""
    found = {}
    folder = directory()
    for name in os.listdir(folder):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    body = json.load(f)
                body["mnkl"], body["config"], body["timed"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            found[name[:-len(".json")]] = body
    return found


def tuned_config(plan: Any, avals: Sequence[Any], params: dict[str, Any], devices: Any) -> Any:
    """The config to run ``plan``'s GEMM with: a record's, else (with a GPU, and the devices
    known) the tuning process's, else None (keep the heuristic's)."""
    model = gpu()
    if model is None:
        return None  # no GPU to time on, nor a model to look a record up for
    key = record_key(plan, model)
    if key not in _memo:
        config = load(key)
        if config is None and devices != ():
            config = _tune_in_a_process(avals, params, key)
        _memo[key] = config
    return _memo[key]


def _tune_in_a_process(avals: Sequence[Any], params: dict[str, Any], key: str) -> Any:
    """Run ``jax_efc.tuning`` on the call and read the record it writes (None if it failed:
    the heuristic's config then stands)."""
    import logging

    from jax_efc import device
    from jax_efc.log import log_once

    ran, last = device.run_on_gpu("jax_efc.tuning", avals, params)
    if not ran:
        log_once(logging.WARNING, f"autotuning failed; the heuristic's config runs: {last}")
        return None
    return load(key)
