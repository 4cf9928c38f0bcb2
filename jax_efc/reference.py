"""The XLA implementation of the fused GEMM: the ground truth, and the fallback."""

from __future__ import annotations

from typing import Any

from jax import lax

from .epilogue import EpilogueIR, evaluate

__all__ = ["contraction", "fused_gemm_reference"]


def contraction(a_ndim: int, transpose_a: bool, transpose_b: bool) -> lax.DotDimensionNumbers:
    """Dimension numbers of ``op(a) @ op(b)`` for a, b of rank 2, or rank 3 with a batch L first."""
    ka = a_ndim - 2 if transpose_a else a_ndim - 1
    kb = a_ndim - 1 if transpose_b else a_ndim - 2
    batch = ((0,), (0,)) if a_ndim == 3 else ((), ())
    return ((ka,), (kb,)), batch


def fused_gemm_reference(
    a: Any,
    b: Any,
    *operands: Any,
    ir: EpilogueIR,
    transpose_a: bool,
    transpose_b: bool,
    acc_dtype: Any,
    precision: Any = None,
    config: Any = None,
) -> list[Any]:
    """``epilogue(op(a) @ op(b), *operands)``: one dot in ``acc_dtype``, then the epilogue
    program in its epilogue dtype; outputs are (M, N) or (L, M, N)."""
    del config  # a kernel setting; the reference has none
    acc = lax.dot_general(
        a, b, contraction(a.ndim, transpose_a, transpose_b), precision=precision,
        preferred_element_type=acc_dtype,
    )
    return evaluate(ir, acc, operands)
