"""One fused-GEMM call, planned once: the problem it poses (shapes, dtypes, majors, operand
roles), which backend runs it and why, and for the kernel its config and persistent grid.

The CUDA lowering, :func:`jax_efc.backends` and the launch (:mod:`jax_efc.ffi`) all read the
plan :func:`plan_call` returns, so they cannot disagree; it is memoised on everything that
decides it (the call's avals and parameters, the devices, the architecture, the switches).
No cutlass import: the policies answer before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_efc import autotune, self_check
from jax_efc import config as _config
from jax_efc import device
from jax_efc.arguments import fast_accumulation, is_8bit_float, kernel_precision_reason, mixes_8bit, most_precise
from jax_efc.config import GemmConfig
from jax_efc.epilogue import EpilogueIR
from jax_efc.kernels import KernelProblem, no_kernel_reason, policy
from jax_efc.kernels.grouped_walk import tile_bound
from jax_efc.kernels.schedule import TileSchedule, plan_schedule

__all__ = ["Plan", "plan_call", "plan_grouped_call", "plan_contraction_call", "plan_kernel", "gemm_dims",
           "empty_reason", "symbolic_reason"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which backend runs a call, and how.

    ``reason`` says why the reference runs (``None`` with the kernel) and ``level`` how it is
    reported: ``logging.WARNING`` for a fallback (strict mode raises instead),
    ``logging.INFO`` for the heuristic handing a call to XLA's GEMM, 0 for nothing to report
    (an empty GEMM). With the kernel, ``problem`` holds its compile-time description (the
    config chosen), ``mnkl`` the GEMM's sizes and ``schedule`` the persistent grid;
    ``transposes`` says which of A and B the launch transposes first (stored in a major the
    MMA cannot read), and ``note`` says so (logged at INFO), as it says what autotuning changed
    in the heuristic's config."""

    backend: str  # "kernel" or "reference"
    reason: str | None = None
    level: int = 0
    arch: str | None = None
    problem: KernelProblem | None = None
    mnkl: tuple[int, int, int, int] | None = None
    schedule: TileSchedule | None = None
    transposes: tuple[bool, bool] = (False, False)
    note: str | None = None

    @property
    def config(self) -> GemmConfig | None:
        return self.problem.config if self.problem is not None else None


def _reference(reason: str, level: int = logging.WARNING, arch: str | None = None) -> Plan:
    return Plan("reference", reason, level, arch)


def _spec(x: Any) -> tuple:
    return tuple(x.shape), np.dtype(x.dtype).name


def gemm_dims(a_shape, b_shape, transpose_a: bool, transpose_b: bool, groups: int = 0,
              ragged_k: bool = False) -> tuple[int, int, int, int | None]:
    """(M, N, K, L or None) from the primitive's canonical shapes. A grouped GEMM has no L (B's
    leading axis holds the groups), unless its groups split the contraction (``ragged_k``): then
    its output has one product per group, L = ``groups``."""
    *la, a0, a1 = a_shape
    *lb, b0, b1 = b_shape
    m, k = (a1, a0) if transpose_a else (a0, a1)
    n = b0 if transpose_b else b1
    lead = la or lb
    if groups:
        return m, n, k, (groups if ragged_k else None)
    return m, n, k, (lead[0] if lead else None)


def plan_kernel(ir: EpilogueIR, a: Any, b: Any, operands: Sequence[Any], *, transpose_a: bool,
                transpose_b: bool, acc_dtype: Any, config: GemmConfig | None, arch: str | None,
                devices: Sequence[int] | None = None, precision: Any = None, sm_margin: int = 0,
                groups: int = 0, ragged_k: bool = False) -> Plan:
    """The kernel's plan for a call on ``arch``, or the reference's with the reason the kernel
    cannot run it. ``a``, ``b`` and ``operands`` are avals (``shape``/``dtype``) in the
    primitive's canonical shapes; ``devices``: the ordinals of the CUDA devices the call runs
    on (see :func:`jax_efc.device.residency`); ``precision`` as the primitive holds it (8-bit
    float inputs promote partial sums into fp32 unless it asks for fast accumulation: each k-tile's
    at ``HIGHEST``, as XLA's FP8 dot does there, else as often as the policy says);
    ``sm_margin``: the SMs the heuristic's config leaves free (a pinned config keeps its own
    ``sm_margin``); ``groups``: a grouped GEMM's group count, ``b`` then (G, K, N) or (G, N, K),
    one matrix per group (its plan's ``mnkl`` has L = 1); with ``ragged_k`` the groups split the
    contraction instead: ``a`` (T, M) and ``b`` (T, N) (``transpose_a``, not ``transpose_b``),
    the output (G, M, N) and ``mnkl`` (M, N, T, G). Raises
    ``TypeError`` when ``a`` and ``b`` differ in dtype, unless they are the two 8-bit float
    formats."""
    if np.dtype(a.dtype) != np.dtype(b.dtype) and not mixes_8bit(a.dtype, b.dtype):
        raise TypeError(f"a is {np.dtype(a.dtype).name} but b is {np.dtype(b.dtype).name}; the kernel "
                        "takes A and B of one dtype (or two 8-bit float formats): cast one of them.")
    reason = kernel_precision_reason(precision, a.dtype)
    if reason:
        return _reference(reason, arch=arch)
    # 8-bit floats: no promotion (fast accumulation), each k-tile's (1), or the policy's (None)
    promote = 0 if not is_8bit_float(a.dtype) or fast_accumulation(precision) else \
        1 if most_precise(precision) else None
    return _plan_kernel(ir, _spec(a), _spec(b), tuple(_spec(x) for x in operands), bool(transpose_a),
                        bool(transpose_b), np.dtype(acc_dtype).name, config, arch,
                        None if devices is None else tuple(devices), promote, sm_margin, groups, bool(ragged_k),
                        _switches())


def _switches() -> tuple[str, str, str]:
    """The environment the plan reads besides its arguments (the memo's key holds it): the MPS
    thread limit (residency), whether unverified kernels may run and whether the sm_100a kernel
    is on (the policies)."""
    return (os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip(),
            os.environ.get("JAX_EFC_UNVERIFIED_KERNELS", "0"), os.environ.get("JAX_EFC_SM100", ""))


@functools.lru_cache(maxsize=1024)
def _plan_kernel(ir, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch, devices, promote,
                 sm_margin, groups, ragged_k, switches) -> Plan:
    reason = no_kernel_reason(arch) or device.dsl_reason()
    if reason:
        return _reference(reason, arch=arch)
    pol = policy(arch)
    m, n, k, batch = gemm_dims(a[0], b[0], transpose_a, transpose_b, groups, ragged_k)
    mnkl = (m, n, k, batch or 1)
    promote = pol.default_promotion() if promote is None else promote
    problem = KernelProblem(
        ir=ir, ab_dtype=a[1], b_dtype=b[1], acc_dtype=acc_dtype, a_major="m" if transpose_a else "k",
        b_major="k" if transpose_b else "n", batched=batch is not None, a_batched=len(a[0]) == 3,
        b_batched=len(b[0]) == 3, operand_batched=tuple(len(x[0]) == 3 for x in operands), arch=arch,
        config=config if config is not None else GemmConfig(),
        promote=promote, groups=groups, ragged_k=ragged_k,
    )
    reason = pol.dtype_reason(problem)
    if reason:
        return _reference(reason, arch=arch)
    transposes, note = (False, False), None
    need = pol.mma_majors(problem)
    if need is not None and (problem.a_major, problem.b_major) != need:
        transposes = (problem.a_major != need[0], problem.b_major != need[1])
        moved = " and ".join(x for x, t in zip("ab", transposes) if t)
        note = (f"{moved} {'is' if sum(transposes) == 1 else 'are'} transposed once before the kernel, which reads "
                f"{problem.ab_dtype} A and B only K-major (one pass over {moved}; store them K-major to skip it)")
        problem = dataclasses.replace(problem, a_major=need[0], b_major=need[1])
    sms = device.sm_count(pol.default_sm_count)
    if config is None:
        chosen = pol.choose_config(problem, *mnkl, sm_count=max(1, sms - sm_margin))
        problem = dataclasses.replace(problem, config=dataclasses.replace(chosen, sm_margin=sm_margin))
    cfg = problem.config
    cluster_size = cfg.cluster_m * cfg.cluster_n
    if sms - cfg.sm_margin < cluster_size:
        return _reference(f"sm_margin={cfg.sm_margin} leaves fewer than a cluster's {cluster_size} of the GPU's "
                          f"{sms} SMs to the kernel.", arch=arch)
    reason = pol.unsupported_reason(problem, mnkl)
    if reason:
        return _reference(reason, arch=arch)
    clusters, resident = device.residency(cluster_size, devices, pol.assumed_max_clusters(cluster_size, sms))
    if cfg.sm_margin:  # one CTA an SM: the grid's clusters on the SMs left
        clusters = min(clusters, (sms - cfg.sm_margin) // cluster_size)
    if groups and not ragged_k:  # no more clusters than the most tiles any group sizes give
        clusters = min(clusters, tile_bound(groups, m, cfg.tile_m, -(-n // (cfg.tile_n * cfg.cluster_n))))
    # stream-K makes CTAs wait on one another: only where the whole grid is known resident (and
    # a grouped GEMM's tiles are known only to the kernel)
    split = resident and pol.splits_k(problem) and not groups
    schedule = plan_schedule(cfg if split else dataclasses.replace(cfg, stream_k=False), *mnkl, clusters,
                             problem.tile_k)
    return Plan("kernel", arch=arch, problem=problem, mnkl=mnkl, schedule=schedule, transposes=transposes, note=note)


def symbolic_reason(avals_in: Sequence[Any]) -> str | None:
    """Why no kernel runs a call with symbolic dimensions (``jax.export`` with shape
    polymorphism): its tiles and grid are fixed when it is compiled."""
    shapes = [tuple(x.shape) for x in avals_in[:2]]
    if all(isinstance(d, (int, np.integer)) for shape in shapes for d in shape):
        return None
    return (f"a and b have symbolic dimensions {shapes}; the kernel is compiled for static shapes "
            "(export with concrete M, N, K and batch sizes to run it).")


# SMs the heuristic's config leaves free where a GEMM's results feed a collective (row-parallel
# partial products summed across devices, a data-parallel step's weight gradients): NCCL's
# collectives run a CTA per channel, and the one the next GEMM would overlap waits for SMs a
# persistent grid holds to its end. On two H200s a margin of 16 left 0.64 ms of a data-parallel
# step's all-reduce exposed, against 0.88 with none (benchmarks/FINDINGS.md, "Several GPUs")
COLLECTIVE_SM_MARGIN = 16


def sm_margin(params: dict[str, Any]) -> int:
    """The SMs the heuristic's config leaves free for a call with ``params``."""
    return COLLECTIVE_SM_MARGIN if params.get("feeds_collective") else 0


def empty_reason(avals_in: Sequence[Any]) -> str | None:
    """A GEMM with a zero dimension has nothing for a kernel to compute: the reference gives
    the empty result, or (K = 0) the epilogue of a zero accumulator. Not a fallback."""
    a, b = avals_in[:2]
    if 0 in tuple(a.shape) or 0 in tuple(b.shape):
        return f"the GEMM is empty (a {tuple(a.shape)}, b {tuple(b.shape)})"
    return None


def _pinned_plan(kernel: str, ir: EpilogueIR, a: Any, b: Any, operands: Sequence[Any], pinned: GemmConfig | None,
                 **kw: Any) -> Plan:
    """:func:`plan_kernel`'s plan with the ``pinned`` config (None: the heuristic's). Raises
    ``ValueError`` where the pinned config is the only obstacle (the heuristic's would run): a
    pinned config is a request, not a hint to drop silently."""
    plan = plan_kernel(ir, a, b, operands, config=pinned, **kw)
    if plan.backend != "kernel" and pinned is not None and \
            plan_kernel(ir, a, b, operands, config=None, **kw).backend == "kernel":
        raise ValueError(f"jax_efc: the {kernel} for {kw['arch']} cannot run {pinned}: {plan.reason} "
                         "Pass config=None to let the heuristic choose.")
    return plan


def _before_planning(avals_in: Sequence[Any], devices: Sequence[int] | None) -> tuple[Plan | None, str | None]:
    """(the reference's plan, with the reason, for a call no kernel is planned for: empty or
    symbolic shapes, ``JAX_EFC_DISABLE``, no architecture; else None, and the architecture)."""
    reason = empty_reason(avals_in)
    if reason:
        return _reference(reason, level=0), None
    reason = symbolic_reason(avals_in)
    if reason:
        return _reference(reason), None
    if _config.disabled():
        return _reference("JAX_EFC_DISABLE is set."), None
    arch = device.arch()
    if arch is None:
        if devices == ():
            return _reference("exporting for CUDA without a target architecture (no GPU here): the export holds "
                              "the XLA reference; call jax_efc.set_target_arch('sm_90a') first to hold the "
                              "kernel."), None
        return _reference("no CUDA device with a supported architecture was found."), None
    return None, arch


def _checked(plan: Plan, avals_in: Sequence[Any], params: dict[str, Any], devices: Sequence[int] | None) -> Plan:
    """``plan``, or the reference's where its kernel has not run on a GPU of its kind and its
    first-use check refuses it (:mod:`jax_efc.self_check`)."""
    reason = self_check.refusal(plan, avals_in, params, devices)
    return plan if reason is None else _reference(reason, arch=plan.arch)


def plan_call(avals_in: Sequence[Any], params: dict[str, Any], devices: Sequence[int] | None = None) -> Plan:
    """The plan of one ``fused_gemm_p`` equation lowered for CUDA: its input avals and params,
    and the devices it runs on (``None``: the first; ``()``: unknown, as when exporting).

    Raises ``ValueError`` when the call pins a config that is the only obstacle (the
    heuristic's config would run): a pinned config is a request, not a hint to drop silently.
    Only the heuristic hands calls to XLA's GEMM: never with a pinned config or under
    ``JAX_EFC_STRICT=1``. ``config="autotune"`` (see :mod:`jax_efc.autotune`) starts from the
    heuristic's plan and runs the tuned config where a record or a tuning run has one. A kernel
    whose architecture or features have not yet run on a GPU of their kind checks itself first
    (:mod:`jax_efc.self_check`)."""
    refused, arch = _before_planning(avals_in, devices)
    if refused:
        return refused
    a, b, *operands = avals_in
    kw = dict(transpose_a=params["transpose_a"], transpose_b=params["transpose_b"],
              acc_dtype=params["acc_dtype"], arch=arch, devices=devices, precision=params["precision"],
              sm_margin=sm_margin(params))
    tune = autotune.requested(params["config"])
    pinned = None if tune else params["config"]
    plan = _pinned_plan("kernel", params["ir"], a, b, operands, pinned, **kw)
    if plan.backend != "kernel":
        return plan
    if pinned is None and not _config.strict():
        m, n, _, l = plan.mnkl
        pol = policy(arch)
        reason = pol.xla_faster_reason(plan.problem, m, n, l, sm_count=device.sm_count(pol.default_sm_count))
        if reason:
            return _reference(reason, level=logging.INFO, arch=arch)
    if tune:
        tuned = autotune.tuned_config(plan, avals_in, params, devices)
        if tuned is not None and tuned != plan.config:
            tuned_plan = plan_kernel(params["ir"], a, b, operands, config=tuned, **kw)
            if tuned_plan.backend == "kernel":
                changed = ", ".join(f"{f.name}={getattr(tuned, f.name)}" for f in dataclasses.fields(tuned)
                                    if getattr(tuned, f.name) != getattr(plan.config, f.name))
                tuned_note = f"autotuned to the heuristic's config but {changed}"
                plan = dataclasses.replace(tuned_plan, note="; ".join(filter(None, [tuned_plan.note, tuned_note])))
    return _checked(plan, avals_in, params, devices)


def plan_grouped_call(avals_in: Sequence[Any], params: dict[str, Any], devices: Sequence[int] | None = None) -> Plan:
    """The plan of one ``grouped_gemm_p`` equation (lhs, rhs, group sizes, operands) lowered for
    CUDA, as :func:`plan_call` plans a dense one: a pinned config the kernel cannot run raises
    ``ValueError``, and a kernel that has not run on a GPU of its kind checks itself first
    (:func:`jax_efc.checking.check_grouped_call`)."""
    return _grouped_plan("grouped kernel", avals_in, params, devices, transpose_a=False,
                         transpose_b=params["transpose_b"])


def plan_contraction_call(avals_in: Sequence[Any], params: dict[str, Any],
                          devices: Sequence[int] | None = None) -> Plan:
    """The plan of one ``grouped_contraction_p`` equation (a (T, M), b (T, N), group sizes): the
    grouped kernel over groups of the contraction, as :func:`plan_grouped_call` plans the
    grouped GEMM."""
    return _grouped_plan("grouped weight-gradient kernel", avals_in, params, devices, transpose_a=True,
                         transpose_b=False, ragged_k=True)


def _grouped_plan(kernel: str, avals_in: Sequence[Any], params: dict[str, Any], devices: Sequence[int] | None,
                  **kw: Any) -> Plan:
    refused, arch = _before_planning(avals_in, devices)
    if refused:
        return refused
    a, b, sizes, *operands = avals_in
    pinned = None if autotune.requested(params["config"]) else params["config"]
    plan = _pinned_plan(kernel, params["ir"], a, b, operands, pinned, acc_dtype=params["acc_dtype"], arch=arch,
                        devices=devices, precision=params["precision"], groups=sizes.shape[0], **kw)
    return plan if plan.backend != "kernel" else _checked(plan, avals_in, params, devices)
