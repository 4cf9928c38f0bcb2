"""The benchmark's command line (``python -m jax_efc.bench``, ``jax-efc bench``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..config import GemmConfig
from .problems import EPILOGUES, NAMED_EPILOGUES, QUICK_SHAPES, STANDARD_SHAPES, Problem, Shape, bench_problem, config_label
from .report import NO_TRITON_FLAG, Result, baseline_title, format_table
from .timing import ClockSampler, MAX_TIMED, ROUNDS, chain_refusal, moved_bytes, run, text_progress


def parse_shape(text: str) -> Shape:
    """"M,N,K" or "M,N,K,L" -> (M, N, K, L); raises ``argparse.ArgumentTypeError``."""
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) not in (3, 4) or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not M,N,K or M,N,K,L with positive integers")
    return dims if len(dims) == 4 else (*dims, 1)


def parse_config(text: str) -> GemmConfig | str | None:
    """"auto" -> None; "autotune" stays; "tile_m,tile_n[,cluster_m,cluster_n][,field=value ...]"
    -> a GemmConfig, e.g. "128,256,2,1,swizzle=8" or "64,256,pingpong=1"."""
    if text == "auto":
        return None
    if text == "autotune":
        return text
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


def parse_epilogues(text: str) -> list[str]:
    """"gemm,bias+gelu_tanh" -> the named epilogues, each checked."""
    names = [e for e in text.split(",") if e]
    bad = [e for e in names if e not in NAMED_EPILOGUES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown epilogue(s) {bad}; choose from "
                                         f"{','.join(NAMED_EPILOGUES)}")
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
    p.add_argument("--epilogues", type=parse_epilogues, default=list(EPILOGUES),
                   help=f"comma-separated, from {','.join(NAMED_EPILOGUES)} (default: "
                        f"{','.join(EPILOGUES)})")
    p.add_argument("--configs", nargs="+", type=parse_config, default=[None], metavar="CONFIG",
                   help="kernel configs to compare, timed in the same rounds: 'auto' (the "
                        "heuristic, default), 'autotune' (the fastest candidate, tuned at first "
                        "use) or tile_m,tile_n[,cluster_m,cluster_n][,field=value...]")
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
                   help="also time each problem's GEMMs alone in the same rounds, ours and XLA's: the "
                        "baseline's time over them bounds the ratio fusing the epilogue can reach")
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
    if len(args.configs) + 3 > MAX_TIMED:
        raise SystemExit(f"--configs: at most {MAX_TIMED - 3} configs are timed in the same rounds "
                         f"(with their baseline and --bound's GEMMs, ours and XLA's); {len(args.configs)} given.")
    problems = [bench_problem(e, s, args.dtype, c) for s in shapes for e in args.epilogues
                for c in args.configs]
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": [], "no_triton": None,
              "complete": False}
    if args.calls_per_jit > 1:
        refusals = (chain_refusal(p, moved_bytes(p), args.calls_per_jit) for p in problems)
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
    package_doc = importlib.import_module(__package__).__doc__
    p = argparse.ArgumentParser(prog="python -m jax_efc.bench", description=package_doc.splitlines()[0])
    add_arguments(p)
    run_from_args(p.parse_args(argv))

