"""The XLA implementation of the fused GEMM: the ground truth, and the fallback."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from . import arguments
from .epilogue import EpilogueIR, evaluate_product

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
    feeds_collective: bool = False,
) -> list[Any]:
    """``epilogue(op(a) @ op(b), *operands)``: one dot in ``acc_dtype``, then the epilogue
    program in its epilogue dtype; outputs are (M, N) or (L, M, N), transposed ones (N, M) /
    (L, N, M)."""
    del config, feeds_collective  # kernel settings; the reference has none
    m_axis = a.ndim - 1 if transpose_a else a.ndim - 2
    one_row = a.shape[m_axis] == 1
    if one_row:
        # On the H200, XLA's dot of one row with fp32 output ran up to 1.3x slower than its dot
        # of two; a zero second row, sliced off the product, costs little on any platform
        pad = [(0, 0, 0)] * a.ndim
        pad[m_axis] = (0, 1, 0)
        a = lax.pad(a, np.zeros((), a.dtype), pad)
    acc = lax.dot_general(
        a, b, contraction(a.ndim, transpose_a, transpose_b),
        precision=arguments.reference_precision(precision, a.dtype),
        preferred_element_type=acc_dtype,
    )
    if one_row:
        acc = lax.slice_in_dim(acc, 0, 1, axis=acc.ndim - 2)
    return evaluate_product(ir, acc, operands)
