"""Where a benchmark problem's time goes: every GPU kernel one call launches, with its duration.

    python benchmarks/breakdown.py --epilogues fp8train:bias+gelu_tanh --shapes 8192,14336,4096
                                   [--traces DIR] [--hlo DIR]
    python benchmarks/breakdown.py --gpt dense,fp8,flax-fp8 [--attention cudnn] [--top 25]

For each problem, each side (ours, then the baseline) is warmed up, then called a few times under
JAX's profiler; the table lists the kernels of the last call in launch order with their durations,
and the sum over the call. The sum leaves out the gaps between kernels: compare sides' times with
``benchmarks/run.py``, and use this for what each side spends its time on. ``--traces`` keeps the
Perfetto traces (open them at ui.perfetto.dev); ``--hlo`` writes each side's optimised HLO, where
the fusions the kernels are named for are spelt out. ``--gpt`` profiles the training step of
``examples/gpt_fp8.py``'s benchmark model (4 blocks, width 2048, 8 x 2048 tokens) for each kind of
layer instead, and sums its kernels by kind (GEMMs, attention, the rest) before listing the
longest.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax

from jax_efc.bench.command import parse_epilogues, parse_shape
from jax_efc.bench.problems import bench_problem

CALLS = 3  # profiled calls per side; the last one is listed


Kernel = tuple[float, float, str, str]  # start (us), duration (us), kernel name, HLO op that launched it


def _gpu_kernels(trace: dict) -> list[Kernel]:
    """The kernels on the GPU's streams in a Perfetto trace, in launch order."""
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid"))] = e["args"]["name"]
    gpu = {pid for (kind, pid, _), name in names.items() if kind == "process_name" and "GPU" in name}
    streams = {(pid, tid) for (kind, pid, tid), name in names.items()
               if kind == "thread_name" and pid in gpu and "Stream" in name}
    return sorted((e["ts"], e["dur"], e["name"], e.get("args", {}).get("hlo_op", "")) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and (e["pid"], e["tid"]) in streams)


def _last_call(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels of the last of the ``CALLS`` profiled calls: those after the last of the
    ``CALLS - 1`` widest gaps between kernels (the calls are separated by a host-side sleep)."""
    gaps = [kernels[i + 1][0] - (kernels[i][0] + kernels[i][1]) for i in range(len(kernels) - 1)]
    cuts = sorted(range(len(gaps)), key=lambda i: gaps[i])[-(CALLS - 1):]
    return kernels[max(cuts) + 1:] if len(kernels) >= CALLS else kernels


def profile(fn, inputs: tuple, log_dir: str) -> list[Kernel]:
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


def kind(name: str) -> str:
    """The kind of work a kernel named ``name`` does."""
    if "FusedGemm" in name or "Sm90" in name or "Sm100" in name:
        return "jax_efc GEMMs"
    if name.startswith(("nvjet", "sm90_xmma", "cutlass")) or "gemm" in name.lower():
        return "cuBLAS / XLA GEMMs"
    if "cudnn" in name.lower() or "flash" in name.lower() or "fmha" in name.lower():
        return "attention"
    return "elementwise, reductions, transposes"


def gpt_step(layers: str, attention: str | None):
    """(step, its arguments) of ``examples/gpt_fp8.py``'s benchmark model with ``layers``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt_fp8 import timed_step

    return timed_step(layers, attention)


def custom_call_types(hlo: str) -> dict[str, str]:
    """For each custom call of an optimised HLO module: "result <- operands" (types with shapes),
    from which a GEMM's M, N and K read off."""
    out = {}
    layouts = re.compile(r"\{[0-9,]*\}")
    for m in re.finditer(r"%(\S+) = (.+?) custom-call\(.*?operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}",
                         hlo):
        out[m[1]] = f"{layouts.sub('', m[2])} <- {layouts.sub('', m[3])}"
    return out


def report(title: str, kernels: list[Kernel], width: int, top: int | None = None, hlo: str | None = None) -> None:
    """Print ``kernels``' total, then either each in launch order (``top`` None) or the sums by
    kind, the ``top`` longest names summed over launches and each jax_efc GEMM launch (its
    operands' types from ``hlo``, the optimised module, where given)."""
    total = sum(k[1] for k in kernels)
    print(f"\n{title}: {len(kernels)} kernels, {total:.1f} us", flush=True)
    if top is None:
        for _, d, name, _ in kernels:
            print(f"  {d:9.1f}  {name[:width]}")
        return
    by_kind, by_name = collections.Counter(), collections.Counter()
    for _, d, name, _ in kernels:
        by_kind[kind(name)] += d
        by_name[name] += d
    for k, d in by_kind.most_common():
        print(f"  {d:9.1f}  {d / total:4.0%}  {k}")
    print(f"  the {top} longest (summed over launches):")
    for name, d in by_name.most_common(top):
        print(f"  {d:9.1f}  {name[:width]}")
    types = custom_call_types(hlo or "")
    print("  jax_efc GEMMs in launch order:")
    for _, d, name, op in kernels:
        if kind(name) == "jax_efc GEMMs":
            print(f"  {d:9.1f}  {op}  {types.get(op, '')[:2 * width]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epilogues", help="comma-separated benchmark problem names")
    p.add_argument("--shapes", nargs="+", help="M,N,K[,L] ...")
    p.add_argument("--gpt", help="comma-separated layer kinds of examples/gpt_fp8.py")
    p.add_argument("--attention", choices=("xla", "cudnn"), default=None, help="with --gpt: its attention")
    p.add_argument("--top", type=int, default=25, help="with --gpt: how many of the longest kernels to list")
    p.add_argument("--traces", help="keep the traces under this folder (default: a temporary one)")
    p.add_argument("--hlo", help="write each side's optimised HLO under this folder")
    p.add_argument("--width", type=int, default=100, help="kernel names are clipped to this width")
    args = p.parse_args(argv)
    if not args.gpt and not (args.epilogues and args.shapes):
        p.error("give --epilogues and --shapes, or --gpt")
    root = args.traces or tempfile.mkdtemp(prefix="jax_efc-breakdown-")
    for layers in args.gpt.split(",") if args.gpt else ():
        step, inputs = gpt_step(layers, args.attention)
        hlo = _optimised_hlo(step, inputs, args.hlo, f"gpt-{layers}")
        report(f"GPT step, {layers}", profile(step, inputs, os.path.join(root, f"gpt-{layers}")), args.width,
               args.top, hlo)
    for epilogue in parse_epilogues(args.epilogues) if args.epilogues else ():
        for shape in map(parse_shape, args.shapes):
            problem = bench_problem(epilogue, shape)
            inputs = problem.inputs(jax.random.key(0))
            for side in ("ours", "baseline"):
                tag = f"{epilogue}-{'x'.join(map(str, shape))}-{side}".replace(":", "_").replace("+", "_")
                fn = getattr(problem, side)
                _optimised_hlo(fn, inputs, args.hlo, tag)
                report(f"{epilogue} {'x'.join(map(str, shape))} {side}", profile(fn, inputs, os.path.join(root, tag)),
                       args.width)


def _optimised_hlo(fn, inputs: tuple, folder: str | None, tag: str) -> str | None:
    """``fn``'s optimised HLO for ``inputs``, written to ``folder/tag.hlo.txt``; None without a
    folder (compiling again for it takes as long as the first time)."""
    if not folder:
        return None
    text = fn.lower(*inputs).compile().as_text()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, tag + ".hlo.txt"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
