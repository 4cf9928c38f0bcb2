"""Building a program's kernels ahead of time, several at once, into the on-disk kernel cache.

A lowering compiles each new kernel in turn, when it reaches its call. Two ways to build them
in parallel instead, both in worker processes that need no GPU (:class:`_Workers`: started
once, each compiling for one architecture):

- :func:`warmup` plans every fused GEMM of a program as its lowering would and builds the
  kernels the cache lacks; the program's own lowering then finds them all there.
- Compiling ahead (:func:`speculate`, on by default on a GPU): each fused GEMM bound while JAX
  traces a program (its forward, then its backward) starts its kernel's build there and
  then; when the lowering reaches the call it waits for that build (:func:`wait_for`) and
  loads it from the cache. A build that fails leaves the lowering to compile it itself.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

__all__ = ["warmup", "speculate", "wait_for", "compiling_ahead"]


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
    futures = {key: _workers(processes).submit(*job) for key, job in jobs.items()}
    for key, future in futures.items():
        lines[first[key]] = future.result()
    return lines


def _job_key(plan: Any, specs: tuple) -> tuple:
    return (plan.problem.compile_key, plan.schedule, specs)


def compiling_ahead() -> bool:
    """Whether fused GEMMs start their kernels' builds while a program is traced:
    ``JAX_EFC_COMPILE_AHEAD`` (``1`` / ``0``), by default where JAX's backend is a GPU (where
    the lowering would compile them) and the kernel cache is on (the builds land there)."""
    import jax

    from jax_efc.ffi import kernel_cache

    value = os.environ.get("JAX_EFC_COMPILE_AHEAD", "").strip().lower()
    if value in ("0", "false", "no", "off") or not kernel_cache.enabled():
        return False
    return value in ("1", "true", "yes", "on") or jax.default_backend() == "gpu"


_started: dict[tuple, concurrent.futures.Future] = {}
_cached: set[tuple] = set()  # keys found in the cache when their call was traced
_started_lock = threading.Lock()


def speculate(avals: Sequence[Any], params: dict[str, Any]) -> None:
    """Start building the kernel a fused-GEMM call with ``avals`` and ``params`` will need, as
    its lowering will plan it for the default device, unless it is started already. Calls
    whose lowering plans other shapes (a sharded ``jit`` on several devices, which the
    partitioner splits) are left to the lowering."""
    if not compiling_ahead():
        return
    import jax

    from jax_efc.plan import plan_call

    if jax.device_count() > 1 and not params.get("local"):
        return
    plan = plan_call(avals, params, devices=None if jax.default_backend() == "gpu" else ())
    if plan.backend != "kernel":
        return
    specs = tuple((tuple(a.shape), str(a.dtype)) for a in avals)
    key = _job_key(plan, specs)
    with _started_lock:
        if key in _started or key in _cached:
            return
    from jax_efc import ffi

    if ffi.in_cache(plan, avals):  # a worker's interpreter costs seconds to start: not for a hit
        _cached.add(key)
        return
    with _started_lock:
        if key not in _started:
            _started[key] = _workers(None).submit(specs, plan)


def wait_for(plan: Any, args: Sequence[Any]) -> None:
    """Wait for the build :func:`speculate` started for a call planned as ``plan`` with the
    inputs ``args`` (arrays or tracers), if there is one; its outcome is in the cache."""
    specs = tuple((tuple(x.shape), str(x.dtype)) for x in args)
    with _started_lock:
        future = _started.get(_job_key(plan, specs))
    if future is not None:
        future.result()


class _Workers:
    """Worker processes that build kernels into the disk cache, one job at a time each. A job
    is its inputs' (shape, dtype) and its plan; a worker prints ``compiled`` or ``cached`` per
    job. Each worker is a fresh interpreter (``python -m jax_efc.ahead_of_time``) rather than a
    multiprocessing child, which would import the user's main module again."""

    def __init__(self) -> None:
        self.processes = 0
        self.jobs: queue.Queue = queue.Queue()

    def grow(self, processes: int) -> None:
        """At least ``processes`` workers (each started when its thread takes a first job)."""
        for _ in range(self.processes, processes):
            threading.Thread(target=self._serve, daemon=True).start()
        self.processes = max(self.processes, processes)

    def submit(self, specs: tuple, plan: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((specs, plan, future))
        return future

    def _serve(self) -> None:
        procs: dict[str, subprocess.Popen] = {}  # one interpreter per architecture built for
        while True:
            specs, plan, future = self.jobs.get()
            try:
                proc = procs.get(plan.arch)
                if proc is None or proc.poll() is not None:
                    proc = procs[plan.arch] = _spawn(plan.arch)
                proc.stdin.write(base64.b64encode(pickle.dumps((specs, plan))).decode() + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline().strip()
                future.set_result(line or f"failed (worker exited with {proc.wait()})")
            except Exception as e:  # noqa: BLE001 - the lowering compiles it itself instead
                future.set_result(f"failed ({type(e).__name__}: {str(e)[:200]})")


def _spawn(arch: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env.update(JAX_PLATFORMS="cpu", JAX_EFC_KERNEL_CACHE="1", JAX_EFC_COMPILE_AHEAD="0",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", CUTE_DSL_ARCH=arch)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "jax_efc.ahead_of_time"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


_pool: _Workers | None = None
_pool_lock = threading.Lock()


def _workers(processes: int | None) -> _Workers:
    """The process's worker pool (``processes`` workers, default: the CPU count, at most 8),
    started at first use; a larger count asked for later adds workers."""
    global _pool
    want = processes or min(os.cpu_count() or 1, 8)
    with _pool_lock:
        _pool = _pool or _Workers()
        _pool.grow(want)
        return _pool


def _worker() -> None:
    """A worker process: build each job read from stdin; print one word per job."""
    import jax

    from jax_efc import ffi

    for line in sys.stdin:
        specs, plan = pickle.loads(base64.b64decode(line))
        try:
            avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
            jax.export.export(jax.jit(lambda *a: ffi.fused_gemm(*a, plan=plan)), platforms=["cuda"],
                              disabled_checks=ffi.export_checks())(*avals)
            print("compiled" if ffi.store_compiled() else "cached", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the caller, the worker goes on
            first = (str(e).strip().splitlines() or [""])[0][:200]
            print(f"failed ({type(e).__name__}: {first})", flush=True)


if __name__ == "__main__":
    _worker()
