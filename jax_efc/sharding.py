"""How the fused GEMM is partitioned across devices: like a dot, never by replicating.

The primitive lowers through ``jax.experimental.custom_partitioning`` with a Shardy rule
(``[l] m k, [l] k n, <operands> -> [l] m n``, ``[l] n m`` for an output stored transposed)
and a partition function:

- batch L / M sharded (data parallel): each device runs its rows, no communication;
- N sharded (column-parallel): each device runs its columns with its slice of the weight and
  of every row vector and tile operand (a gated GEMM's weight only where each slice holds
  whole gate and up block pairs, and not where the program consumes a reduction over N, which
  must see whole rows; else it is gathered along N);
- K sharded on both ``a`` and ``b`` (row-parallel): each device computes a partial product,
  the partials are summed with ``psum`` and only then is the epilogue applied, in XLA,
  because a nonlinear epilogue cannot run on partial sums. The partial products' GEMM leaves
  SMs to the collectives that run beside it (``plan.COLLECTIVE_SM_MARGIN``). The partials travel in the
  outputs' dtype where they all share one 16-bit float, as XLA sums a dot's partial
  products in the dot's output dtype (bf16 outputs: half the bytes of fp32); otherwise in
  the accumulator's;
- K sharded on one side only: that operand is gathered along K (the least communication
  that gives the right answer); shardings that conflict (one mesh axis on two dimensions)
  keep the first and replicate the other.

An output that reduces over M or N while that dimension is sharded is completed across the
devices (``psum`` for a sum, computed and sent in float32, or int32, and rounded once at the
end; ``pmax`` / ``pmin``), and is replicated along the axes it reduced.

The grouped GEMM is partitioned by rows and columns only, its weight gradient's GEMM also by
the rows it contracts (their rules are at the end).

Under ``shard_map`` (all axes manual) and on one device the call is not partitioned at all.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from .epilogue import EpilogueIR, Role, evaluate_product, identity_ir, store_as

__all__ = ["lower_partitioned", "lower_grouped_partitioned", "lower_contraction_partitioned", "local_group_sizes"]


def lower_partitioned(ctx: Any, primitive: Any, *args: Any, **params: Any) -> Any:
    """The lowering of ``primitive`` (the fused GEMM's) before partitioning: hand the call to
    the partitioner, which binds ``primitive`` again on each device's shard with ``local=True``."""
    key = (primitive, tuple(sorted(params.items())))
    a, b, *ops = args
    return mlir.lower_fun(
        lambda a, b, *ops: _partitioned(key, a, b, tuple(ops)), multiple_results=True
    )(ctx, a, b, *ops)


def _local(primitive: Any, params: dict[str, Any], a: Any, b: Any, ops: tuple[Any, ...]) -> list[Any]:
    return primitive.bind(a, b, *ops, local=True, **params)


@partial(custom_partitioning, static_argnums=(0,))
def _partitioned(key, a, b, ops):
    return _local(key[0], dict(key[1]), a, b, ops)


@dataclasses.dataclass(frozen=True)
class _Plan:
    l: Any  # mesh axes of each logical dimension (None: replicated)
    m: Any
    n: Any
    k: Any

    def a(self, ndim: int, transpose: bool) -> P:
        core = (self.k, self.m) if transpose else (self.m, self.k)
        return P(*((self.l,) if ndim == 3 else ()), *core)

    def b(self, ndim: int, transpose: bool) -> P:
        core = (self.n, self.k) if transpose else (self.k, self.n)
        return P(*((self.l,) if ndim == 3 else ()), *core)

    def operand(self, role: Role, ndim: int) -> P:
        if ndim == 0:
            return P()
        core = {Role.TILE: (self.m, self.n), Role.ROW: (None, self.n),
                Role.COL: (self.m, None), Role.SCALAR: (None, None)}[role]
        return P(*((self.l,) if ndim == 3 else ()), *core)

    def out(self, ndim: int, over: tuple[str, ...] = (), transposed: bool = False) -> P:
        rows, cols = None if "m" in over else self.m, None if "n" in over else self.n
        return P(*((self.l,) if ndim == 3 else ()), *((cols, rows) if transposed else (rows, cols)))

    def across(self, over: tuple[str, ...]) -> tuple[str, ...]:
        """The mesh axes a reduction over ``over`` spans."""
        return tuple(a for d in over for a in _axes(getattr(self, d)))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec(x: Any) -> tuple:
    """An argument's partition spec, one entry per dimension."""
    s = tuple(getattr(x.sharding, "spec", ()))
    return s + (None,) * (len(x.shape) - len(s))


def _plan(params: dict[str, Any], arg_shapes: Any) -> _Plan:
    a, b = arg_shapes[0], arg_shapes[1]
    sa, sb = _spec(a), _spec(b)
    batched = len(a.shape) == 3
    l = sa[0] if batched else None
    la, lb = sa[-2:], sb[-2:]
    m, ka = (la[1], la[0]) if params["transpose_a"] else (la[0], la[1])
    kb, n = (lb[1], lb[0]) if params["transpose_b"] else (lb[0], lb[1])
    return _Plan(**_exclusive(l=l, m=m, n=n, k=ka if ka == kb else None))


def _exclusive(**entries: Any) -> dict[str, Any]:
    """Each dimension's mesh axes, in the order given, where no earlier dimension holds one of
    them (a mesh axis splits one dimension only); else None (replicated)."""
    used: set[str] = set()
    kept = {}
    for name, entry in entries.items():
        axes = _axes(entry)
        kept[name] = entry if axes and not used.intersection(axes) else None
        used.update(_axes(kept[name]))
    return kept


def _shardings(params, mesh, arg_shapes):
    plan = _plan(params, arg_shapes)
    a, b, ops = arg_shapes
    ir = params["ir"]
    if ir.gated and plan.n is not None:
        # a gated GEMM's shard of N must hold whole (gate, up) block pairs: else N is gathered
        n = b.shape[-2] if params["transpose_b"] else b.shape[-1]
        if (n // math.prod(mesh.shape[x] for x in _axes(plan.n))) % (2 * ir.gated):
            plan = dataclasses.replace(plan, n=None)
    if plan.n is not None and ir.reductions:
        # a reduction over N the program consumes (a row softmax) sees whole rows: N is gathered
        plan = dataclasses.replace(plan, n=None)
    args = (
        NamedSharding(mesh, plan.a(len(a.shape), params["transpose_a"])),
        NamedSharding(mesh, plan.b(len(b.shape), params["transpose_b"])),
        tuple(NamedSharding(mesh, plan.operand(spec.role, len(x.shape)))
              for spec, x in zip(ir.operands, ops)),
    )
    out = [NamedSharding(mesh, plan.out(len(a.shape), o.over, o.transposed)) for o in ir.outputs]
    return plan, args, out


def _partition(key, mesh, arg_shapes, result_shape):
    primitive, params = key[0], dict(key[1])
    plan, args, out = _shardings(params, mesh, arg_shapes)
    ir = params["ir"]
    local_ir = _with_partial_sums(ir, plan)

    def local(a, b, ops):
        if plan.k is None:
            return _local(primitive, {**params, "ir": local_ir}, a, b, ops)
        plain = identity_ir(_partial_sum_dtype(params), ir.epi_dtype)
        (part,) = _local(primitive, {**params, "ir": plain, "feeds_collective": True}, a, b, ())
        return evaluate_product(local_ir, lax.psum(part, plan.k), ops)

    def partitioned(a, b, ops):
        return _completed(ir, plan, local(a, b, ops))

    return mesh, partitioned, out, args


_COLLECTIVES = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def _with_partial_sums(ir: EpilogueIR, plan: _Plan) -> EpilogueIR:
    """``ir`` with each sum over a sharded dimension kept in float32 (int32) on each device,
    so that the partial sums lose nothing before ``psum`` adds them."""
    def wide(dtype: str) -> str:
        return "float32" if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4 else (
            "int32" if jnp.issubdtype(dtype, jnp.integer) and np.dtype(dtype).itemsize < 4 else dtype)

    return ir.with_outputs([dataclasses.replace(o, dtype=wide(o.dtype))
                            if o.reduce == "sum" and plan.across(o.over) else o for o in ir.outputs])


def _completed(ir: EpilogueIR, plan: _Plan, outs: list[Any]) -> list[Any]:
    """The device-local outputs, with every reduction over a sharded dimension completed across
    the devices that share it."""
    done = []
    for o, x in zip(ir.outputs, outs):
        if o.reduce and plan.across(o.over):
            x = store_as(_COLLECTIVES[o.reduce](x, plan.across(o.over)), o.dtype)
        done.append(x)
    return done


def _partial_sum_dtype(params: dict[str, Any]) -> np.dtype:
    """The dtype the row-parallel partial products are stored, sent and summed in: the
    outputs' one dtype when it is a 16-bit float (a narrower float or an integer would lose
    the sum), else the accumulator's."""
    acc = np.dtype(params["acc_dtype"])
    outs = {np.dtype(o.dtype) for o in params["ir"].outputs}
    if len(outs) == 1:
        out = outs.pop()
        if jnp.issubdtype(out, jnp.floating) and 2 <= out.itemsize < acc.itemsize:
            return out
    return acc


def _infer(key, mesh, arg_shapes, result_shape):
    return _shardings(dict(key[1]), mesh, arg_shapes)[2]


def _operand_factors(spec: Any, t: Any, i: int, lead: str) -> str:
    """An operand's factors in a sharding rule: ``lead`` names a 3-D operand's first dimension."""
    if len(t.shape) == 0:
        return ""
    core = {Role.TILE: "m n", Role.ROW: f"r{i} n", Role.COL: f"m c{i}", Role.SCALAR: f"s{i} t{i}"}[spec.role]
    return (lead + " " if len(t.shape) == 3 else "") + core


def _output_factors(ir: EpilogueIR, lead: str) -> list[str]:
    return [lead + " ".join(f"r{j}{d}" if d in o.over else d for d in ("nm" if o.transposed else "mn"))
            for j, o in enumerate(ir.outputs)]


def _rule(key, mesh, value_types, result_types):
    params = dict(key[1])
    a_rank = len(value_types[0].shape)
    lead = "l " if a_rank == 3 else ""
    a = lead + ("k m" if params["transpose_a"] else "m k")
    b = lead + ("n k" if params["transpose_b"] else "k n")
    ops = [_operand_factors(spec, t, i, "l") for i, (spec, t) in enumerate(zip(params["ir"].operands, value_types[2:]))]
    outs = _output_factors(params["ir"], lead)
    return f"{', '.join([a, b, *ops])} -> {', '.join(outs)}", {"reduction_factors": ("k",)}


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=_rule,
)


# The grouped GEMM (``grouped_gemm_p``: lhs (T, K) rows sorted by group, rhs (G, K, N), the
# group sizes (G,), operands, per-group ones (G + 1, 1, N)) is partitioned by rows and by
# columns, never over K or the groups:
# - T sharded: each device runs its rows with the group sizes of its slice of the rows (the
#   overlap of each group's rows with the slice, from the replicated sizes and its index);
# - N sharded: each device runs its columns with its slice of rhs and of every row operand;
# - K, or the groups of rhs, sharded: gathered (expert parallelism moves tokens, not weights:
#   run it under ``jax.shard_map`` with an all-to-all, as ``examples/moe.py`` does).

def lower_grouped_partitioned(ctx: Any, primitive: Any, *args: Any, **params: Any) -> Any:
    """The lowering of the grouped GEMM's ``primitive`` before partitioning, as
    :func:`lower_partitioned` is the dense one's."""
    key = (primitive, tuple(sorted(params.items())))
    return mlir.lower_fun(lambda lhs, rhs, sizes, *ops: _grouped_partitioned(key, lhs, rhs, sizes, tuple(ops)),
                          multiple_results=True)(ctx, *args)


@partial(custom_partitioning, static_argnums=(0,))
def _grouped_partitioned(key, lhs, rhs, sizes, ops):
    return key[0].bind(lhs, rhs, sizes, *ops, local=True, **dict(key[1]))


def _grouped_shardings(params, mesh, arg_shapes):
    lhs, rhs, _, ops = arg_shapes
    plan = _Plan(l=None, k=None, **_exclusive(m=_spec(lhs)[0], n=_spec(rhs)[1 if params["transpose_b"] else 2]))
    m, n = plan.m, plan.n
    ir = params["ir"]
    args = (NamedSharding(mesh, P(m, None)),
            NamedSharding(mesh, P(None, n, None) if params["transpose_b"] else P(None, None, n)),
            NamedSharding(mesh, P(None)),
            tuple(NamedSharding(mesh, plan.operand(s.role, len(x.shape))) for s, x in zip(ir.operands, ops)))
    return plan, args, [NamedSharding(mesh, plan.out(2, o.over, o.transposed)) for o in ir.outputs]


def local_group_sizes(group_sizes: Any, rows: int, index: Any) -> Any:
    """The group sizes (none negative) of the ``index``-th slice of ``rows`` rows: how many of
    each group's rows (groups follow one another from row 0) fall in the slice."""
    ends = jnp.cumsum(group_sizes)
    first = index * rows
    starts = ends - group_sizes
    return (jnp.clip(ends - first, 0, rows) - jnp.clip(starts - first, 0, rows)).astype(group_sizes.dtype)


def _grouped_partition(key, mesh, arg_shapes, result_shape):
    primitive, params = key[0], dict(key[1])
    plan, args, out = _grouped_shardings(params, mesh, arg_shapes)
    ir = params["ir"]
    local_params = {**params, "ir": _with_partial_sums(ir, plan)}

    def partitioned(lhs, rhs, sizes, ops):
        if plan.m is not None:
            sizes = local_group_sizes(sizes, lhs.shape[0], lax.axis_index(_axes(plan.m)))
        return _completed(ir, plan, primitive.bind(lhs, rhs, sizes, *ops, local=True, **local_params))

    return mesh, partitioned, out, args


def _grouped_rule(key, mesh, value_types, result_types):
    params = dict(key[1])
    rhs = "g n k" if params["transpose_b"] else "g k n"
    ops = [_operand_factors(spec, t, i, f"q{i}")
           for i, (spec, t) in enumerate(zip(params["ir"].operands, value_types[3:]))]
    return (f"{', '.join(['m k', rhs, 'g', *ops])} -> {', '.join(_output_factors(params['ir'], ''))}",
            {"need_replication_factors": ("k", "g")})


_grouped_partitioned.def_partition(
    partition=_grouped_partition,
    infer_sharding_from_operands=lambda key, mesh, arg_shapes, result_shape: _grouped_shardings(
        dict(key[1]), mesh, arg_shapes)[2],
    sharding_rule=_grouped_rule,
)


# The grouped GEMM's weight gradient (``grouped_contraction_p``: a (T, M) and b (T, N), rows in
# groups, to (G, M, N)) is partitioned by M and N, and by the rows it contracts: each device
# contracts its slice of the rows, with the group sizes of that slice, and the partial products
# are summed with ``psum`` (in the dtype of the dense GEMM's row-parallel partials). The groups
# are never split.

def lower_contraction_partitioned(ctx: Any, primitive: Any, *args: Any, **params: Any) -> Any:
    """The lowering of the grouped weight gradient's ``primitive`` before partitioning."""
    key = (primitive, tuple(sorted(params.items())))
    return mlir.lower_fun(lambda a, b, sizes: _contraction_partitioned(key, a, b, sizes),
                          multiple_results=True)(ctx, *args)


@partial(custom_partitioning, static_argnums=(0,))
def _contraction_partitioned(key, a, b, sizes):
    return key[0].bind(a, b, sizes, local=True, **dict(key[1]))


def _contraction_shardings(mesh, arg_shapes):
    (t, m), (tb, n) = _spec(arg_shapes[0]), _spec(arg_shapes[1])
    plan = _Plan(l=None, **_exclusive(k=t if t == tb else None, m=m, n=n))
    args = (NamedSharding(mesh, P(plan.k, plan.m)), NamedSharding(mesh, P(plan.k, plan.n)),
            NamedSharding(mesh, P(None)))
    return plan, args, [NamedSharding(mesh, P(None, plan.m, plan.n))]


def _contraction_partition(key, mesh, arg_shapes, result_shape):
    primitive, params = key[0], dict(key[1])
    plan, args, out = _contraction_shardings(mesh, arg_shapes)
    ir = params["ir"]

    def partitioned(a, b, sizes):
        if plan.k is None:
            return primitive.bind(a, b, sizes, local=True, **params)
        sizes = local_group_sizes(sizes, a.shape[0], lax.axis_index(_axes(plan.k)))
        plain = identity_ir(_partial_sum_dtype(params), ir.epi_dtype)
        (part,) = primitive.bind(a, b, sizes, local=True, **{**params, "ir": plain})
        return [store_as(lax.psum(part, plan.k), ir.outputs[0].dtype)]

    return mesh, partitioned, out, args


_contraction_partitioned.def_partition(
    partition=_contraction_partition,
    infer_sharding_from_operands=lambda key, mesh, arg_shapes, result_shape: _contraction_shardings(
        mesh, arg_shapes)[2],
    sharding_rule=lambda key, mesh, value_types, result_types: (
        "t m, t n, g -> g m n", {"reduction_factors": ("t",), "need_replication_factors": ("g",)}),
)
