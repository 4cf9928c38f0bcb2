"""Public ops: ``gemm`` and ``fused_dense``, their argument handling and their VJPs."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import activations, arguments
from .config import GemmConfig
from .epilogue import (EpilogueIR, Role, accumulators, canonical_shape, evaluate, exact, identity_ir,
                       output_shape, restructure, rows_in_tile, split_at_reductions, with_acc_output,
                       with_masked_stores)
from .gated import check_block, interleave_gated, split_gated
from .tracing import trace_epilogue
from .primitive import fused_gemm, gemm_cotangents, match_varying, problem_shape

__all__ = ["gemm", "fused_dense", "prepare_epilogue"]



@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about one call that is not an array: the primitive's parameters."""

    ir: EpilogueIR
    transpose_a: bool
    transpose_b: bool
    acc_dtype: Any
    precision: Any
    config: GemmConfig | str | None
    recompute_acc: bool
    save_acc: bool  # whether the backward pass reads the accumulator

    def bind(self, a, b, ops, ir=None):
        return fused_gemm(a, b, *ops, ir=ir or self.ir, transpose_a=self.transpose_a,
                          transpose_b=self.transpose_b, acc_dtype=self.acc_dtype,
                          precision=self.precision, config=self.config)


def gemm(
    a: Any,
    b: Any,
    epilogue: Callable[..., Any] | None = None,
    *operands: Any,
    out_dtypes: Any = None,
    acc_dtype: Any = None,
    epi_dtype: Any = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
    precision: Any = None,
    recompute_acc: bool = False,
    config: GemmConfig | str | None = None,
    inplace: int | Mapping[Any, int] | None = None,
    transposed_outputs: bool | str | int | Collection[str | int] | None = None,
    deterministic: bool = True,
    gated: int | None = None,
    **scalars: Any,
) -> Any:
    """``epilogue(op(a) @ op(b), *operands, **scalars)`` as one fused op.

    ``a`` is (M, K) or (L, M, K) (with ``transpose_a``: (K, M) / (L, K, M)); ``b`` is (K, N)
    or (L, K, N) (with ``transpose_b``: (N, K) / (L, N, K)). Transposed operands are read in
    place, never copied. Each positional operand is a tile (M, N), a row vector (N,), a
    column vector (M, 1) or a 0-d array, optionally with a leading batch L. Keyword
    ``scalars`` that are Python numbers are baked into the kernel; JAX arrays are read at run
    time. The result has the structure the epilogue returns (an array, tuple or dict), with
    dtypes from ``out_dtypes`` (one dtype, or one per output; default: ``a``'s dtype).

    The GEMM accumulates in ``acc_dtype`` and the epilogue runs in ``epi_dtype``: by default
    float32, or float64 for float64 inputs.

    ``recompute_acc=True`` recomputes ``op(a) @ op(b)`` in the backward pass instead of saving
    it as a residual. ``inplace`` writes outputs over tile operands of their shape and dtype: an
    operand's index for the one output, or ``{output: operand index}`` (by dict key or tuple
    position); donated to ``jax.jit``, the operand's buffer is the output's, with no copy. An
    output ``jnp.where(mask, new, c)`` over its operand ``c``, which nothing else reads, is stored
    only where the mask holds (the kernel never reads ``c``).
    ``transposed_outputs`` returns outputs as their transposes, (N, M) or (L, N, M), which the
    kernel stores so (M contiguous; no transpose pass): an output's name (dict key or tuple
    index), a collection of them, or ``True`` for the one output. ``deterministic=False`` lets
    the kernel fold each tile's part of a reduction into the result with global atomics instead
    of leaving per-tile partials for a final pass: faster, but sums are rounded in whatever order
    the tiles finish, so they may differ from run to run in the last bits (max and min do not).
    ``config`` pins the kernel's
    ``GemmConfig``; ``"autotune"`` times the heuristic's candidates on the GPU at first use (each
    GEMM of the backward too) and keeps the fastest on disk (``jax_efc.autotune``).

    ``gated=B`` makes it a gated GEMM: ``b`` holds a gate and an up matrix interleaved in blocks
    of ``B`` columns (``jax_efc.interleave_gated``), so ``op(b)`` is (K, 2N), and the epilogue is
    ``epilogue(gate_acc, up_acc, *operands, **scalars)`` with both accumulators, the operands
    and the outputs (M, N), e.g. ``lambda g, u, bg, bu: jax.nn.silu(g + bg) * (u + bu)``.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> a, b = jnp.ones((256, 4), jnp.bfloat16), jnp.ones((4, 64), jnp.bfloat16)
    >>> c = jnp.full((256, 64), 0.5, jnp.bfloat16)
    >>> out = efc.gemm(a, b, lambda acc, c, *, alpha: {"D": acc * alpha + c, "Y": acc}, c, alpha=2.0,
    ...                out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32})
    >>> out["D"].shape, out["D"].dtype, float(out["D"][0, 0]), out["Y"].dtype
    ((256, 64), dtype(bfloat16), 8.5, dtype('float32'))
    """
    a, b = arguments.array("a", a), arguments.array("b", b)
    arguments.inputs("gemm", "a", a, "b", b)
    transpose_a, transpose_b, recompute_acc, deterministic = (
        arguments.flag(name, v) for name, v in
        (("transpose_a", transpose_a), ("transpose_b", transpose_b), ("recompute_acc", recompute_acc),
         ("deterministic", deterministic)))
    acc_dtype = arguments.acc_dtype(acc_dtype, a.dtype)
    epi_dtype = arguments.dtype("epi_dtype", epi_dtype or jnp.promote_types(acc_dtype, jnp.float32),
                                floating=True)
    out_dtypes = arguments.out_dtypes(out_dtypes)
    arguments.check_config(config)
    precision = arguments.precision(precision)
    batch, m, n, _ = problem_shape(*_batched_shapes(a.shape, b.shape), transpose_a, transpose_b)
    if gated is not None:
        gated = check_block(gated, "gated")
        if n % (2 * gated):
            raise ValueError(f"gated={gated}: op(b) has {n} columns, not a multiple of {2 * gated} (whole gate "
                             "and up blocks; jax_efc.interleave_gated builds the layout).")
        if epilogue is None:
            raise ValueError("gated: give an epilogue (gate_acc, up_acc, *operands) that combines the two.")
        n //= 2
    acc_shape = (m, n) if batch is None else (batch, m, n)

    ir, structure, arrays = prepare_epilogue(epilogue, acc_shape, operands, scalars, out_dtypes,
                                             arguments.default_out_dtype(a.dtype, acc_dtype), acc_dtype, epi_dtype,
                                             gated=gated or 0)
    if inplace is not None:
        ir = _in_place(ir, inplace, [x.shape for x in arrays], acc_shape)
    if transposed_outputs is not None:
        ir = _transposed(ir, transposed_outputs)
    split = split_at_reductions(ir, rows_in_tile(ir, n))
    for o, direct in zip(ir.outputs, split.direct):
        stored = direct is not None and not split.gemm.outputs[direct].reduce
        for what, asked, done in (("inplace", o.inplace is not None, "written in place"),
                                  ("transposed_outputs", o.transposed, "transposed")):
            if asked and not stored:
                raise ValueError(f"{what}: output {o.name!r} is a reduction, or computed after one by XLA: only "
                                 f"a tile the GEMM stores can be {done}.")
    gemm_ir = split.gemm if deterministic else split.gemm.with_outputs(
        [dataclasses.replace(o, atomic=bool(o.reduce)) for o in split.gemm.outputs])
    static = _Static(gemm_ir, transpose_a, transpose_b, acc_dtype, precision, config, recompute_acc,
                     _backward_reads_acc(split.gemm.untransposed(), acc_shape))
    a, b, gemm_arrays, unfold = _fold_batch(a, b, arrays, static, batch)
    # under shard_map, differentiable inputs are made alike outside the VJP, so that the
    # gradient of an input that varies over fewer mesh axes is summed over the others
    a, b, *gemm_arrays = match_varying((a, b, *gemm_arrays))
    try:
        outs = [unfold(o) for o in _fused(static, a, b, tuple(gemm_arrays))]
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise TypeError(_NO_FORWARD_MODE) from None
    return restructure(structure, ir, split.finish(ir, outs, arrays, acc_shape))


_NO_FORWARD_MODE = (
    "jax_efc's ops are differentiable in reverse mode only (jax.grad, jax.vjp, jax.jacrev, and "
    "their compositions, Hessians included); forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) "
    "is not supported. A Jacobian-vector product J @ t is the VJP of the VJP: with "
    "y, vjp = jax.vjp(f, x), it is jax.vjp(vjp, y)[1]((t,))[0].")


def prepare_epilogue(epilogue: Callable[..., Any] | None, acc_shape: tuple[int, ...], operands: Any,
                     scalars: dict[str, Any], out_dtypes: Any, default_out_dtype: Any, acc_dtype: Any,
                     epi_dtype: Any, gated: int = 0) -> tuple[EpilogueIR, Any, list[Any]]:
    """An epilogue of an accumulator shaped ``acc_shape`` ((M, N) or (L, M, N); with ``gated``,
    of two) traced into its IR, with its output structure and its array inputs (the operands,
    then the dynamic scalars by name) in canonical shapes: the part every op with a fused
    epilogue shares."""
    batch = acc_shape[0] if len(acc_shape) == 3 else None
    m, n = acc_shape[-2:]
    static_kw, dynamic_kw = {}, {}
    for k, v in scalars.items():
        if isinstance(v, (numbers.Number, np.number, np.bool_)):
            if isinstance(v, (complex, np.complexfloating)):
                raise TypeError(f"scalar {k!r} is complex ({v!r}); epilogue scalars are real numbers.")
            static_kw[k] = v
        else:
            dynamic_kw[k] = arguments.array(f"scalar {k!r}", v)
            if jnp.issubdtype(dynamic_kw[k].dtype, jnp.complexfloating):
                raise TypeError(f"scalar {k!r} is complex ({dynamic_kw[k].dtype}); epilogue scalars "
                                "are real numbers.")
    operands = [arguments.array(f"epilogue operand {i}", x) for i, x in enumerate(operands)]
    if epilogue is None:
        if operands or scalars:
            raise ValueError("operands and scalars need an epilogue to use them.")
        epilogue = _identity
    elif not callable(epilogue):
        raise TypeError(f"epilogue must be a callable (acc, *operands, **scalars) -> outputs, got "
                        f"{type(epilogue).__name__}.")
    trace = _trace if _is_builtin(epilogue) else _trace.__wrapped__
    ir, structure, roles, batched = trace(
        epilogue, acc_shape, tuple(x.shape for x in operands), tuple(x.dtype for x in operands),
        tuple((k, exact(v), v) for k, v in sorted(static_kw.items())),
        tuple((k, jnp.shape(v), jnp.result_type(v).name) for k, v in sorted(dynamic_kw.items())),
        out_dtypes, np.dtype(default_out_dtype).name, epi_dtype.name, gated,
    )
    arguments.check_x64(acc_dtype, epi_dtype, *(o.dtype for o in ir.outputs))
    arrays = operands + [_as_float(dynamic_kw[k], ir.epi_dtype) for k in sorted(dynamic_kw)]
    arrays = [
        jnp.reshape(x, canonical_shape(r, batch if bt else None, m, n))
        for x, r, bt in zip(arrays, roles, batched)
    ]
    return ir, structure, arrays


def _in_place(ir: EpilogueIR, inplace: Any, shapes: list[tuple[int, ...]], acc_shape: tuple[int, ...]) -> EpilogueIR:
    """``ir`` with its outputs marked as written over the tile operands ``inplace`` names,
    checked: one output to an operand, a tile of the output's shape and dtype."""
    by_name = {o.name: o for o in ir.outputs}
    if isinstance(inplace, Mapping):
        pairs = [(str(k), v) for k, v in inplace.items()]
    elif len(ir.outputs) == 1:
        pairs = [(ir.outputs[0].name, inplace)]
    else:
        raise TypeError(f"inplace: the epilogue returns {len(ir.outputs)} outputs; give {{output: operand index}}.")
    chosen: dict[str, int] = {}
    for name, j in pairs:
        if name not in by_name:
            raise ValueError(f"inplace: no output {name!r}; the epilogue returns {sorted(by_name)}.")
        if not isinstance(j, (int, np.integer)) or isinstance(j, bool) or not 0 <= j < len(ir.operands):
            raise ValueError(f"inplace[{name!r}] = {j!r}: an operand's index, 0 to {len(ir.operands) - 1}.")
        out, op = by_name[name], ir.operands[j]
        if tuple(shapes[j]) != tuple(acc_shape) or out.dtype != op.dtype:
            raise ValueError(f"inplace: output {name!r} ({out.dtype}{tuple(acc_shape)}) cannot be written over "
                             f"operand {j} ({op.dtype}{tuple(shapes[j])}); it must be a tile operand of the "
                             "output's shape and dtype.")
        if int(j) in chosen.values():
            raise ValueError(f"inplace: two outputs are written over operand {j}.")
        chosen[name] = int(j)
    return with_masked_stores(ir.with_outputs([dataclasses.replace(o, inplace=chosen.get(o.name))
                                               for o in ir.outputs]))


def _transposed(ir: EpilogueIR, transposed: Any) -> EpilogueIR:
    """``ir`` with the outputs ``transposed`` names (``True``: the one output) stored transposed,
    checked: outputs that exist, none also written in place (its operand is (M, N))."""
    names = [o.name for o in ir.outputs]
    if isinstance(transposed, (bool, np.bool_)):
        if not transposed:
            return ir
        if len(names) != 1:
            raise TypeError(f"transposed_outputs=True: the epilogue returns {len(names)} outputs; name the ones "
                            "to transpose (dict keys or tuple indices).")
        chosen = set(names)
    else:
        several = isinstance(transposed, Collection) and not isinstance(transposed, (str, Mapping))
        items = list(transposed) if several else [transposed]
        for k in items:
            if isinstance(k, bool) or not isinstance(k, (str, int, np.integer)):
                raise TypeError(f"transposed_outputs: {k!r} is not an output's name; give True, an output's name "
                                "(dict key or tuple index) or a collection of them.")
        chosen = {str(k) for k in items}
        missing = sorted(chosen - set(names))
        if missing:
            raise ValueError(f"transposed_outputs: no output {missing[0]!r}; the epilogue returns {sorted(names)}.")
    for o in ir.outputs:
        if o.name in chosen and o.inplace is not None:
            raise ValueError(f"transposed_outputs: output {o.name!r} is also written in place (inplace=), over an "
                             "(M, N) operand; an output can be transposed or written in place, not both.")
    return ir.with_outputs([dataclasses.replace(o, transposed=o.name in chosen) for o in ir.outputs])


def _identity(acc: Any) -> Any:
    return acc


_identity.__efc_builtin__ = True


def _is_builtin(fn: Any) -> bool:
    """Epilogues jax_efc builds from its own pure functions: their traces are cached by
    function. A user's function is traced at every call, since what it computes may change
    with the Python state it reads (a closure, an attribute, a global)."""
    return getattr(fn, "__efc_builtin__", False) is True


def _as_float(x: Any, dtype: str) -> Any:
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)


@functools.lru_cache(maxsize=512)
def _trace(fn, acc_shape, shapes, dtypes, static_items, dyn_scalars, out_dtypes,
           default_dtype, epi_dtype, gated):
    if isinstance(out_dtypes, tuple):
        kind, items = out_dtypes
        out_dtypes = dict(items) if kind == "dict" else list(items)
    dynamic = {k: jax.ShapeDtypeStruct(shape, dt) for k, shape, dt in dyn_scalars}
    static = {k: v for k, _, v in static_items}
    return trace_epilogue(fn, acc_shape, shapes, dtypes, static, dynamic, out_dtypes,
                          default_dtype, epi_dtype, gated)


def _batched_shapes(a_shape: tuple, b_shape: tuple) -> tuple[tuple, tuple]:
    """The shapes of ``a`` and ``b`` with a batch dimension that only one of them has given to
    both (as a shared operand has it)."""
    if len(a_shape) == 3 and len(b_shape) == 2:
        return a_shape, (a_shape[0], *b_shape)
    if len(a_shape) == 2 and len(b_shape) == 3:
        return (b_shape[0], *a_shape), b_shape
    return a_shape, b_shape


def _fold_batch(a: Any, b: Any, ops: list[Any], static: _Static, batch: int | None):
    """Batched ``a`` against a 2-D ``b``: fold L into M (free reshapes, and B is read once)
    when the operands that vary per row (tiles, columns) vary per batch and the others (rows,
    scalars) do not; else ``b`` is shared across
    the batch by broadcasting. A 2-D ``a`` against a batched ``b`` broadcasts ``a``. Returns the
    inputs and how to give an output its batch dimension back."""
    keep = lambda o: o  # noqa: E731
    if a.ndim == 3 and b.ndim == 2:
        per_row = all((x.ndim == 3) == (r.role in (Role.TILE, Role.COL))
                      for x, r in zip(ops, static.ir.operands))
        # no sum over a batch's rows, and no output whose rows would be a batch's columns
        per_batch = all("m" not in o.over and not o.transposed for o in static.ir.outputs)
        if not static.transpose_a and per_row and per_batch:
            _, m, k = a.shape
            ops = [x.reshape(batch * m, x.shape[-1]) if x.ndim == 3 else x for x in ops]
            return a.reshape(batch * m, k), b, ops, lambda o: o.reshape(batch, m, o.shape[-1])
        return a, jnp.broadcast_to(b, (batch, *b.shape)), ops, keep
    if a.ndim == 2 and b.ndim == 3:
        return jnp.broadcast_to(a, (batch, *a.shape)), b, ops, keep
    return a, b, ops, keep


# Autodiff ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def _backward_reads_acc(ir: EpilogueIR, acc_shape: tuple[int, ...]) -> bool:
    """Whether the epilogue's VJP needs the accumulator (it does not when the epilogue is
    affine in it, e.g. ``alpha * acc + beta * c``); if not, nothing is saved for it."""
    shapes = [acc_shape] * len(ir.operands)

    n_acc = ir.n_acc

    def vjp(*args):
        accs, ops, cts = args[:n_acc], args[n_acc: n_acc + len(shapes)], args[n_acc + len(shapes):]
        return jax.vjp(lambda *x: evaluate(ir, _packed(ir, x[:n_acc]), x[n_acc:]), *accs, *ops)[1](list(cts))

    try:
        grads, _, _, _ = trace_epilogue(
            vjp, acc_shape, shapes + [output_shape(o, acc_shape) for o in ir.outputs],
            [ir.epi_dtype] * (len(shapes) + len(ir.outputs)), {}, {}, None, ir.epi_dtype,
            ir.epi_dtype, ir.gated,
        )
    except Exception:  # anything unusual in the derivative: keep the accumulator, to be safe
        return True
    return any(grads.uses(i) for i in range(n_acc))


def _packed(ir: EpilogueIR, accs: Any) -> Any:
    """The accumulator inputs ``accs`` as :func:`evaluate` takes them: a gated program's pair, or
    the one accumulator."""
    return tuple(accs) if ir.gated else accs[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static: _Static, a, b, ops):
    return static.bind(a, b, ops)


def _fused_fwd(static: _Static, a, b, ops):
    if static.save_acc and not static.recompute_acc:
        # kept in the inputs' dtype, or for 8-bit inputs (which would clip or wrap it) the
        # accumulator's
        keep = static.acc_dtype if a.dtype.itemsize == 1 else a.dtype
        outs = static.bind(a, b, ops, ir=with_acc_output(static.ir, keep))
        outs, acc = outs[: -static.ir.n_acc], _packed(static.ir, outs[-static.ir.n_acc:])
    else:
        outs, acc = static.bind(a, b, ops), None
    return outs, (a, b, ops, acc)


def _fused_bwd(static: _Static, residuals, cts):
    a, b, ops, acc = residuals
    epi = static.ir.epi_dtype
    gated = static.ir.gated
    if acc is None and static.save_acc:
        (acc,) = static.bind(a, b, (), ir=identity_ir(epi, epi))
        acc = split_gated(acc, gated) if gated else acc
    _, m, n, _ = problem_shape(a.shape, b.shape, static.transpose_a, static.transpose_b)
    tile = (*a.shape[:-2], m, n // 2 if gated else n)
    # a transposed output's cotangent, (N, M), back in the tile's layout
    cts = [jnp.swapaxes(c, -1, -2) if o.transposed else c for o, c in zip(static.ir.outputs, cts)]
    d_acc, d_ops = _epilogue_vjp(static.ir.untransposed(), acc, ops, cts, tile)
    # a gated GEMM's two cotangents, interleaved back into the product's
    d_acc = interleave_gated(*d_acc, block=gated) if gated else d_acc
    if jnp.issubdtype(a.dtype, jnp.integer):  # integer inputs have no gradient
        da, db = (np.zeros(x.shape, jax.dtypes.float0) for x in (a, b))
    else:
        da, db = gemm_cotangents(d_acc, a, b, True, True, epi_dtype=epi,
                                 transpose_a=static.transpose_a, transpose_b=static.transpose_b,
                                 acc_dtype=static.acc_dtype, precision=static.precision, config=static.config)
    d_ops = tuple(g.astype(x.dtype) for g, x in zip(d_ops, ops))
    return da, db, d_ops


# Rows a summed operand's partial cotangent covers (below): about the chunk XLA's own reduction
# splitter takes when it splits a long column sum (128 rows at M = 8192). Measured on H200,
# gelu_tanh's backward with a bias gradient, ms, one sum against partial sums of 128 rows:
# 0.216 / 0.133 at 4096 x 14336 (the floor without the bias gradient: 0.128), 0.069 / 0.068
# at 2048 x 4096, 0.121 / 0.111 at 2048 x 14336; 0.157 / 0.157 and 0.250 / 0.251 at 8192 x
# 8192 and 8192 x 14336, where XLA splits the sum itself. Partials of 64 rows were slower there
# (0.191, 0.320), of 256 at 4096 x 14336 (0.139). Where 128 does not divide M, the divisor
# nearest to it: e.g. 0.260 / 0.111 (125 rows) at 3000 x 14336, 0.158 / 0.151 (100) at 4100 x
# 14336; divisors farther from 128 were mostly slower (benchmarks/FINDINGS.md).
_ROWS_PER_PARTIAL = 128
_PARTIAL_ROWS_RANGE = (64, 256)


def _rows_per_partial(m: int) -> int | None:
    """The rows of a partial sum over ``m`` rows: the divisor of ``m`` nearest to
    ``_ROWS_PER_PARTIAL`` within ``_PARTIAL_ROWS_RANGE``, or None (one sum) where there is
    none or it would leave a single partial."""
    lo, hi = _PARTIAL_ROWS_RANGE
    divisors = [r for r in range(lo, min(hi, m - 1) + 1) if m % r == 0]
    return min(divisors, key=lambda r: (abs(r - _ROWS_PER_PARTIAL), r), default=None)


def _epilogue_vjp(ir: EpilogueIR, acc: Any, ops: tuple, cts: list,
                  tile: tuple[int, ...]) -> tuple[Any, list[Any]]:
    """The epilogue's cotangents: the accumulator's (a gated program's pair) and each operand's.
    ``acc`` is as stored (converted here), or None where the VJP does not read it; ``tile`` is its
    shape.

    A row, column or scalar operand's cotangent is a sum over the tile. Taken from the
    accumulator's VJP, that sum shares the full-size derivative with the accumulator's
    cotangent, and XLA does not fuse a derivative holding ``tanh``, ``exp`` and the like into
    a sum with another consumer: it writes the derivative in fp32 and reads it back, which
    costs a training step more than the fused forward saves. So the sums come from a second
    VJP whose full-size inputs pass an optimization barrier (nothing in common to merge
    back), summed in partials of about ``_ROWS_PER_PARTIAL`` rows: a sum over all M rows XLA
    fuses with the first VJP only where it splits the sum itself (it did at M = 4100, 6000
    and 8192, not at 1000 to 4096), a sum over a few rows everywhere.
    """
    tiles = [i for i, x in enumerate(ir.operands) if x.role is Role.TILE]
    summed = [i for i, x in enumerate(ir.operands) if x.role is not Role.TILE]

    acc_ids = [-1 - k for k in range(ir.n_acc)]

    def pullback(wrt: list[int], accs: tuple, ops: tuple, cts: list) -> list[Any]:
        """Cotangents of the operands ``wrt`` (-1 - k: accumulator k of ``accs``); the others
        held fixed."""
        # (an accumulator not kept, the epilogue linear in it, is zeros varying as the cotangents)
        accs = [match_varying((jnp.zeros(tile, ir.epi_dtype), *cts))[0] if x is None else x.astype(ir.epi_dtype)
                for x in accs]

        def epilogue(*args):
            given = dict(zip(wrt, args))
            return evaluate(ir, _packed(ir, [given.get(-1 - k, x) for k, x in enumerate(accs)]),
                            [given.get(i, x) for i, x in enumerate(ops)])

        _, vjp = jax.vjp(epilogue, *[accs[-1 - i] if i < 0 else ops[i] for i in wrt])
        return list(vjp(cts))

    d_accs = pullback([*acc_ids, *tiles], accumulators(ir, acc), ops, cts)
    d_acc, d_tiles = _packed(ir, d_accs[: ir.n_acc]), d_accs[ir.n_acc:]
    d_sums = []
    if summed:
        # the small operands stay outside the barrier: shared, they let XLA fuse both VJPs
        acc2, tiles2, cts2 = jax.lax.optimization_barrier((acc, [ops[i] for i in tiles], cts))
        ops2 = tuple(dict(zip(tiles, tiles2)).get(i, x) for i, x in enumerate(ops))
        # (a program that reduces has rows that do not split)
        r = None if ir.reduces else _rows_per_partial(tile[-2])
        if r is None:
            d_sums = pullback(summed, accumulators(ir, acc2), ops2, cts2)
        else:
            d_sums = _partial_sums(pullback, summed, accumulators(ir, acc2), ops2, cts2, ir.epi_dtype, r)
    by_index = dict(zip(tiles, d_tiles)) | dict(zip(summed, d_sums))
    return d_acc, [by_index[i] for i in range(len(ops))]


def _partial_sums(pullback: Callable[..., list[Any]], summed: list[int], accs: tuple, ops: tuple,
                  cts: list, epi_dtype: Any, r: int) -> list[Any]:
    """``pullback(summed, accs, ops, cts)``, its sums over rows taken in two steps: the M rows
    split into chunks of ``r``, each summed operand without rows copied per chunk (its
    cotangent then holds a partial sum per chunk, in fp32), and the partials summed behind a
    barrier, which keeps XLA from merging the two sums back into one."""
    m = cts[0].shape[-2]

    def split(x: Any) -> Any:  # (..., M, X) -> (..., M / r, r, X)
        return x.reshape(*x.shape[:-2], m // r, r, x.shape[-1])

    def has_rows(x: Any) -> bool:
        return x.ndim >= 2 and x.shape[-2] == m

    def per_chunk(x: Any) -> Any:  # (..., 1, X) or () -> (..., M / r, 1, X), in fp32
        x = x.astype(epi_dtype)
        if has_rows(x):
            return split(x)
        x = x.reshape(*x.shape[:-2], 1, *x.shape[-2:]) if x.ndim >= 2 else x.reshape(1, 1, 1)
        return jnp.broadcast_to(x, (*x.shape[:-3], m // r, *x.shape[-2:]))

    chunked = tuple(per_chunk(x) if i in summed else split(x) for i, x in enumerate(ops))
    # (zeros are read only if the VJP does)
    accs = tuple(split(jnp.zeros(cts[0].shape, epi_dtype) if x is None else x) for x in accs)
    partials = pullback(summed, accs, chunked, [split(c) for c in cts])
    partials = jax.lax.optimization_barrier(partials)
    return [(p if has_rows(ops[i]) else p.sum(-3)).reshape(ops[i].shape)
            for i, p in zip(summed, partials)]


_fused.defvjp(_fused_fwd, _fused_bwd)


# The dense layer --------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _dense_epilogue(activation: Callable[[Any], Any], has_bias: bool, has_residual: bool):
    def epilogue(acc, *ops):
        i = 0
        if has_bias:
            acc = acc + ops[i]
            i += 1
        y = activation(acc)
        return y + ops[i] if has_residual else y

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


def fused_dense(
    x: Any,
    kernel: Any,
    bias: Any = None,
    *,
    activation: str | Callable[[Any], Any] | None = None,
    residual: Any = None,
    out_dtype: Any = None,
    precision: Any = None,
    recompute_acc: bool = False,
    config: GemmConfig | str | None = None,
    inplace: bool = False,
) -> Any:
    """``activation(x @ kernel + bias) + residual`` in one kernel.

    ``x`` is (..., K), ``kernel`` (K, N), ``bias`` (N,), ``residual`` (..., N). ``activation``
    is a name from ``jax_efc.activations.ACTIVATIONS`` (``"gelu"`` is the exact erf form,
    ``"gelu_tanh"`` the approximation) or a callable of elementwise JAX ops. ``inplace=True``
    writes the result over ``residual`` (of the result's dtype): donated to ``jax.jit``, a
    residual stream is updated in its own buffer.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> x, w, b = jnp.ones((8, 16, 32)), jnp.full((32, 64), 0.1), jnp.zeros(64)
    >>> y = efc.fused_dense(x, w, b, activation="relu")
    >>> y.shape, round(float(y[0, 0, 0]), 4)
    ((8, 16, 64), 3.2)
    """
    x, kernel = arguments.array("x", x), arguments.array("kernel", kernel)
    if x.dtype != kernel.dtype:
        raise TypeError(f"x is {x.dtype} but kernel is {kernel.dtype}; cast one so both have the same "
                        "dtype (the Flax modules do, as nn.Dense does).")
    if kernel.ndim != 2:
        raise ValueError(f"kernel must be 2-D (K, N), got shape {kernel.shape}.")
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"x has shape {x.shape} but kernel is {kernel.shape}: x's last dimension must equal "
            f"kernel's first (K={kernel.shape[0]})."
        )
    lead, (k, n) = x.shape[:-1], kernel.shape
    rows = math.prod(lead)  # not -1: a reshape cannot infer it when K or N is 0
    ops = []
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"bias has shape {bias.shape}; expected ({n},).")
        ops.append(bias)
    if residual is not None:
        residual = jnp.asarray(residual)
        if residual.shape != (*lead, n):
            raise ValueError(f"residual has shape {residual.shape}; expected {(*lead, n)}.")
        ops.append(residual.reshape(rows, n))
    if arguments.flag("inplace", inplace) and residual is None:
        raise ValueError("inplace=True writes the result over residual; give a residual.")
    epilogue = _dense_epilogue(activations.resolve(activation), bias is not None, residual is not None)
    y = gemm(x.reshape(rows, k), kernel, epilogue, *ops, out_dtypes=out_dtype, precision=precision,
             recompute_acc=recompute_acc, config=config, inplace=len(ops) - 1 if inplace else None)
    return y.reshape(*lead, n)
