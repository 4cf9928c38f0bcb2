"""Building a program's kernels ahead of time, several at once, into the on-disk kernel cache.

A lowering compiles each new kernel in turn, when it reaches its call. :func:`warmup` plans
every fused GEMM of a program as its lowering would, and compiles the kernels not yet in the
cache in parallel worker processes that need no GPU (each compiles for the plan's
architecture); the program's own lowering then finds them all in the cache.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

__all__ = ["warmup"]


def warmup(fn: Callable[..., Any], *args: Any, processes: int | None = None, **kwargs: Any) -> list[str]:
    """Compile every kernel ``fn(*args, **kwargs)`` runs into the on-disk kernel cache, at most
    ``processes`` at a time (default: the CPU count, at most 8), and return one line per
    fused GEMM: ``"compiled"``, ``"cached"`` (already there), ``"same kernel as #i"`` or
    ``"reference: <why>"``. ``args`` may be arrays or ``jax.ShapeDtypeStruct``s.

    Kernels are planned as the lowering plans them: for this process's GPU, or, on a machine
    without one, for :func:`jax_efc.set_target_arch`'s architecture as an export is. Calls
    the partitioner splits across devices (a sharded ``jit``) are planned at their global
    shapes, which the devices' kernels do not have; inside ``jax.shard_map`` the local shapes
    are planned. Needs the kernel cache (``JAX_EFC_KERNEL_CACHE``, on by default).

    >>> import jax, jax.numpy as jnp, jax_efc as efc
    >>> spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    >>> efc.warmup(lambda a, b: efc.gemm(a, b, jax.nn.relu), spec, spec)  # on a CPU machine
    Traceback (most recent call last):
    ...
    RuntimeError: warmup on a machine without a GPU builds for a target architecture: call jax_efc.set_target_arch('sm_90a') first.
    """
    import jax

    from jax_efc import device
    from jax_efc.ffi import kernel_cache
    from jax_efc.plan import plan_call
    from jax_efc.primitive import fused_gemm_eqns

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and device.arch() is None:
        raise RuntimeError("warmup on a machine without a GPU builds for a target architecture: call "
                           "jax_efc.set_target_arch('sm_90a') first.")
    if not kernel_cache.enabled():
        raise RuntimeError("warmup fills the on-disk kernel cache, which JAX_EFC_KERNEL_CACHE=0 turns off.")
    lines: list[str] = []
    jobs: dict[tuple, list] = {}  # kernel -> (specs, plan), in the order first met
    first: dict[tuple, int] = {}
    for i, eqn in enumerate(fused_gemm_eqns(jax.make_jaxpr(partial(fn, **kwargs))(*args))):
        avals = [v.aval for v in eqn.invars]
        plan = plan_call(avals, eqn.params, devices=None if on_gpu else ())
        if plan.backend != "kernel":
            lines.append(f"reference: {plan.reason}")
            continue
        specs = tuple((tuple(a.shape), str(a.dtype)) for a in avals)
        key = (plan.problem.compile_key, plan.schedule, specs)
        if key in first:
            lines.append(f"same kernel as #{first[key]}")
            continue
        first[key] = i
        jobs[key] = [specs, plan]
        lines.append("")
    if jobs:
        outcome = _build_all(list(jobs.values()), processes or min(os.cpu_count() or 1, 8))
        for key, result in zip(jobs, outcome):
            lines[first[key]] = result
    return lines


def _build_all(jobs: list, processes: int) -> list[str]:
    """Each job's outcome, the jobs dealt round-robin to ``processes`` workers."""
    groups = [list(range(w, len(jobs), processes)) for w in range(min(processes, len(jobs)))]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env.update(JAX_PLATFORMS="cpu", JAX_EFC_KERNEL_CACHE="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    results = [""] * len(jobs)
    with tempfile.TemporaryDirectory(prefix="jax_efc-warmup-") as tmp:
        def work(w: int, indices: list[int]) -> None:
            path = os.path.join(tmp, f"{w}.pickle")
            with open(path, "wb") as f:
                pickle.dump([jobs[i] for i in indices], f)
            arch_env = dict(env, CUTE_DSL_ARCH=jobs[indices[0]][1].arch)
            proc = subprocess.run([sys.executable, "-m", "jax_efc.ahead_of_time", path], env=arch_env,
                                  capture_output=True, text=True)
            done = proc.stdout.split() if proc.returncode == 0 else []
            for j, i in enumerate(indices):
                results[i] = done[j] if j < len(done) else \
                    f"failed ({(proc.stderr.strip().splitlines() or ['no output'])[-1][:200]})"

        with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
            for future in [pool.submit(work, w, g) for w, g in enumerate(groups)]:
                future.result()
    return results


def _worker(path: str) -> None:
    """A worker process: build each job of the pickle at ``path``; print one word per job."""
    import jax

    from jax_efc import ffi

    with open(path, "rb") as f:
        jobs = pickle.load(f)
    for specs, plan in jobs:
        avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
        jax.export.export(jax.jit(lambda *a: ffi.fused_gemm(*a, plan=plan)), platforms=["cuda"],
                          disabled_checks=ffi.export_checks())(*avals)
        print("compiled" if ffi.store_compiled() else "cached", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
