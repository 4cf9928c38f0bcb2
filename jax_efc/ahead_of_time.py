"""``efc.warmup``: a program's kernels built ahead of time, several at once, into the on-disk
kernel cache.

A lowering compiles each new kernel in turn, when it reaches its call. :func:`warmup` plans
every fused GEMM of a program as its lowering would and has the worker processes of
``compile_ahead`` build the kernels the cache lacks; the program's own lowering then finds
them all there, and a job can ship the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from .compile_ahead import job_key, workers

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
    from jax_efc.primitive import fused_gemm_eqns, plan_eqn

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
        plan = plan_eqn(eqn, devices=None if on_gpu else ())
        if plan.backend != "kernel":
            lines.append(f"reference: {plan.reason}")
            continue
        specs = tuple((tuple(a.shape), str(a.dtype)) for a in avals)
        key = job_key(plan, specs)
        if key in first:
            lines.append(f"same kernel as #{first[key]}")
            continue
        first[key] = i
        jobs[key] = [specs, plan]
        lines.append("")
    futures = {key: workers(processes).submit(*job) for key, job in jobs.items()}
    for key, future in futures.items():
        lines[first[key]] = future.result()
    return lines
