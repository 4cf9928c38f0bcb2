"""The grouped-GEMM primitive: abstract evaluation, lowerings, differentiation and batching, side
by side (as ``primitive.py`` holds the dense one's).

``grouped_gemm_p`` computes ``epilogue(ragged_dot(lhs, op(rhs), group_sizes), *operands)``:
``lhs`` (T, K) rows sorted by group, ``rhs`` (G, K, N) (``transpose_b``: (G, N, K), each group's
matrix read transposed), ``group_sizes`` (G,) int32, the operands in canonical shapes for a (T, N)
tile, and per-group operands (rows of N, one per group) as (G + 1, 1, N), their last row (for
the rows past the groups) zero. A call is first partitioned across devices by rows and columns
(``sharding.lower_grouped_partitioned``); each device's shard lowers to the XLA reference, and
on CUDA to the grouped kernel where one fits (``plan.plan_grouped_call``), else falls back with
its reason.

``grouped_contraction_p`` is its weight gradient's GEMM: ``a`` (T, M) and ``b`` (T, N), their
rows in the same groups, make (G, M, N), group g's product ``a[rows_g].T @ b[rows_g]`` (rows
past the groups in none). It is partitioned by M, N and rows (partial products summed), and
lowered as the grouped GEMM is (``plan.plan_contraction_call``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax._src import dispatch
from jax.interpreters import ad, batching, mlir

from . import compile_ahead
from .arguments import reference_precision
from .epilogue import evaluate, identity_ir, with_acc_output
from .plan import plan_contraction_call, plan_grouped_call
from .primitive import PLANNERS, match_varying, output_avals, register_lowerings
from .sharding import lower_contraction_partitioned, lower_grouped_partitioned

__all__ = ["grouped_gemm_p", "grouped_gemm_reference", "grouped_contraction_p", "grouped_contraction_reference",
           "per_row", "row_groups"]

grouped_gemm_p = jex.core.Primitive("efc_grouped_gemm")
grouped_gemm_p.multiple_results = True


def row_groups(group_sizes: Any, rows: int) -> Any:
    """Each of ``rows`` rows' group: g for the rows of group g, G for the rows past the groups."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def per_row(operands: Any, group_sizes: Any, rows: int) -> list[Any]:
    """The operands as the epilogue reads them: each per-group one, (G + 1, 1, N), as the (T, N)
    tile of each row's group's row."""
    group = row_groups(group_sizes, rows)
    return [x[group][:, 0, :] if jnp.ndim(x) == 3 else x for x in operands]


def grouped_gemm_reference(lhs, rhs, group_sizes, *operands, ir, transpose_b, acc_dtype, precision, config):
    """XLA's ``ragged_dot``, then the epilogue."""
    del config
    acc = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_b else rhs, group_sizes,
                             precision=reference_precision(precision, lhs.dtype), preferred_element_type=acc_dtype)
    return evaluate(ir, acc, per_row(operands, group_sizes, lhs.shape[0]))


def _abstract_eval(lhs, rhs, group_sizes, *operands, ir, transpose_b, **params):
    compile_ahead.speculate([lhs, rhs, group_sizes, *operands], dict(params, ir=ir, transpose_b=transpose_b),
                            planner=plan_grouped_call)
    n = rhs.shape[1] if transpose_b else rhs.shape[2]
    return output_avals(ir, (lhs.shape[0], n), lhs, rhs, False, transpose_b)


grouped_gemm_p.def_abstract_eval(_abstract_eval)
grouped_gemm_p.def_impl(partial(dispatch.apply_primitive, grouped_gemm_p))
dispatch.prim_requires_devices_during_lowering.add(grouped_gemm_p)  # (the partitioner's mesh)
PLANNERS[grouped_gemm_p] = plan_grouped_call

register_lowerings(grouped_gemm_p, lower_grouped_partitioned,
                   mlir.lower_fun(grouped_gemm_reference, multiple_results=True))


# Differentiation: the JVP of any epilogue from the accumulator's tangent, two plain grouped
# GEMMs; those transpose to the lhs's cotangent, the grouped GEMM of the product's cotangent with
# each group's matrix transposed (the kernel), and the rhs's, a GEMM over each group's rows
# (``ragged_dot``'s own transpose, in XLA).

def _jvp_rule(primals, tangents, *, ir, **params):
    lhs, rhs, group_sizes, *operands = primals
    t_lhs, t_rhs, _, *t_ops = tangents
    epi = ir.epi_dtype
    outs = grouped_gemm_p.bind(*match_varying((lhs, rhs, group_sizes, *operands)), ir=with_acc_output(ir, epi),
                               **params)
    outs, acc = outs[:-1], outs[-1]
    plain = dict(params, ir=identity_ir(epi, epi))
    terms = [grouped_gemm_p.bind(*match_varying((x, y, group_sizes)), **plain)[0]
             for x, y, t in ((t_lhs, rhs, t_lhs), (lhs, t_rhs, t_rhs)) if type(t) is not ad.Zero]
    t_acc = sum(terms[1:], terms[0]) if terms else jnp.zeros_like(acc)
    t_ops = [jnp.zeros(x.shape, x.dtype) if type(t) is ad.Zero else t for x, t in zip(operands, t_ops)]

    def epilogue(acc, *ops):
        return evaluate(ir, acc, per_row(ops, group_sizes, lhs.shape[0]))

    _, t_outs = jax.jvp(epilogue, (acc, *operands), (t_acc, *t_ops))
    return outs, list(t_outs)


def _transpose_rule(cts, lhs, rhs, group_sizes, *operands, ir, transpose_b, acc_dtype, precision, config, local):
    if operands or ir.instrs or len(ir.outputs) != 1 or ir.outputs[0].value != 0:
        raise NotImplementedError("jax_efc: only a plain grouped GEMM is linear, and transposable.")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, None]
    d_lhs = d_rhs = None
    if ad.is_undefined_primal(lhs):
        d_lhs = grouped_gemm_p.bind(*match_varying((ct.astype(rhs.dtype), rhs, group_sizes)),
                                    ir=identity_ir(lhs.aval.dtype, ir.epi_dtype), transpose_b=not transpose_b,
                                    acc_dtype=acc_dtype, precision=precision, config=config, local=local)[0]
    if ad.is_undefined_primal(rhs):
        # each group's rows of lhs, transposed, times the cotangent's ((G, N, K): the other way
        # round); the heuristic's tiles (a pinned config is the product's, not this GEMM's)
        c = ct.astype(lhs.dtype)
        a, b = (c, lhs) if transpose_b else (lhs, c)
        d_rhs = grouped_contraction_p.bind(*match_varying((a, b, group_sizes)),
                                           ir=identity_ir(rhs.aval.dtype, ir.epi_dtype), acc_dtype=acc_dtype,
                                           precision=precision, config=None, local=local)[0]
    return [d_lhs, d_rhs, None]


ad.primitive_jvps[grouped_gemm_p] = _jvp_rule
ad.primitive_transposes[grouped_gemm_p] = _transpose_rule


def _batched_reference(reference):
    """A batching rule: ``reference`` under ``vmap`` (``ragged_dot``'s batching: every array
    mapped, or broadcast)."""
    def rule(args, dims, **params):
        del params["local"]
        outs = jax.vmap(partial(reference, **params), in_axes=tuple(dims))(*args)
        return outs, [0] * len(outs)

    return rule


batching.primitive_batchers[grouped_gemm_p] = _batched_reference(grouped_gemm_reference)


# The weight gradient's GEMM ------------------------------------------------------------------

grouped_contraction_p = jex.core.Primitive("efc_grouped_contraction")
grouped_contraction_p.multiple_results = True

_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def grouped_contraction_reference(a, b, group_sizes, *, ir, acc_dtype, precision, config):
    """XLA's ``ragged_dot_general`` over each group's rows, converted to the output's dtype."""
    del config
    out = jax.lax.ragged_dot_general(a, b.astype(a.dtype), group_sizes, _CONTRACT_ROWS,
                                     precision=reference_precision(precision, a.dtype),
                                     preferred_element_type=acc_dtype)
    return [out.astype(ir.outputs[0].dtype)]


def _contraction_abstract_eval(a, b, group_sizes, *, ir, **params):
    compile_ahead.speculate([a, b, group_sizes], dict(params, ir=ir), planner=plan_contraction_call)
    (out,) = output_avals(ir, (a.shape[1], b.shape[1]), a, b, True, False)
    sharding = getattr(out, "sharding", None)
    lead = {} if sharding is None else {"sharding": sharding.update(spec=(None, *sharding.spec))}
    return [out.update(shape=(group_sizes.shape[0], *out.shape), **lead)]


grouped_contraction_p.def_abstract_eval(_contraction_abstract_eval)
grouped_contraction_p.def_impl(partial(dispatch.apply_primitive, grouped_contraction_p))
dispatch.prim_requires_devices_during_lowering.add(grouped_contraction_p)
PLANNERS[grouped_contraction_p] = plan_contraction_call

register_lowerings(grouped_contraction_p, lower_contraction_partitioned,
                   mlir.lower_fun(grouped_contraction_reference, multiple_results=True))


def _contraction_jvp(primals, tangents, **params):
    a, b, group_sizes = primals
    t_a, t_b, _ = tangents
    out = grouped_contraction_p.bind(*match_varying(primals), **params)
    terms = [grouped_contraction_p.bind(*match_varying((x, y, group_sizes)), **params)[0]
             for x, y, t in ((t_a, b, t_a), (a, t_b, t_b)) if type(t) is not ad.Zero]
    return out, [sum(terms[1:], terms[0]) if terms else jnp.zeros_like(out[0])]


def _contraction_transpose(cts, a, b, group_sizes, *, ir, acc_dtype, precision, config, local):
    """Row t of the cotangent of ``a`` is ``b[t] @ ct[g].T``, of ``b`` ``a[t] @ ct[g]``, for t's
    group g (0 past the groups): grouped GEMMs of the kernel's."""
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, None]

    def grouped(x, out, transpose_b):
        return grouped_gemm_p.bind(*match_varying((x, ct.astype(x.dtype), group_sizes)),
                                   ir=identity_ir(out.aval.dtype, ir.epi_dtype), transpose_b=transpose_b,
                                   acc_dtype=acc_dtype, precision=precision, config=config, local=local)[0]

    d_a = grouped(b, a, True) if ad.is_undefined_primal(a) else None
    d_b = grouped(a, b, False) if ad.is_undefined_primal(b) else None
    return [d_a, d_b, None]


ad.primitive_jvps[grouped_contraction_p] = _contraction_jvp
ad.primitive_transposes[grouped_contraction_p] = _contraction_transpose


batching.primitive_batchers[grouped_contraction_p] = _batched_reference(grouped_contraction_reference)
