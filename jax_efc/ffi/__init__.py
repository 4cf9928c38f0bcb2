"""jax_efc.ffi: the fused-GEMM kernels as XLA custom calls, through ``cutlass.jax.cutlass_call``.

The compiled CuTe module rides inside the custom call, so ``jax.export`` and CUDA graphs
work. Arrays are presented to the kernel without copies: every tensor is viewed as 3-D
(a leading unit batch is a free reshape) and ``TensorSpec(mode=...)`` reorders its modes into
the kernel's (M, K, L) / (N, K, L) / (M, N, L) view, whichever dimension is contiguous.

Importing this module is cheap: cutlass is imported only inside the functions that need it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any

import numpy as np

from jax_efc.kernels import TIMELINE_EVENTS, TIMELINE_UNITS, policy
from jax_efc.kernels.problem import REDUCTION_IDENTITY, cta_tile
from jax_efc.log import log_once
from jax_efc.plan import Plan, gemm_dims

from . import kernel_cache

__all__ = ["fused_gemm", "primitive_call", "lower", "store_compiled", "export_checks", "KERNEL_CACHE_SIZE"]

# compile key -> kernel object, so that re-lowering reuses it; the least recently used go first
_KERNELS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
KERNEL_CACHE_SIZE = 256


def export_checks() -> tuple:
    """The ``disabled_checks`` ``jax.export`` needs to keep the kernels' custom calls (which
    promise no compatibility across versions). Imports the CuTe DSL: on a machine without a
    GPU, call :func:`jax_efc.set_target_arch` first.

    >>> import jax_efc as efc
    >>> sorted(check.is_custom_call() for check in efc.export_checks())[0]
    'CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v1'
    """
    from cutlass.jax import get_export_disabled_safety_checks

    return tuple(get_export_disabled_safety_checks())


def _as3d(x):
    """View ``x`` as (L|1, d1, d2): free reshapes that add leading unit dimensions."""
    return x.reshape((1,) * (3 - x.ndim) + tuple(x.shape)) if x.ndim < 3 else x


def _kernel(plan: Plan, timeline: bool) -> tuple[tuple, Any]:
    """(compile key, kernel object) of ``plan``'s kernel, built by its architecture's class."""
    key = (plan.problem.compile_key, dataclasses.astuple(plan.schedule)) + (("timeline",) if timeline else ())
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = policy(plan.arch).kernel_class()(plan.problem, plan.schedule, timeline)
    _KERNELS[key] = kernel
    _KERNELS.move_to_end(key)
    while len(_KERNELS) > KERNEL_CACHE_SIZE:
        _KERNELS.popitem(last=False)
    return key, kernel


# kernels compiled this process but not yet in the disk cache: entry key -> (compile key, input
# shapes). The DSL compiles a kernel when its call is lowered, after fused_gemm has returned.
_UNSTORED: dict[str, tuple] = {}


def store_compiled() -> int:
    """Put the kernels the DSL has compiled since the last call into the disk cache; returns
    how many it found to store."""
    if not _UNSTORED:
        return 0
    found = 0
    from cutlass.jax import compile as dsl_compile
    from cutlass.jax.types import cutlass_to_jax_layout_order

    for disk_key, (key, shapes) in list(_UNSTORED.items()):
        for cache_key, result in list(dsl_compile._CUTLASS_COMPILE_CACHE.items()):
            if cache_key.compile_key == key and [tuple(x.shape) for x in result.spec.in_args] == shapes:
                spec = result.spec
                entry = kernel_cache.Entry(
                    module=bytes(result.module), fingerprint=bytes(result.fingerprint),
                    input_layouts=tuple(cutlass_to_jax_layout_order(t.layout) for t in spec.input_spec),
                    output_layouts=tuple(cutlass_to_jax_layout_order(t.layout) for t in spec.output_spec),
                    aliases=tuple(tuple(a) for a in spec.input_output_aliases))
                del _UNSTORED[disk_key]
                found += 1
                try:
                    kernel_cache.store(disk_key, entry)
                except OSError as e:  # the cache is a convenience: the kernel runs without it
                    log_once(logging.WARNING, f"the kernel cache cannot store kernels: {e}")
                break
    return found


def _stored_call(entry: kernel_cache.Entry, inputs: list, out_shapes: list) -> list:
    """The custom call ``cutlass_call`` would emit for the stored kernel, without the DSL."""
    import jax
    from cutlass.jax.ffi import get_cutlass_call_ffi_name, get_cutlass_call_ffi_version, register_ffi

    version = get_cutlass_call_ffi_version()
    register_ffi(version)
    call = jax.ffi.ffi_call(get_cutlass_call_ffi_name(True, version), result_shape_dtypes=out_shapes,
                            input_output_aliases=dict(entry.aliases), input_layouts=list(entry.input_layouts),
                            output_layouts=list(entry.output_layouts))
    return call(*inputs, module=entry.module, key=entry.fingerprint)


def lower(ctx, *args, plan: Plan) -> Any:
    """The kernel's lowering of a fused-GEMM call planned as ``plan``, its compiled
    module then stored in the disk cache. Where building the kernel fails, what the lowering
    had emitted so far (the DSL compiles while its call is lowered, into functions of their
    own) is removed before the exception propagates, so the caller can lower the call another
    way into a module that is still whole."""
    from jax.interpreters import mlir
    from jax._src.lib.mlir import ir

    module_ops = ctx.module_context.module.body.operations
    block_ops = ir.InsertionPoint.current.block.operations
    marks = len(module_ops), len(block_ops)
    try:
        lowered = mlir.lower_fun(functools.partial(primitive_call, plan=plan), multiple_results=True)(ctx, *args)
    except Exception:
        for ops, mark in ((block_ops, marks[1]), (module_ops, marks[0])):
            for i in reversed(range(mark, len(ops))):
                op = ops[i]
                if "sym_name" in op.attributes:
                    ctx.module_context.symbol_table.erase(op)
                else:
                    op.erase()
        raise
    store_compiled()
    return lowered


def _operands(plan: Plan, rest: tuple) -> tuple[tuple, Any]:
    """A primitive's inputs after ``b`` as (operands, group sizes): a grouped GEMM's group sizes
    come first."""
    return (rest[1:], rest[0]) if plan.problem.groups else (rest, None)


def primitive_call(a, b, *rest, plan: Plan) -> list:
    """:func:`fused_gemm` of a primitive's inputs (``a``, ``b``, then a grouped GEMM's group
    sizes, then the operands)."""
    operands, group_sizes = _operands(plan, rest)
    return fused_gemm(a, b, *operands, plan=plan, group_sizes=group_sizes)


@dataclasses.dataclass
class _Call:
    """One kernel call as ``cutlass_call`` takes it, and its disk-cache key (None: no cache)."""

    key: tuple
    kernel: Any
    inputs: list
    in_specs: list
    out_shapes: list
    out_specs: list
    aliases: dict
    disk_key: str | None


def tf32_rounded(x):
    """float32 ``x`` rounded to TF32 (10 mantissa bits) to nearest, ties away from zero, as
    ``cvt.rna.tf32.f32`` and XLA's TF32 GEMMs round their operands (the TF32 WGMMA reads only
    the top 10 bits: rounding toward zero, whose errors add up on data of one sign). Past the
    largest TF32 value it gives infinity; infinities and NaN stay as they are."""
    import jax
    import jax.numpy as jnp

    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x)


def _assemble(plan: Plan, a, b, operands, timeline: bool, group_sizes=None) -> _Call:
    """The kernel call ``plan`` makes of ``a``, ``b`` and ``operands`` (checked against it), and of
    a grouped GEMM's int32 ``group_sizes``."""
    import jax
    import jax.numpy as jnp
    from cutlass.jax import TensorSpec

    if plan.backend != "kernel":
        raise ValueError(f"jax_efc kernel cannot run this GEMM: {plan.reason}")
    # inputs stored in a major the MMA cannot read: transposed once, here (plan.note says so);
    # float32 ones rounded to TF32 in the same pass, which the WGMMA would truncate
    a, b = (jnp.swapaxes(tf32_rounded(x) if x.dtype == jnp.float32 else x, -1, -2) if t else x
            for x, t in zip((a, b), plan.transposes))
    problem = plan.problem
    got = (np.dtype(a.dtype).name, np.dtype(b.dtype).name, len(a.shape) == 3, len(b.shape) == 3,
           tuple(len(x.shape) == 3 for x in operands))
    want = (problem.ab_dtype, problem.b_dtype, problem.a_batched, problem.b_batched, problem.operand_batched)
    m, n, k, batch = gemm_dims(a.shape, b.shape, problem.a_major == "m", problem.b_major == "k", problem.groups,
                               problem.ragged_k)
    if (group_sizes is None) != (not problem.groups):
        raise ValueError(f"a grouped GEMM's plan ({problem.groups} groups) takes group sizes, any other none.")
    if got != want or (m, n, k, batch or 1) != plan.mnkl:
        raise ValueError(f"the arrays (a {a.dtype}{tuple(a.shape)}, b {b.dtype}{tuple(b.shape)}) are not the "
                         f"ones the plan was made for ({problem.ab_dtype}, M, N, K, L = {plan.mnkl}).")
    transpose_a, transpose_b = problem.a_major == "m", problem.b_major == "k"
    m, n, _, batch = plan.mnkl
    key, kernel = _kernel(plan, timeline)

    # (L, r, c) row-major -> the kernel's (r|c, c|r, L) views: (1, 2, 0) keeps the rows
    # first, (2, 1, 0) swaps them.
    keep, swap = TensorSpec(mode=(1, 2, 0)), TensorSpec(mode=(2, 1, 0))
    sizes = [group_sizes.astype(jnp.int32)] if problem.groups else []
    inputs = [_as3d(a), _as3d(b), *sizes, *(_as3d(x) for x in operands)]
    in_specs = [swap if transpose_a else keep, keep if transpose_b else swap, *([TensorSpec()] * len(sizes)),
                *([keep] * len(operands))]
    stored = [o for o in problem.ir.outputs if not o.reduce]
    n = n // 2 if problem.ir.gated else n  # a gated GEMM's outputs: one column a (gate, up) pair
    # a transposed output is (L, N, M): its swapped view is the kernel's (M, N, L), M contiguous
    out_shapes = [jax.ShapeDtypeStruct((batch, n, m) if o.transposed else (batch, m, n), o.dtype) for o in stored]
    # outputs written over a tile operand: each CTA reads a subtile of the operand before it
    # stores the output's subtile there, and no CTA touches another's tile
    aliases = {2 + len(sizes) + j: i for i, j in problem.aliased}
    # each reducing output's fp32 values along the axes it reduces: one partial per tile, or,
    # folded by atomics, the result itself, which starts at the reduction's identity (an input
    # aliased to it: the kernel's CTAs cannot know which of them comes first)
    tile_m, tile_n = cta_tile(problem.config)
    for o in (o for o in problem.ir.outputs if o.reduce):
        tiles = {"m": 1 if o.atomic else -(-m // tile_m), "n": 1 if o.atomic else -(-n // tile_n)}
        shape = (batch, tiles["m"] if "m" in o.over else m, tiles["n"] if "n" in o.over else n)
        if o.atomic:
            aliases[len(inputs)] = len(out_shapes)
            inputs.append(jnp.full(shape, REDUCTION_IDENTITY[o.reduce], jnp.float32))
            in_specs.append(keep)
        out_shapes.append(jax.ShapeDtypeStruct(shape, jnp.float32))
    out_specs = [swap if o.transposed else keep for o in stored] + [keep] * (len(out_shapes) - len(stored))
    slots = kernel.schedule.slots
    if slots:
        # stream-K: one flag per CTA, zeroed for every call (the kernel raises them, so they
        # are an input aliased to an output), and a workspace of one fp32 tile per CTA that
        # needs no initial value
        aliases[len(inputs)] = len(out_shapes)
        inputs.append(jnp.zeros((slots,), jnp.int32))
        in_specs.append(TensorSpec())
        out_shapes += [jax.ShapeDtypeStruct((slots,), jnp.int32),
                       jax.ShapeDtypeStruct((slots * tile_m * tile_n,), jnp.float32)]
        out_specs += [TensorSpec(), TensorSpec()]
    if timeline:
        # zeroed, so units that never ran read 0 (an input aliased to an output, as the flags)
        aliases[len(inputs)] = len(out_shapes)
        inputs.append(jnp.zeros((kernel.timeline_size(),), jnp.int32))
        in_specs.append(TensorSpec())
        out_shapes.append(jax.ShapeDtypeStruct((kernel.timeline_size(),), jnp.int32))
        out_specs.append(TensorSpec())
    disk_key = None
    if kernel_cache.enabled() and not timeline:
        disk_key = kernel_cache.entry_key(key, inputs, [s.mode for s in in_specs], out_shapes, aliases)
    return _Call(key, kernel, inputs, in_specs, out_shapes, out_specs, aliases, disk_key)


def in_cache(plan: Plan, avals) -> bool:
    """Whether the disk cache holds the kernel a call planned as ``plan`` with inputs of
    ``avals`` would load (without reading the entry: the lowering checks it)."""
    import jax

    keys = []

    def key(a, b, *rest):
        operands, group_sizes = _operands(plan, rest)
        keys.append(_assemble(plan, a, b, operands, False, group_sizes).disk_key)

    jax.eval_shape(key, *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in avals])
    return keys[0] is not None and kernel_cache.exists(keys[0])


def _finished(problem, results: list) -> list:
    """The kernel's results in the order of the epilogue's outputs and in their shapes: the
    tile outputs as they are, the reducing ones from their per-tile partials (reduced here,
    in XLA; folded by atomics, already whole), then converted to their dtype as the reference
    converts them."""
    import jax.numpy as jnp

    from jax_efc.epilogue import store_as

    tiles, partials = iter(results), iter(results[sum(not o.reduce for o in problem.ir.outputs):])
    outs = []
    for o in problem.ir.outputs:
        if o.reduce:
            x = next(partials)
            axes = tuple(1 + "mn".index(d) for d in o.over)
            x = store_as({"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[o.reduce](x, axis=axes, keepdims=True),
                         o.dtype)
        else:
            x = next(tiles)
        outs.append(x if problem.batched else x.reshape(x.shape[1:]))
    return outs


def fused_gemm(a, b, *operands, plan: Plan, timeline: bool = False, group_sizes=None) -> list:
    """The outputs of the epilogue ``plan`` was made for, one array per output in shape
    (M, N), or (L, M, N) when a or b is batched (transposed ones (N, M) / (L, N, M)), from
    ``a``, ``b`` and ``operands`` in the primitive's canonical shapes (those
    :func:`jax_efc.plan.plan_kernel` was given). A grouped GEMM's plan takes its (G,) integer
    ``group_sizes``; its outputs are (T, N).

    Emits one ``cutlass_call`` custom call; call it under ``jit`` (or inside a lowering).
    Raises ``ValueError`` when ``plan`` is not the kernel's, with its reason, or was made for
    other shapes or dtypes. ``timeline=True`` runs the kernel's diagnostic build and appends
    its SM-clock stamps to the outputs: int32 (CTAs, consumer groups, ``TIMELINE_UNITS``,
    ``TIMELINE_EVENTS``) of :mod:`jax_efc.kernels`, zero where no unit ran (read by
    :mod:`jax_efc.timeline`).
    """
    from cutlass.jax import cutlass_call

    call = _assemble(plan, a, b, operands, timeline, group_sizes)
    key, kernel, inputs, out_shapes = call.key, call.kernel, call.inputs, call.out_shapes
    m, n = plan.mnkl[:2]
    stored = None
    if call.disk_key is not None:
        stored = kernel_cache.load(call.disk_key)
        if stored is None:
            _UNSTORED[call.disk_key] = (key, [tuple(x.shape) for x in inputs])
    if stored is not None:
        results = _stored_call(stored, inputs, out_shapes)
    else:
        results = cutlass_call(
            kernel,
            output_shape_dtype=out_shapes,
            input_spec=call.in_specs,
            output_spec=call.out_specs,
            input_output_aliases=call.aliases,
            compile_key=key,
        )(*inputs)
    outs = _finished(plan.problem, results[: len(plan.problem.ir.outputs)])
    if not timeline:
        return outs
    return outs + [results[-1].reshape(-1, kernel.n_epi_groups, TIMELINE_UNITS, len(TIMELINE_EVENTS))]
