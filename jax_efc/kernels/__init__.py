"""The kernel layer: one policy (limits and heuristic, ``<arch>_policy.py``) and one kernel
class (``<arch>.py``) per architecture, registered below; the epilogue driver
(``gemm_base.py``), the IR visitor (``visitor.py``), its fragment math (``fragment_math.py``),
the persistent tile schedule (``schedule.py``) and the epilogue rewrites (``rewrite.py``) are
shared. Importing this package imports no cutlass: policies answer before anything compiles.

To add an architecture, write its policy and its kernel and add one line to
``_ARCHITECTURES``.
"""

from __future__ import annotations

import functools
import importlib

from jax_efc.kernels.policy import ArchPolicy
from jax_efc.kernels.problem import (EPI_STAGES, SMEM_ALIGN, TIMELINE_EVENTS, TIMELINE_UNITS, KernelProblem,
                                     epilogue_tile, tile_k, tile_operand_indices)

__all__ = ["ArchPolicy", "KernelProblem", "SUPPORTED_ARCHS", "policy", "no_kernel_reason", "tile_k",
           "EPI_STAGES", "SMEM_ALIGN", "TIMELINE_EVENTS", "TIMELINE_UNITS", "epilogue_tile",
           "tile_operand_indices"]

# architecture (as CUTE_DSL_ARCH names it) -> "module:POLICY" describing its kernel
_ARCHITECTURES = {
    "sm_90a": "jax_efc.kernels.sm90_policy:POLICY",
    "sm_100a": "jax_efc.kernels.sm100_policy:POLICY",
    "sm_103a": "jax_efc.kernels.sm100_policy:POLICY_SM103",
    "sm_100f": "jax_efc.kernels.sm100_policy:POLICY_FAMILY",
}
SUPPORTED_ARCHS = tuple(_ARCHITECTURES)


@functools.cache
def policy(arch: str) -> ArchPolicy | None:
    """The policy of ``arch``'s kernel, or ``None`` where jax_efc has no kernel for it."""
    where = _ARCHITECTURES.get(arch)
    if where is None:
        return None
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def no_kernel_reason(arch: str | None) -> str | None:
    """Why no kernel runs on ``arch`` (``None``: one does)."""
    if arch is None:
        return "no CUDA device and CUTE_DSL_ARCH is unset; the kernels need one of " \
               f"{SUPPORTED_ARCHS}."
    if arch not in _ARCHITECTURES:
        return (f"no jax_efc kernel for {arch}; kernels exist for {SUPPORTED_ARCHS} "
                "(set CUTE_DSL_ARCH to compile for one of them).")
    return None
