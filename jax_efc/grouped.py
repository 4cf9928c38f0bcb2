"""``grouped_gemm``: a grouped (ragged) GEMM with a fused epilogue, ``jax.lax.ragged_dot``'s
meaning, for Mixture-of-Experts layers. On Hopper it runs the grouped kernel where one fits
(``grouped_primitive.py``); elsewhere, and for what the kernel does not run, the XLA reference
(``ragged_dot``, then the epilogue in XLA)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import arguments
from .epilogue import restructure, split_at_reductions
from .config import GemmConfig
from .grouped_primitive import grouped_gemm_p, per_row
from .ops import prepare_epilogue
from .primitive import match_varying

__all__ = ["grouped_gemm"]


def grouped_gemm(lhs: Any, rhs: Any, group_sizes: Any, epilogue: Callable[..., Any] | None = None,
                 *operands: Any, group_operands: Sequence[Any] = (), out_dtypes: Any = None,
                 acc_dtype: Any = None, epi_dtype: Any = None, precision: Any = None,
                 config: GemmConfig | None = None, **scalars: Any) -> Any:
    """``epilogue(ragged_dot(lhs, rhs, group_sizes), *operands, *per_token, **scalars)``.

    ``lhs`` is (T, K) with its rows sorted by group, ``rhs`` (G, K, N) one matrix per group,
    ``group_sizes`` (G,) integers (traced: routing that changes does not recompile); row t of
    the product is ``lhs[t] @ rhs[g]`` for the group g it falls in, and rows past
    ``sum(group_sizes)`` belong to no group: their product is 0 (a negative size counts as 0).
    ``operands`` take the roles of ``efc.gemm``'s for a (T, N) accumulator (tiles (T, N), rows
    (N,), columns (T, 1), scalars); each of ``group_operands`` is (G, N), one row per group (a
    per-expert bias), and reaches the epilogue as the (T, N) tile of each row's group's row (0
    past the groups). Differentiable in ``lhs``, ``rhs``, the operands and dynamic scalars (on
    Hopper the forward and the lhs gradient run the grouped kernel, the rhs gradient its kernel
    over groups of the contraction, with the heuristic's tiles); under ``vmap`` (the
    reference) every one of ``lhs``, ``rhs`` and ``group_sizes`` must be mapped (``ragged_dot``'s
    rule); under ``jit`` over several devices it is partitioned by rows and by N. ``config``
    pins the kernel's tiles, as ``efc.gemm``'s does.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> x, w = jnp.ones((5, 4)), jnp.stack([jnp.eye(4), 2 * jnp.eye(4)])
    >>> bias = jnp.array([[0.0] * 4, [10.0] * 4])
    >>> efc.grouped_gemm(x, w, jnp.array([2, 3]), lambda acc, b: acc + b, group_operands=[bias])[:, 0]
    Array([ 1.,  1., 12., 12., 12.], dtype=float32)
    """
    lhs, rhs = arguments.array("lhs", lhs), arguments.array("rhs", rhs)
    group_sizes = arguments.array("group_sizes", group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"lhs must be (T, K) and rhs (G, K, N); got {lhs.shape} and {rhs.shape}.")
    (t, k), (g, k_rhs, n) = lhs.shape, rhs.shape
    if k != k_rhs:
        raise ValueError(f"lhs has K={k} but rhs has K={k_rhs}.")
    if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be ({g},) integers, one per group of rhs; got "
                         f"{group_sizes.dtype}{group_sizes.shape}.")
    arguments.inputs("grouped_gemm", "lhs", lhs, "rhs", rhs)
    acc_dtype = arguments.acc_dtype(acc_dtype, lhs.dtype)
    epi_dtype = arguments.dtype("epi_dtype", epi_dtype or jnp.promote_types(acc_dtype, jnp.float32),
                                floating=True)
    precision = arguments.precision(precision)
    arguments.check_config(config)
    per_group = [arguments.array(f"group operand {i}", x) for i, x in enumerate(group_operands)]
    for i, x in enumerate(per_group):
        if x.shape != (g, n):
            raise ValueError(f"group operand {i} must be ({g}, {n}): one row of N per group; got {x.shape}.")
    # traced as rows of N; the kernel reads each tile's group's row (the last one, zero, past the groups)
    ir, structure, arrays = prepare_epilogue(epilogue, (t, n), [*operands, *(x[0] for x in per_group)], scalars,
                                             arguments.out_dtypes(out_dtypes),
                                             arguments.default_out_dtype(lhs.dtype, acc_dtype), acc_dtype, epi_dtype)
    first = len(operands)
    arrays[first:first + len(per_group)] = [jnp.concatenate([x, jnp.zeros((1, n), x.dtype)])[:, None, :]
                                            for x in per_group]
    # the GEMM computes up to the reductions and the reductions themselves; XLA what follows them
    split = split_at_reductions(ir)
    # a negative size counts as 0, on every backend (ragged_dot leaves it undefined)
    group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    outs = grouped_gemm_p.bind(*match_varying((lhs, rhs, group_sizes, *arrays)), ir=split.gemm, transpose_b=False,
                               acc_dtype=np.dtype(acc_dtype), precision=precision, config=config, local=False)
    return restructure(structure, ir, split.finish(ir, outs, per_row(arrays, group_sizes, t), (t, n)))
