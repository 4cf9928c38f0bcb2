"""Where a benchmark problem's time goes: every GPU kernel one call launches, with its duration.

    python benchmarks/breakdown.py --epilogues fp8train:bias+gelu_tanh --shapes 8192,14336,4096
                                   [--traces DIR]

For each problem, each side (ours, then the baseline) is warmed up, then called a few times under
JAX's profiler; the table lists the kernels of the last call in launch order with their durations,
and the sum over the call. The sum leaves out the gaps between kernels: compare sides' times with
``benchmarks/run.py``, and use this for what each side spends its time on. ``--traces`` keeps the
Perfetto traces (open them at ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import tempfile
import time

import jax

from jax_efc.bench.command import parse_epilogues, parse_shape
from jax_efc.bench.problems import bench_problem, random_inputs

CALLS = 3  # profiled calls per side; the last one is listed


def _gpu_kernels(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of the kernels on the GPU's streams in a Perfetto trace."""
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid"))] = e["args"]["name"]
    gpu = {pid for (kind, pid, _), name in names.items() if kind == "process_name" and "GPU" in name}
    streams = {(pid, tid) for (kind, pid, tid), name in names.items()
               if kind == "thread_name" and pid in gpu and "Stream" in name}
    return sorted((e["ts"], e["dur"], e["name"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and (e["pid"], e["tid"]) in streams)


def _last_call(kernels: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The kernels after the widest gap between kernels: the last of the profiled calls, which
    are separated by a host-side sleep."""
    if len(kernels) < 2:
        return kernels
    gaps = [kernels[i + 1][0] - (kernels[i][0] + kernels[i][1]) for i in range(len(kernels) - 1)]
    cut = max(range(len(gaps)), key=lambda i: (gaps[i], i))
    return kernels[cut + 1:]


def profile(fn, inputs: tuple, log_dir: str) -> list[tuple[float, float, str]]:
    """The kernels of one call of ``fn`` (warmed up first), from a profile kept in ``log_dir``."""
    for _ in range(2):
        jax.block_until_ready(fn(*inputs))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(CALLS):
            jax.block_until_ready(fn(*inputs))
            time.sleep(0.02)  # a gap wider than any within a call: where _last_call cuts
    (path,) = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True))[-1:]
    with gzip.open(path) as f:
        return _last_call(_gpu_kernels(json.load(f)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epilogues", required=True, help="comma-separated benchmark problem names")
    p.add_argument("--shapes", nargs="+", required=True, help="M,N,K[,L] ...")
    p.add_argument("--traces", help="keep the traces under this folder (default: a temporary one)")
    p.add_argument("--width", type=int, default=100, help="kernel names are clipped to this width")
    args = p.parse_args(argv)
    root = args.traces or tempfile.mkdtemp(prefix="jax_efc-breakdown-")
    for epilogue in parse_epilogues(args.epilogues):
        for shape in map(parse_shape, args.shapes):
            problem = bench_problem(epilogue, shape)
            inputs = random_inputs(problem.specs, jax.random.key(0), problem.stds)
            for side in ("ours", "baseline"):
                tag = f"{epilogue}-{'x'.join(map(str, shape))}-{side}".replace(":", "_").replace("+", "_")
                kernels = profile(getattr(problem, side), inputs, os.path.join(root, tag))
                print(f"\n{epilogue} {'x'.join(map(str, shape))} {side}: {len(kernels)} kernels, "
                      f"{sum(d for _, d, _ in kernels):.1f} us", flush=True)
                for _, d, name in kernels:
                    print(f"  {d:9.1f}  {name[:args.width]}")


if __name__ == "__main__":
    main()
