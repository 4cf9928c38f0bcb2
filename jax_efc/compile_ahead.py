"""Compiling ahead: kernels built in worker processes while a program is still traced.

JAX traces a whole jitted step (its forward, then its backward) before it lowers any of it,
and each fused GEMM's abstract evaluation is the first moment its kernel is known.
:func:`speculate` (called there; on by default on a GPU) plans the call as its lowering will
and, unless the disk cache holds the kernel, hands it to a pool of worker processes that need
no GPU (:class:`_Workers`: started once, each compiling for one architecture); the lowering
waits for that build (:func:`wait_for`) and loads the kernel from the cache, so a step's
kernels compile side by side. A build that fails leaves the lowering to compile the kernel
itself. ``efc.warmup`` (``ahead_of_time``) uses the same pool.
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
from collections.abc import Sequence
from typing import Any

__all__ = ["speculate", "wait_for", "compiling_ahead", "job_key", "workers"]


def job_key(plan: Any, specs: tuple) -> tuple:
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


def speculate(avals: Sequence[Any], params: dict[str, Any], planner: Any = None) -> None:
    """Start building the kernel a fused-GEMM call with ``avals`` and ``params`` will need, as
    its lowering will plan it (``planner``: the primitive's, by default the dense one's) for the
    default device, unless it is started already. Calls whose lowering plans other shapes (a
    sharded ``jit`` on several devices, which the partitioner splits) are left to the lowering."""
    if not compiling_ahead():
        return
    import jax

    from jax_efc.plan import plan_call

    if jax.device_count() > 1 and not params.get("local"):
        return
    plan = (planner or plan_call)(avals, params, devices=None if jax.default_backend() == "gpu" else ())
    if plan.backend != "kernel":
        return
    specs = tuple((tuple(a.shape), str(a.dtype)) for a in avals)
    key = job_key(plan, specs)
    with _started_lock:
        if key in _started or key in _cached:
            return
    from jax_efc import ffi

    if ffi.in_cache(plan, avals):  # a worker's interpreter costs seconds to start: not for a hit
        _cached.add(key)
        return
    with _started_lock:
        if key not in _started:
            _started[key] = workers(None).submit(specs, plan)


def wait_for(plan: Any, args: Sequence[Any]) -> None:
    """Wait for the build :func:`speculate` started for a call planned as ``plan`` with the
    inputs ``args`` (arrays or tracers), if there is one; its outcome is in the cache."""
    specs = tuple((tuple(x.shape), str(x.dtype)) for x in args)
    with _started_lock:
        future = _started.get(job_key(plan, specs))
    if future is not None:
        future.result()


# seconds a worker interpreter (413 MB resident after one kernel, on the CPU machine) stays up with nothing
# to build; the next build starts a fresh one
_IDLE_S = 120.0


class _Workers:
    """Worker processes that build kernels into the disk cache, one job at a time each. A job
    is its inputs' (shape, dtype) and its plan; a worker prints ``compiled`` or ``cached`` per
    job. Each worker is a fresh interpreter (``python -m jax_efc.compile_ahead``) rather than a
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
            try:
                specs, plan, future = self.jobs.get(timeout=_IDLE_S)
            except queue.Empty:  # nothing to build for a while: give the memory back
                for proc in procs.values():
                    proc.stdin.close()
                procs.clear()
                continue
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
    return subprocess.Popen([sys.executable, "-m", "jax_efc.compile_ahead"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


_pool: _Workers | None = None
_pool_lock = threading.Lock()


def workers(processes: int | None) -> _Workers:
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
            jax.export.export(jax.jit(lambda *a: ffi.primitive_call(*a, plan=plan)), platforms=["cuda"],
                              disabled_checks=ffi.export_checks())(*avals)
            print("compiled" if ffi.store_compiled() else "cached", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the caller, the worker goes on
            first = (str(e).strip().splitlines() or [""])[0][:200]
            print(f"failed ({type(e).__name__}: {first})", flush=True)


if __name__ == "__main__":
    _worker()
