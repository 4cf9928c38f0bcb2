"""The ``jax-efc`` command: run one fused GEMM, benchmark a set, or show the setup.

    jax-efc run --mnkl 4096,4096,4096,1 --epilogue alpha-beta --ab_dtype BFloat16
    jax-efc run --mnkl 1024,1024,512,1 --expr "jnp.tanh(acc) * 2"
    jax-efc bench --shapes 8192,8192,8192 --epilogues gemm,bias+gelu_tanh --plot ratios.png
    jax-efc info
"""

from __future__ import annotations

import argparse
import importlib.util
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import bench, device, example_epilogues
from .config import GemmConfig
from .epilogue import EpilogueError
from .kernels.problem import epilogue_tile

__all__ = ["main"]

_DTYPE_ALIASES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16",
                  "f32": "float32", "fp32": "float32", "tf32": "float32", "f64": "float64"}


def _dtype(text: str) -> str:
    """A dtype from a CUTLASS name (``BFloat16``, ``Float16``, ``Float32``, ``Float8E4M3FN``),
    a NumPy name (``bfloat16``) or a short one (``bf16``)."""
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name.startswith("float8e"):  # CUTLASS's Float8E4M3FN is NumPy's float8_e4m3fn
        name = "float8_" + name[len("float8"):]
    try:
        return np.dtype(getattr(jnp, name, name)).name
    except TypeError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (try BFloat16, Float16, Float32)") from None


def _ints(count: int) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(v) for v in text.split(","))
        except ValueError:
            vals = ()
        if len(vals) != count or min(vals) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not {count} comma-separated positive integers")
        return vals

    return parse


def _expr_epilogue(expr: str) -> Callable[[Any], Any]:
    """An epilogue from a Python expression of ``acc`` (with ``jnp`` and ``jax`` in scope).
    It is evaluated as code: pass only expressions you wrote yourself."""
    code = compile(expr, "<--expr>", "eval")

    def epilogue(acc):
        return eval(code, {"jnp": jnp, "jax": jax, "acc": acc})  # noqa: S307 (the user's own command line)

    return epilogue


# jax-efc run --------------------------------------------------------------------------------

def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run one fused GEMM, check it and time it",
                       description="Run one fused GEMM (an epilogue of CUTLASS's custom-epilogue example "
                                   "or --expr), check it against a float32 reference, and time it against "
                                   "the same math in plain JAX.")
    p.add_argument("--mnkl", type=_ints(4), default=(1024, 1024, 512, 1), metavar="M,N,K,L")
    for name, default in (("ab", "bfloat16"), ("c", None), ("d", None), ("acc", "float32"),
                          ("epi", "float32"), ("x", None), ("y", None)):
        p.add_argument(f"--{name}_dtype", type=_dtype, default=default,
                       help=f"default: {default or 'ab_dtype'}")
    p.add_argument("--mma_tiler_mn", type=_ints(2), metavar="M,N", help="kernel tile (default: heuristic)")
    p.add_argument("--cluster_shape_mn", type=_ints(2), metavar="M,N", help="cluster shape (default: heuristic)")
    p.add_argument("--alpha", type=float, default=2.0)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--x_factor", type=float, default=3.0)
    p.add_argument("--scale", type=float, default=0.5, help="the complex epilogue's scale")
    p.add_argument("--warmup_iterations", type=int, default=2)
    p.add_argument("--iterations", type=int, default=50,
                   help=f"timed calls, in {bench.ROUNDS} rounds that alternate which of ours and the "
                        "baseline runs first (median round)")
    p.add_argument("--skip_ref_check", action="store_true")
    p.add_argument("--tolerance", type=float, help="largest relative error of the check (default: by dtype)")
    # CUTLASS's example conventions: the contiguous dimension of A, B and C (and X)
    p.add_argument("--a_major", choices=["k", "m"], default="k")
    p.add_argument("--b_major", choices=["n", "k"], default="n")
    p.add_argument("--c_major", choices=["n", "m"], default="n")
    p.add_argument("--use_cold_l2", action="store_true",
                   help="inputs rotate among sets larger than L2 (every jax_efc timing does, where one set fits)")
    p.add_argument("--use_2cta_instrs", action="store_true",
                   help="2-CTA MMA (Blackwell): pins a 2-CTA config; named and ignored on other GPUs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--epilogue", choices=sorted(example_epilogues.EXAMPLES), default="alpha-beta")
    which.add_argument("--expr", help="an epilogue as a Python expression of acc, e.g. \"jnp.tanh(acc)*2\"; "
                                      "evaluated as code, so only your own")
    p.set_defaults(func=_run)


def _config(args: argparse.Namespace) -> GemmConfig | None:
    """The pinned config, or None for the heuristic's. On Blackwell ``--use_2cta_instrs`` pins a
    2-CTA one: ``--mma_tiler_mn`` is then the pair's MMA tile (CUTLASS's example defaults, 256x128
    in 2x1 clusters, where not given)."""
    two_cta = args.use_2cta_instrs and (device.arch() or "").startswith("sm_10")
    if args.mma_tiler_mn is None and args.cluster_shape_mn is None and not two_cta:
        return None
    tile = args.mma_tiler_mn or ((256, 128) if two_cta else (GemmConfig.tile_m, GemmConfig.tile_n))
    cluster = args.cluster_shape_mn or ((2, 1) if two_cta else (GemmConfig.cluster_m, GemmConfig.cluster_n))
    return GemmConfig(tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0], cluster_n=cluster[1], use_2cta=two_cta)


def _configs_that_ran(problem: bench.Problem) -> list[str]:
    """For each fused GEMM of ``problem`` that the kernel runs, the tile, cluster and schedule it
    runs with (the pinned config, or the heuristic's choice), as its plan says."""
    from .primitive import fused_gemm_eqns, plan_eqn

    if jax.default_backend() != "gpu":
        return []
    lines = []
    for eqn in fused_gemm_eqns(jax.make_jaxpr(problem.ours)(*problem.specs)):
        plan = plan_eqn(eqn)
        if plan.backend != "kernel":
            continue
        cfg = plan.config
        schedule = "ping-pong" if cfg.pingpong else "2-CTA" if cfg.use_2cta else "cooperative"
        epi_m, epi_n = epilogue_tile(cfg)
        lines.append(f"kernel config: tile {cfg.tile_m}x{cfg.tile_n}, cluster {cfg.cluster_m}x{cfg.cluster_n}, "
                     f"{schedule}, epilogue subtile {epi_m}x{epi_n}"
                     + (" (pinned)" if eqn.params["config"] is not None else " (the heuristic's)"))
    return lines


def _run_problem(args: argparse.Namespace, pinned: bool = True) -> bench.Problem:
    operand_dtype = {"c": args.c_dtype, "bias": args.c_dtype, "x": args.x_dtype}
    out_dtype = {"D": args.d_dtype, "Y": args.y_dtype}
    common = dict(acc_dtype=args.acc_dtype, epi_dtype=args.epi_dtype, config=_config(args) if pinned else None,
                  majors=(args.a_major, args.b_major, args.c_major))
    if args.expr is not None:
        return bench.epilogue_problem("expr", _expr_epilogue(args.expr), args.mnkl, args.ab_dtype,
                                      out_dtypes=args.d_dtype, **common)
    example = example_epilogues.EXAMPLES[args.epilogue]
    values = {"alpha": args.alpha, "beta": args.beta, "x_factor": args.x_factor, "scale": args.scale}
    return bench.epilogue_problem(
        args.epilogue, example.fn, args.mnkl, args.ab_dtype,
        [(role, operand_dtype[name]) for name, role in example.operands],
        scalars={k: values[k] for k in example.scalars},
        out_dtypes={k: out_dtype[k] for k in example.outputs}, **common)


def _notes(args: argparse.Namespace) -> list[str]:
    """One line for each flag the run takes but the GPU at hand gives no meaning to."""
    notes = []
    arch = device.arch()
    if args.use_2cta_instrs and not (arch or "").startswith("sm_10"):
        notes.append(f"--use_2cta_instrs: 2-CTA MMA is a Blackwell (sm_100) instruction; on {arch or 'this machine'} "
                     "it has no meaning and is ignored.")
    if args.use_cold_l2:
        notes.append("--use_cold_l2: inputs rotate among sets larger than L2 whenever one set fits in it, "
                     "as every jax_efc timing does.")
    if args.c_major == "m":
        notes.append("--c_major m: jax_efc reads tile operands N-major, so C and X are transposed before the "
                     "GEMM; the time counts it.")
    return notes


def _tolerance(args: argparse.Namespace) -> float:
    """``--tolerance``, else by dtype: 16-bit (or narrower) inputs or outputs land between 1e-3
    and 1e-2; float32 GEMMs may use TF32 on the GPU."""
    if args.tolerance is not None:
        return args.tolerance
    dtypes = [args.ab_dtype, args.d_dtype, args.y_dtype]
    return 2e-2 if min(np.dtype(d).itemsize for d in dtypes) <= 2 else 5e-3


def _run(args: argparse.Namespace) -> int:
    # Allocate GPU memory as needed rather than preallocating most of it, unless the user
    # chose: a profiler that replays kernels (ncu) saves and restores all of it per pass.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    for name in ("c", "d", "x", "y"):
        if getattr(args, f"{name}_dtype") is None:
            setattr(args, f"{name}_dtype", args.ab_dtype)
    if args.expr is not None:
        try:
            compile(args.expr, "<--expr>", "eval")
        except SyntaxError as e:
            args.parser.error(f"--expr is not a Python expression: {e.msg}")
    rounds = max(1, min(bench.ROUNDS, args.iterations))  # the bench rounds it up to whole cycles
    start = time.perf_counter()

    def stage(text: str) -> None:  # long runs (8192^3 on a CPU) say what they are doing
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", file=sys.stderr, flush=True)

    try:
        problem = _run_problem(args)
        # a pinned config is timed in the same rounds as the heuristic's, so they compare
        problems = [problem] + ([_run_problem(args, pinned=False)] if _config(args) is not None else [])
        results = bench.measure_together(problems, rounds=rounds, calls=max(1, args.iterations // rounds),
                                         warmup=args.warmup_iterations, check=not args.skip_ref_check,
                                         stage=stage)
    except (ValueError, TypeError, NameError, AttributeError, EpilogueError) as e:
        args.parser.error(str(e))  # what jax_efc rejects (a shape, dtype, config or epilogue)
    stage("done")
    r = results[0]
    m, n, k, l = args.mnkl
    for note in _notes(args):
        print(note)
    print(f"jax_efc {args.expr or args.epilogue}: M,N,K,L = {m},{n},{k},{l}; ab {args.ab_dtype}, "
          f"acc {args.acc_dtype}, epi {args.epi_dtype}; on {jax.devices()[0].device_kind}")
    print(f"backend: {r.backend}")
    for line in _configs_that_ran(problem):
        print(line)
    print(f"time: {r.ours_s * 1e3:.4f} ms, {r.tflops:.4g} TFLOP/s; plain JAX {r.baseline_s * 1e3:.4f} ms "
          f"(ratio {r.ratio:.2f})")
    if len(results) > 1 and r.backend.startswith("kernel"):
        auto = results[1]
        verdict = "slower than" if r.ours_s > auto.ours_s else "as fast as or faster than"
        print(f"the pinned config ({r.config}) is {verdict} the heuristic's: {r.ours_s * 1e3:.4f} ms against "
              f"{auto.ours_s * 1e3:.4f} ms ({auto.backend}), timed in the same rounds")
    if r.err is None:
        return 0
    tol = _tolerance(args)
    ok = r.err < tol
    print(f"relative error vs float32 reference: {r.err:.2e} (plain JAX {r.baseline_err:.2e}); "
          f"{'ok' if ok else 'FAIL'} (tolerance {tol:.0e})")
    return 0 if ok else 1


# jax-efc bench ------------------------------------------------------------------------------

def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark fused GEMMs against plain JAX",
                       description=bench.__doc__.splitlines()[0])
    bench.add_arguments(p)
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of the ratios (needs matplotlib)")
    p.add_argument("--from-json", metavar="RUN.json",
                   help="with --plot: draw a saved run's --json file instead of measuring")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        args.parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    if args.from_json:
        if not args.plot:
            args.parser.error("--from-json draws a saved run: give --plot FILE.png too")
        try:
            with open(args.from_json) as f:
                report = json.load(f)
            report["results"], report.setdefault("no_triton", None), report["device"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            args.parser.error(f"--from-json {args.from_json}: not a benchmark --json file ({type(e).__name__}: {e})")
        bench.plot(report, args.plot)
        print(f"wrote {args.plot}")
        return 0
    report = bench.run_from_args(args)
    if args.plot:
        bench.plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


# jax-efc info -------------------------------------------------------------------------------

def _add_info(sub: Any) -> None:
    p = sub.add_parser("info", help="versions, devices, GPU architecture, backends and caches")
    p.set_defaults(func=_info)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _info(args: argparse.Namespace) -> int:
    import jax_efc as efc
    from jax_efc import ffi

    for dist in ("jax_efc", "jax", "jaxlib", "nvidia-cutlass-dsl", "flax"):
        print(f"{dist + ':':<20}{_version(dist)}")
    print(f"{'devices:':<20}{', '.join(f'{d.platform}:{d.id} {d.device_kind}' for d in jax.devices())}")
    print(f"{'GPU arch:':<20}{device.arch() or 'none (no CUDA device; efc.set_target_arch or CUTE_DSL_ARCH names one to export for)'}")
    switches = {k: os.environ[k] for k in ("JAX_EFC_DISABLE", "JAX_EFC_STRICT", "JAX_EFC_KERNEL_CACHE", "CUTE_DSL_ARCH",
                                           "JAX_EFC_UNVERIFIED_KERNELS", "JAX_EFC_AUTOTUNE", "JAX_EFC_COMPILE_AHEAD",
                                           "JAX_EFC_SM100")
                if k in os.environ}
    print(f"{'switches:':<20}{switches or 'none set'}")

    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    n = 4096
    samples = {
        "gemm": (lambda a, b: efc.gemm(a, b), bf16(n, n), bf16(n, n)),
        "fused_dense gelu_tanh": (lambda x, w, b: efc.fused_dense(x, w, b, activation="gelu_tanh"),
                                  bf16(n, n), bf16(n, n), bf16(n)),
        "alpha-beta": (lambda a, b, c, x: efc.gemm(a, b, example_epilogues.alpha_beta, c, x,
                                                   **bench.ALPHA_BETA_SCALARS),
                       bf16(n, n), bf16(n, n), bf16(n, n), bf16(n, n)),
    }
    print(f"backends for bf16 {n}x{n}x{n}:")
    for name, (fn, *specs) in samples.items():
        print(f"  {name + ':':<24}{'; '.join(efc.backends(fn, *specs))}")

    from jax_efc.ffi import kernel_cache

    device.use_private_dsl_cache()
    entries, size = kernel_cache.usage()
    state = "on" if kernel_cache.enabled() else "off"
    print("caches:")
    print(f"  {'jax_efc kernels:':<24}{kernel_cache.directory()}: {entries} entries, {size / 2**20:.1f} MiB, "
          f"{state} (off: JAX_EFC_KERNEL_CACHE=0; clear: jax-efc cache clear)")
    print(f"  {'CuTe DSL kernels:':<24}{os.environ.get('CUTE_DSL_CACHE_DIR', 'the DSL default')} (CUTE_DSL_CACHE_DIR)")
    print(f"  {'JAX compilation:':<24}{jax.config.jax_compilation_cache_dir or 'off (jax_compilation_cache_dir)'}")
    print(f"  {'in memory:':<24}compiled kernels, per process (at most {ffi.KERNEL_CACHE_SIZE})")
    from jax_efc import autotune, self_check

    checked = self_check.verdicts()
    failed = [v["detail"] for v in checked if not v["passed"]]
    print(f"  {'autotuning:':<24}{autotune.directory()}: {len(autotune.records())} records")
    print(f"  {'first-use checks:':<24}{self_check.folder()}: {len(checked)} kernels checked, {len(failed)} failed"
          + "".join(f"\n{'':<26}failed: {d}" for d in failed))
    return 0


# jax-efc cache ------------------------------------------------------------------------------

def _add_cache(sub: Any) -> None:
    p = sub.add_parser("cache", help="the on-disk kernel cache: where it is, what it holds; clear it")
    p.add_argument("action", choices=["info", "clear"], nargs="?", default="info")
    p.set_defaults(func=_cache)


def _cache(args: argparse.Namespace) -> int:
    from jax_efc.ffi import kernel_cache

    if args.action == "clear":
        print(f"removed {kernel_cache.clear()} entries from {kernel_cache.directory()}")
        return 0
    entries, size = kernel_cache.usage()
    print(f"{kernel_cache.directory()}: {entries} entries, {size / 2**20:.1f} MiB "
          f"({'on' if kernel_cache.enabled() else 'off'}: JAX_EFC_KERNEL_CACHE)")
    return 0


# jax-efc selftest ---------------------------------------------------------------------------

def _add_selftest(sub: Any) -> None:
    p = sub.add_parser("selftest", help="check the fused GEMM's numerics on this machine against a float64 "
                       "oracle; prints a pass/fail table")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.set_defaults(func=_selftest)


def _selftest(args: argparse.Namespace) -> int:
    from jax_efc import selftest

    rows = selftest.run()
    print(f"devices: {', '.join(f'{d.platform}:{d.id} {d.device_kind}' for d in jax.devices())}; "
          f"GPU arch: {device.arch() or 'none'}")
    print(selftest.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["result"] == "PASS" for r in rows) else 1


# jax-efc tune -------------------------------------------------------------------------------

def _add_tune(sub: Any) -> None:
    p = sub.add_parser("tune", help="autotune the kernels of a list of GEMMs ahead of time (needs a GPU); the "
                       "records land in the cache that config='autotune' reads")
    p.add_argument("--shapes", nargs="+", type=bench.parse_shape, required=True, metavar="M,N,K[,L]")
    p.add_argument("--epilogues", type=bench.parse_epilogues, default=["gemm"],
                   help="comma-separated names, as for jax-efc bench (default: gemm)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    from jax_efc import autotune

    if autotune.gpu() is None:
        args.parser.error("tuning times kernels on a GPU, and JAX sees none here")
    print(f"{'epilogue':<24} {'M,N,K,L':<22} {'kept config':<36} {'candidates':>10} {'gain':>7}")
    for shape in args.shapes:
        for name in args.epilogues:
            before = autotune.records()
            problem = bench.bench_problem(name, shape, jnp.dtype(args.dtype), config="autotune")
            jax.jit(problem.ours).lower(*problem.specs)  # the plan tunes each GEMM it has no record of
            new = [r for k, r in autotune.records().items() if before.get(k) != r]
            if not new:
                print(f"{name:<24} {','.join(map(str, shape)):<22} {'(on record already)':<36}")
            for record in new:
                times = [t for _, t in record["timed"]]
                kept = bench.config_label(GemmConfig(**record["config"]))
                gain = times[0] / min(times) if record["config"] != record["timed"][0][0] else 1.0
                print(f"{name:<24} {','.join(map(str, record['mnkl'])):<22} {kept:<36} {len(times):>10} {gain:>6.3f}x")
    return 0


# entry point --------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the subcommand; returns its exit
    status. Bad arguments exit with status 2 and a usage message."""
    parser = argparse.ArgumentParser(prog="jax-efc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,bench,info,cache,selftest,tune}")
    _add_run(sub)
    _add_bench(sub)
    _add_info(sub)
    _add_cache(sub)
    _add_selftest(sub)
    _add_tune(sub)
    args = parser.parse_args(argv)
    args.parser = sub.choices[args.command]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
