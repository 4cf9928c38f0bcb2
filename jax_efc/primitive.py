"""The fused-GEMM primitive: abstract evaluation, lowerings and batching, side by side.

``fused_gemm_p`` computes ``epilogue(op(a) @ op(b), *operands)`` and returns one array per
epilogue output. Its operands arrive in canonical shapes (see ``epilogue.canonical_shape``):
``a`` is (M, K) or (L, M, K) (transposed: (K, M) / (L, K, M)), ``b`` likewise (K, N) / (N, K),
outputs are (M, N) or (L, M, N) (those marked ``transposed``: (N, M) / (L, N, M)). Every
platform lowers to the XLA reference; CUDA lowers to the kernel when one fits, and otherwise
falls back with its reason logged once (a warning), or, for the GEMMs where XLA's GEMM is
faster (few rows, or too few tiles to fill the SMs), hands the call to XLA (logged once at
INFO).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from . import compile_ahead
from . import config as _config
from . import device
from . import sharding
from .arguments import allowed_acc_dtypes, mixes_8bit
from .epilogue import EpilogueIR, Role, canonical_shape, evaluate, identity_ir, output_shape, with_acc_output
from .gated import split_gated
from .log import log_once
from .plan import plan_call
from .reference import fused_gemm_reference

__all__ = ["fused_gemm_p", "fused_gemm", "FallbackError", "fused_gemm_eqns", "plan_eqn", "backends", "PLANNERS",
           "match_varying", "gemm_cotangents", "output_avals", "register_lowerings", "lowering_devices"]


fused_gemm_p = jex.core.Primitive("efc_fused_gemm")
fused_gemm_p.multiple_results = True

# each fused-GEMM primitive's planner, (avals_in, params, devices) -> Plan: what tools that walk a
# jaxpr (backends, warm-up, the benchmark's configs) read to judge each call as its lowering would
PLANNERS: dict[Any, Any] = {fused_gemm_p: plan_call}


class FallbackError(RuntimeError):
    """Raised under ``JAX_EFC_STRICT=1`` where the kernel cannot run."""


def fused_gemm(
    a: Any,
    b: Any,
    *operands: Any,
    ir: EpilogueIR,
    transpose_a: bool = False,
    transpose_b: bool = False,
    acc_dtype: Any = jnp.float32,
    precision: Any = None,
    config: Any = None,
) -> list[Any]:
    """Bind the primitive; operands must already be in their canonical shapes."""
    return fused_gemm_p.bind(
        *match_varying((a, b, *operands)), ir=ir, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b),
        acc_dtype=np.dtype(acc_dtype), precision=precision, config=config, local=False, feeds_collective=False,
    )


def problem_shape(a_shape: Sequence[int], b_shape: Sequence[int], transpose_a: bool,
                  transpose_b: bool) -> tuple[int | None, int, int, int]:
    """(L, M, N, K) of ``op(a) @ op(b)``, L None when unbatched; raises on a mismatch."""
    if len(a_shape) not in (2, 3) or len(a_shape) != len(b_shape):
        raise ValueError(
            f"a has shape {tuple(a_shape)} and b {tuple(b_shape)}: both must be 2-D, or both 3-D "
            "with the batch dimension first."
        )
    *la, a0, a1 = a_shape
    *lb, b0, b1 = b_shape
    m, ka = (a1, a0) if transpose_a else (a0, a1)
    kb, n = (b1, b0) if transpose_b else (b0, b1)
    if ka != kb:
        raise ValueError(
            f"contracting dimensions differ: op(a) is ({m}, {ka}) and op(b) is ({kb}, {n}) "
            f"(a {tuple(a_shape)}, transpose_a={transpose_a}; b {tuple(b_shape)}, "
            f"transpose_b={transpose_b})."
        )
    if la != lb:
        raise ValueError(f"batch dimensions differ: a has L={la[0]}, b has L={lb[0]}.")
    return (la[0] if la else None), m, n, ka


def _abstract_eval(a, b, *operands, ir, transpose_a, transpose_b, acc_dtype, precision, config,
                   local, feeds_collective):
    if a.dtype != b.dtype and not mixes_8bit(a.dtype, b.dtype):
        raise TypeError(f"a is {a.dtype} but b is {b.dtype}; the fused GEMM takes A and B of one "
                        "dtype (or two 8-bit float formats): cast one of them.")
    if not (jnp.issubdtype(a.dtype, jnp.floating) or np.dtype(a.dtype).itemsize == 1):
        raise TypeError(f"a and b are {a.dtype}; the fused GEMM takes floating or 8-bit integer inputs.")
    allowed = allowed_acc_dtypes(a.dtype)
    if np.dtype(acc_dtype).name not in allowed:
        raise TypeError(f"acc_dtype={np.dtype(acc_dtype).name} cannot accumulate {a.dtype} inputs; "
                        f"allowed: {', '.join(allowed)}.")
    batch, m, n, _ = problem_shape(a.shape, b.shape, transpose_a, transpose_b)
    if ir.gated:
        if n % (2 * ir.gated):
            raise ValueError(f"b has {n} columns; a gated GEMM of block {ir.gated} needs a multiple of "
                             f"{2 * ir.gated}: whole (gate, up) block pairs (a b sharded along N must "
                             "keep each shard's columns in whole pairs).")
        n //= 2
    if len(operands) != len(ir.operands):
        raise ValueError(f"the epilogue takes {len(ir.operands)} operands, got {len(operands)}.")
    for spec, x in zip(ir.operands, operands):
        allowed = [canonical_shape(spec.role, None, m, n)]
        if batch is not None:
            allowed.append(canonical_shape(spec.role, batch, m, n))
        if tuple(x.shape) not in allowed:
            raise ValueError(f"{spec.name} has shape {tuple(x.shape)}; expected one of {allowed}.")
    for o in ir.outputs:
        if o.reduce and (o.reduce not in ("sum", "max", "min") or not set(o.over) <= {"m", "n"}
                         or not o.over):
            raise ValueError(f"output {o.name!r} reduces by {o.reduce!r} over {o.over}; a fused GEMM "
                             "reduces by sum, max or min over some of ('m', 'n').")
        if o.reduce and o.transposed:
            raise ValueError(f"output {o.name!r} is a reduction and marked transposed; only tile outputs "
                             "are stored transposed.")
        if o.atomic and not o.reduce:
            raise ValueError(f"output {o.name!r} is marked atomic but does not reduce; only reductions "
                             "are combined by atomics.")
    tile = (m, n) if batch is None else (batch, m, n)
    compile_ahead.speculate([a, b, *operands], dict(ir=ir, transpose_a=transpose_a, transpose_b=transpose_b,
                                                     acc_dtype=acc_dtype, precision=precision, config=config,
                                                     local=local, feeds_collective=feeds_collective))
    return output_avals(ir, tile, a, b, transpose_a, transpose_b)


def output_avals(ir: EpilogueIR, tile: tuple, a: Any, b: Any, transpose_a: bool, transpose_b: bool) -> list[Any]:
    """The avals of ``ir``'s outputs for an accumulator ``tile``, with their sharding where
    ``a`` and ``b`` carry one, and (under shard_map) the manual axes every input varies over,
    which ``a`` carries (the inputs were matched at bind: :func:`match_varying`)."""
    if _out_sharding(a, b, transpose_a, transpose_b, ()) is None:
        return [jax.core.ShapedArray(output_shape(o, tile), jnp.dtype(o.dtype)) for o in ir.outputs]
    return [a.update(shape=output_shape(o, tile), dtype=jnp.dtype(o.dtype), weak_type=False,
                     sharding=_out_sharding(a, b, transpose_a, transpose_b, o.over, o.transposed))
            for o in ir.outputs]


def _out_sharding(a, b, transpose_a, transpose_b, over, transposed=False):
    """An output's sharding in the type system: rows as ``a``'s, columns as ``b``'s (the other
    way round where it is stored transposed), and replicated along the axes ``over`` it
    reduces."""
    sa, sb = getattr(a, "sharding", None), getattr(b, "sharding", None)
    if sa is None or not hasattr(sa, "mesh") or sb is None:
        return None
    pa = tuple(sa.spec) + (None,) * (a.ndim - len(sa.spec))
    pb = tuple(sb.spec) + (None,) * (b.ndim - len(sb.spec))
    m = pa[-1] if transpose_a else pa[-2]
    n = pb[-2] if transpose_b else pb[-1]
    n = None if n is not None and n == m else n
    lead = pa[:1] if a.ndim == 3 else ()
    rows, cols = None if "m" in over else m, None if "n" in over else n
    return NamedSharding(sa.mesh, P(*lead, *((cols, rows) if transposed else (rows, cols))))


def _varying(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def match_varying(args: Sequence[Any]) -> list[Any]:
    """Mark every input as varying over the union of the inputs' manual axes, as JAX does
    for its own multi-input primitives."""
    union = frozenset().union(*(_varying(x) for x in args))
    return [jax.lax.pcast(x, tuple(sorted(union - _varying(x))), to="varying")
            if union - _varying(x) else x for x in args]


fused_gemm_p.def_abstract_eval(_abstract_eval)
fused_gemm_p.def_impl(partial(dispatch.apply_primitive, fused_gemm_p))
# The partitioner (see ``sharding``) needs the concrete devices when the call is lowered.
dispatch.prim_requires_devices_during_lowering.add(fused_gemm_p)


# Lowerings ---------------------------------------------------------------------------------

_reference_lowering = mlir.lower_fun(fused_gemm_reference, multiple_results=True)
def _fall_back(reason: str) -> None:
    if _config.strict():
        raise FallbackError(f"jax_efc: no kernel for this GEMM (JAX_EFC_STRICT=1): {reason}")
    log_once(logging.WARNING, f"using the XLA reference: {reason}")


def fused_gemm_eqns(closed_jaxpr: Any) -> list[Any]:
    """Every fused-GEMM equation (dense or grouped) in a jaxpr, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive in PLANNERS:
                found.append(eqn)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed_jaxpr.jaxpr)
    return found


def plan_eqn(eqn: Any, devices: Sequence[int] | None = None) -> Any:
    """The plan a fused-GEMM equation's lowering would read (``devices``: as ``plan_call``'s)."""
    return PLANNERS[eqn.primitive]([v.aval for v in eqn.invars], eqn.params, devices=devices)


def backends(fn: Any, *args: Any, **kwargs: Any) -> list[str]:
    """For each fused GEMM that ``fn(*args, **kwargs)`` runs, which backend runs it:
    ``"kernel (sm_90a)"`` or ``"reference: <why>"``, judged on the shapes the call has in
    ``fn`` (a sharded call decides per device, on its shard's shapes) by the plan its lowering
    would read: for the default device, or, on a machine without a GPU after
    :func:`jax_efc.set_target_arch`, for a ``jax.export`` to CUDA. Raises the ``ValueError``
    compiling would raise for a pinned config the kernel cannot run.

    >>> import jax, jax.numpy as jnp, jax_efc as efc
    >>> spec = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    >>> efc.backends(lambda a, b: efc.gemm(a, b, jax.nn.relu), spec, spec)  # on a CPU machine
    ['reference: platform cpu has no jax_efc kernel']
    """
    eqns = fused_gemm_eqns(jax.make_jaxpr(partial(fn, **kwargs))(*args))
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and device.arch() is None:
        return [f"reference: platform {jax.default_backend()} has no jax_efc kernel"] * len(eqns)
    out = []
    for eqn in eqns:
        # without a GPU, as an export for CUDA is planned: for a device not known
        plan = plan_eqn(eqn, devices=None if on_gpu else ())
        if plan.backend != "kernel":
            out.append(f"reference: {plan.reason}")
        else:
            out.append(f"kernel ({plan.arch})" + (f": {plan.note}" if plan.note else ""))
    return out


def lowering_devices(ctx) -> tuple[int, ...] | None:
    """The local hardware ordinals of the CUDA devices the lowered call will run on; ``()``
    when that is not known (exporting: the program may run on any GPU)."""
    if ctx.module_context.lowering_parameters.for_export:
        return ()
    axis = ctx.module_context.axis_context
    devices = getattr(axis, "device_assignment", None)
    if devices is None and getattr(axis, "mesh", None) is not None:
        devices = tuple(axis.mesh.devices.flat)
    if not devices:
        return None
    ordinals = [getattr(d, "local_hardware_id", None) for d in devices if d.platform == "gpu"]
    return tuple(ordinals) if ordinals and None not in ordinals else ()


def _lower_by_plan(ctx, plan: Any, reference: Any, *args: Any, **params: Any) -> Any:
    """Lower a call as its ``plan`` says: the kernel, or ``reference`` (a lowering) with the
    plan's reason logged at its level (a fallback raises under ``JAX_EFC_STRICT=1``), and the
    reference too where building the kernel fails."""
    if plan.backend != "kernel":
        if plan.level == logging.WARNING:
            _fall_back(plan.reason)
        elif plan.level:
            log_once(plan.level, f"using the XLA reference: {plan.reason}")
        return reference(ctx, *args, **params)
    if plan.note:
        log_once(logging.INFO, f"the kernel runs, and {plan.note}.")
    from jax_efc import ffi

    # a build started while the program was traced lands in the cache: wait for it
    compile_ahead.wait_for(plan, ctx.avals_in)
    try:
        return ffi.lower(ctx, *args, plan=plan)
    except Exception as e:  # noqa: BLE001 - any failure to build the kernel falls back
        _fall_back(f"building the kernel failed ({type(e).__name__}: {_first_line(e)})")
        return reference(ctx, *args, **params)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else "no message"


def register_lowerings(primitive: Any, partition: Any, reference: Any) -> None:
    """``primitive``'s lowerings (the dense and the grouped fused GEMM's): each call is first
    handed to ``partition`` (a lowering of ``sharding``), which re-binds it with ``local=True``
    on each device's shard; only then is it lowered, on CUDA as its planner (``PLANNERS``) plans
    it, to the kernel or to ``reference`` (a lowering), and elsewhere to ``reference`` (an error
    under ``JAX_EFC_STRICT=1``)."""

    def partitioned_first(local_lowering):
        def lowering(ctx, *args, local, **params):
            if not local:
                return partition(ctx, primitive, *args, **params)
            return local_lowering(ctx, *args, **params)

        return lowering

    def default(ctx, *args, **params):
        if _config.strict():
            _fall_back(f"platform {', '.join(ctx.module_context.platforms)} has no jax_efc kernel.")
        return reference(ctx, *args, **params)

    def cuda(ctx, *args, **params):
        plan = PLANNERS[primitive](ctx.avals_in, params, devices=lowering_devices(ctx))
        return _lower_by_plan(ctx, plan, reference, *args, **params)

    mlir.register_lowering(primitive, partitioned_first(default))
    mlir.register_lowering(primitive, partitioned_first(cuda), platform="cuda")


register_lowerings(fused_gemm_p, sharding.lower_partitioned, _reference_lowering)


# Differentiation -----------------------------------------------------------------------------
# The public ops differentiate the fused GEMM with their own VJP (``ops``), which keeps the
# residuals and fusions a training step wants. These rules make that VJP itself differentiable:
# a JVP for any epilogue, and a transpose for the plain GEMMs a JVP or VJP is made of, so
# second-order derivatives (Hessians, Hessian-vector products) work.

def gemm_cotangents(ct, a, b, need_a: bool, need_b: bool, *, epi_dtype: Any, transpose_a: bool,
                    transpose_b: bool, **params: Any) -> tuple[Any, Any]:
    """The cotangents of ``a`` and ``b`` (in their storage layouts; None where not needed) of
    ``op(a) @ op(b)`` for the cotangent ``ct`` of the product: d op(a) = ct @ op(b)^T and
    d op(b) = op(a)^T @ ct, each a plain GEMM that reads its operands in place (``ct`` in the
    dtype of the operand it meets)."""
    def plain(x, y, dtype, ta, tb):
        ir = identity_ir(dtype, epi_dtype)
        return fused_gemm(x, y, ir=ir, transpose_a=ta, transpose_b=tb, **params)[0]

    def dtype(x):
        return x.aval.dtype if ad.is_undefined_primal(x) else x.dtype

    da = db = None
    if need_a:
        c = ct.astype(b.dtype)
        da = (plain(b, c, dtype(a), transpose_b, True) if transpose_a
              else plain(c, b, dtype(a), False, not transpose_b))
    if need_b:
        c = ct.astype(a.dtype)
        db = (plain(c, a, dtype(b), True, transpose_a) if transpose_b
              else plain(a, c, dtype(b), not transpose_a, False))
    return da, db


def _jvp_rule(primals, tangents, *, ir, transpose_a, transpose_b, acc_dtype, precision, config, local,
              feeds_collective):
    a, b, *operands = primals
    ta, tb, *t_ops = tangents
    params = dict(transpose_a=transpose_a, transpose_b=transpose_b, acc_dtype=acc_dtype,
                  precision=precision, config=config, local=local, feeds_collective=feeds_collective)
    epi = ir.epi_dtype
    outs = fused_gemm_p.bind(a, b, *operands, ir=with_acc_output(ir, epi), **params)
    outs, accs = outs[: -ir.n_acc], outs[-ir.n_acc:]
    plain = dict(params, ir=identity_ir(epi, epi))
    # the accumulator's tangent: op(ta) @ op(b) + op(a) @ op(tb), each a plain GEMM
    terms = [fused_gemm_p.bind(*match_varying(pair), **plain)[0]
             for pair, tangent in (((ta, b), ta), ((a, tb), tb)) if type(tangent) is not ad.Zero]
    if terms:
        t_acc = sum(terms[1:], terms[0])
        t_accs = split_gated(t_acc, ir.gated) if ir.gated else (t_acc,)
    else:
        t_accs = tuple(jnp.zeros_like(x) for x in accs)
    t_ops = [jnp.zeros(x.shape, x.dtype) if type(t) is ad.Zero else t for x, t in zip(operands, t_ops)]

    def epilogue(*args):
        n = ir.n_acc
        return evaluate(ir, args[:n] if ir.gated else args[0], args[n:])

    _, t_outs = jax.jvp(epilogue, (*accs, *operands), (*t_accs, *t_ops))
    return outs, list(t_outs)


def _transpose_rule(cts, a, b, *operands, ir, transpose_a, transpose_b, acc_dtype, precision,
                    config, local, feeds_collective):
    """Only the plain GEMMs of a JVP are linear (the accumulator converted, nothing else), in
    whichever of ``a`` and ``b`` is the tangent."""
    del local, feeds_collective
    if operands or ir.instrs or ir.gated or len(ir.outputs) != 1 or ir.outputs[0].value != 0:
        raise NotImplementedError("jax_efc: only a plain fused GEMM is linear, and transposable.")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None]
    if ir.outputs[0].transposed:
        ct = jnp.swapaxes(ct, -1, -2)
    da, db = gemm_cotangents(ct, a, b, ad.is_undefined_primal(a),
                             ad.is_undefined_primal(b), epi_dtype=ir.epi_dtype, transpose_a=transpose_a,
                             transpose_b=transpose_b, acc_dtype=acc_dtype, precision=precision,
                             config=config)
    return [da, db]


ad.primitive_jvps[fused_gemm_p] = _jvp_rule
ad.primitive_transposes[fused_gemm_p] = _transpose_rule


# Batching ----------------------------------------------------------------------------------

def _moved(x: Any, dim: int | None) -> Any:
    return x if dim is None else jnp.moveaxis(x, dim, 0)


def _batching_rule(args, dims, *, ir, transpose_a, transpose_b, **params):
    """Fold a vmapped dimension into M when only the M side is mapped (free reshapes), else
    into the kernel's batch dimension L (broadcasting whatever is not mapped)."""
    a, b, *ops = (_moved(x, d) for x, d in zip(args, dims))
    da, db, *dops = dims
    size = next(x.shape[0] for x, d in zip((a, b, *ops), dims) if d is not None)
    two_d = a.ndim - (da is not None) == 2
    m_side = [s.role in (Role.TILE, Role.COL) for s in ir.operands]
    fold_m = (
        two_d and da is not None and db is None and not transpose_a
        and all((d is not None) == ms for d, ms in zip(dops, m_side))
        # a sum over M stays per batch, and a transposed output's batches are not its rows
        and all("m" not in o.over and not o.transposed for o in ir.outputs)
    )
    if fold_m:
        rows = size * a.shape[1]
        folded = [x.reshape(rows, x.shape[-1]) if d is not None else x for x, d in zip(ops, dops)]
        outs = fused_gemm_p.bind(a.reshape(rows, a.shape[-1]), b, *folded, ir=ir,
                                 transpose_a=transpose_a, transpose_b=transpose_b, **params)
        return [o.reshape(size, a.shape[1], o.shape[-1]) for o in outs], [0] * len(outs)

    inner = None if two_d else (a.shape[1] if da is not None else a.shape[0])

    def to_l(x, mapped, has_l):
        """Give ``x`` the new batch dimension, size * inner (size alone with no old L)."""
        if not mapped and not has_l:
            return x  # shared across every batch: the kernel broadcasts it
        if not mapped:
            x = jnp.broadcast_to(x, (size, *x.shape))
        elif inner is not None and not has_l:
            x = jnp.broadcast_to(x[:, None], (size, inner, *x.shape[1:]))
        return x if inner is None else x.reshape(size * inner, *x.shape[2:])

    a = to_l(a, da is not None, True)
    b = to_l(b, db is not None, True)
    moved = []
    for x, d, spec in zip(ops, dops, ir.operands):
        mapped = d is not None
        if spec.role is Role.SCALAR and mapped and x.ndim == 1:
            x = x.reshape(-1, 1, 1)  # a mapped 0-d scalar: the per-batch form (B, 1, 1)
            moved.append(to_l(x, True, False))
        else:
            moved.append(to_l(x, mapped, x.ndim - mapped == 3))
    outs = fused_gemm_p.bind(a, b, *moved, ir=ir, transpose_a=transpose_a,
                             transpose_b=transpose_b, **params)
    if inner is not None:
        outs = [o.reshape(size, inner, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)


batching.primitive_batchers[fused_gemm_p] = _batching_rule
