"""First-use checks: a kernel that has not yet run on a GPU of its kind checks itself there.

What a policy marks unverified (``ArchPolicy.unverified_reason``: an architecture no GPU of which
has run the test suite, an input or accumulator type, epilogue reductions) is checked the first
time a process plans it on a GPU of that architecture. A checking process (``python -m
jax_efc.checking``, a fresh interpreter on the same GPU, as autotuning's) builds the same
kernel configuration (epilogue, dtypes, majors, tile, cluster) for small problems whose tiles
cross every edge: a partial last tile along M, N and K, tile counts that the cluster shape does
not divide, the ring of k-tiles wrapping, the batch where the call has one, and both schedules
(whole tiles, and stream-K where the kernel splits k-iterations). It runs each on random inputs
and compares every output with XLA's reference of the same call on the CPU. The verdict is kept
on disk per GPU model and kernel, so it is taken once per machine; a kernel that fails runs on the
reference, with a warning that asks for a report.

Without a GPU of the kernel's architecture (an export from a CPU machine) nothing can be checked,
and the reference runs; ``JAX_EFC_UNVERIFIED_KERNELS=1`` runs such kernels unchecked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["refusal", "folder", "verdicts"]

_memo: dict[str, tuple[bool, str]] = {}


def folder() -> str:
    """Where the verdicts are kept."""
    from jax_efc.config import private_cache_dir

    return private_cache_dir("self_check")


def _key(plan: Any, gpu: tuple[str, int]) -> str:
    """The record of ``plan``'s kernel on ``gpu``: everything its code depends on (the problem
    with its config), what built it and the driver it runs under."""
    from jax_efc import device

    text = repr(("jax_efc self-check v1", gpu, plan.problem.compile_key, device.build_versions(),
                 device.driver_version()))
    return hashlib.sha256(text.encode()).hexdigest()


def refusal(plan: Any, avals: Sequence[Any], params: dict[str, Any], devices: Any) -> str | None:
    """Why the kernel of ``plan`` (a kernel's plan) does not run, where its architecture or
    features have not run on a GPU of their kind: it failed its check on this GPU (taken now, or
    found taken in an earlier process), or there is no GPU here to check it on. ``None``: it runs
    (checked, verified, or ``JAX_EFC_UNVERIFIED_KERNELS=1``)."""
    from jax_efc import device
    from jax_efc.kernels import policy
    from jax_efc.kernels.policy import unverified_allowed

    what = None if unverified_allowed() else policy(plan.arch).unverified_reason(plan.problem)
    if what is None:
        return None
    gpu = device.gpu_model()
    if gpu is None or devices == () or device.gpu_arch() != plan.arch:
        return (f"not yet run on a GPU of its kind: {what}; there is no {plan.arch} GPU here to check it on "
                "first use, so XLA runs the call (JAX_EFC_UNVERIFIED_KERNELS=1 runs it unchecked).")
    passed, detail = _verdict(plan, avals, params, gpu)
    if passed:
        return None
    return (f"failed its first-use check on this {gpu[0]}: {what} ({detail}); XLA runs the call. Please "
            "report it, with the output of `jax-efc info`.")


def _verdict(plan: Any, avals: Sequence[Any], params: dict[str, Any], gpu: tuple[str, int]) -> tuple[bool, str]:
    """(passed, what failed) for ``plan``'s kernel on ``gpu``: remembered, read from disk, or
    found by a checking process. A process that does not finish (a crash, no memory) fails the
    kernel for this process only; only a finished comparison is kept."""
    from jax_efc import device
    from jax_efc.config import read_record

    key = _key(plan, gpu)
    if key not in _memo:
        record = read_record(folder(), key)
        if record is None or not isinstance(record.get("passed"), bool):
            # the job pins the config the plan chose (the heuristic's, a pinned or a tuned one),
            # and says whether the call is a grouped GEMM's, and of which kind
            job = dict(params, config=plan.problem.config, groups=plan.problem.groups,
                       ragged_k=plan.problem.ragged_k)
            ran, last = device.run_on_gpu("jax_efc.checking", avals, job,
                                          JAX_EFC_UNVERIFIED_KERNELS="1", JAX_EFC_SELF_CHECK_KEY=key)
            record = read_record(folder(), key) if ran else {"passed": False, "detail": f"the check stopped: {last}"}
        _memo[key] = (bool(record.get("passed")), str(record.get("detail", "")))
    return _memo[key]


def verdicts() -> list[dict[str, Any]]:
    """Every verdict kept on disk (``passed`` and ``detail`` each)."""
    import os

    from jax_efc.config import read_record

    found = []
    for name in sorted(os.listdir(folder())):
        record = read_record(folder(), name[:-len(".json")]) if name.endswith(".json") else None
        if record is not None and isinstance(record.get("passed"), bool):
            found.append(record)
    return found

