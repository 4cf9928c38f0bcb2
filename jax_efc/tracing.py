"""Tracing: a user's epilogue, written in ``jax.numpy``, traced into an :class:`EpilogueIR`.

``jax.make_jaxpr`` gives the program; the calls JAX wraps around library functions (``jit``,
``custom_jvp_call``, ...) are inlined, whitelisted elementwise primitives become instructions
and ``jnp.sum`` / ``jnp.max`` / ``jnp.min`` over the tile's axes become reductions. Anything
else is an :class:`EpilogueError` naming the primitive and the user's source line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .epilogue import (AXES, OPS, EpilogueError, EpilogueIR, Input, Instr, Output, Role, after_reduction)

__all__ = ["trace_epilogue", "classify", "REDUCTIONS"]

# the reductions an epilogue may use: jaxpr primitive -> our kind
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}

# jaxpr primitive name -> our op name (None: an identity)
_PRIMITIVES: dict[str, str | None] = {
    **{name: name for name in OPS if name not in ("select", "not", "convert", "const", "reduce")},
    "select_n": "select",
    "not": "not",
    "and": "and",
    "or": "or",
    "convert_element_type": "convert",
    "copy": None,
    "copy_p": None,
    "optimization_barrier": None,
    "square": "square",
    "one_minus_square": "one_minus_square",  # tanh's derivative, as newer JAX writes it
    "reduce_precision": None,
    "add_any": "add",
}

# primitives that wrap a sub-jaxpr we inline
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "checkpoint", "custom_lin")


def classify(shape: tuple[int, ...], acc_shape: tuple[int, ...], what: str) -> tuple[Role, bool]:
    """The role of an operand of ``shape`` against an accumulator of ``acc_shape``,
    and whether it carries the batch dimension."""
    *lead, m, n = acc_shape
    patterns = [((m, n), Role.TILE), ((n,), Role.ROW), ((1, n), Role.ROW), ((m, 1), Role.COL),
                ((), Role.SCALAR), ((1,), Role.SCALAR), ((1, 1), Role.SCALAR)]
    shape = tuple(shape)
    for core, role in patterns:
        if shape == core:
            return role, False
    if lead:
        (batch,) = lead
        for core, role in [((m, n), Role.TILE), ((1, n), Role.ROW), ((m, 1), Role.COL), ((1, 1), Role.SCALAR)]:
            if shape == (batch, *core):
                return role, True
            if shape == (1, *core):
                return role, False
    raise EpilogueError(
        f"{what} has shape {shape}, which is not an epilogue operand for an accumulator of shape "
        f"{tuple(acc_shape)}: pass a full tile {(m, n)}, a row vector ({n},) broadcast over rows, "
        f"a column vector ({m}, 1) broadcast over columns, or a 0-d array"
        + (f" (with a leading batch dimension {lead[0]} where it varies per batch)" if lead else "")
        + "."
    )


def _source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # the location is a courtesy; never fail on it
        return ""


class _Builder:
    """Walks a jaxpr and emits instructions; values are deduplicated (CSE).

    Beside its value, each jaxpr variable carries the tile axis ("l", "m", "n") each of its
    dimensions runs along (None for a size-1 dimension with no axis), so that a reduction
    knows what it reduces and a value reduced over N, shaped (M,), broadcasts along rows."""

    def __init__(self, inputs: list[Input], acc_shape: tuple[int, ...]):
        self.inputs = inputs
        self.instrs: list[Instr] = []
        self.acc_shape = acc_shape
        self.axes = AXES[-len(acc_shape):]
        self._memo: dict[Instr, int] = {}
        self._callers: list[str] = []  # source locations of the calls being inlined

    def where(self, eqn: Any) -> str:
        """The user's source line: the equation's own, else that of the call around it."""
        for loc in [_source(eqn), *reversed(self._callers)]:
            if loc and not loc.startswith(("unknown", ":")):
                return loc
        return "an unknown location"

    def emit(self, instr: Instr) -> int:
        if instr in self._memo:
            return self._memo[instr]
        self.instrs.append(instr)
        vid = len(self.inputs) + len(self.instrs) - 1
        self._memo[instr] = vid
        return vid

    def const(self, value: Any, dtype: Any) -> int:
        arr = np.asarray(value)
        if arr.ndim != 0 and not np.all(arr == arr.reshape(-1)[0]):
            raise EpilogueError(
                f"the epilogue closes over an array of shape {arr.shape}; only scalars can be "
                "baked in. Pass the array as a positional operand instead."
            )
        scalar = arr.reshape(-1)[0].item() if arr.size else 0
        dtype = np.dtype(dtype).name
        return self.emit(Instr("const", (), dtype, scalar))

    def dtype_of(self, vid: int) -> str:
        if vid < len(self.inputs):
            return self.inputs[vid].dtype
        return self.instrs[vid - len(self.inputs)].dtype

    def aligned(self, shape: tuple[int, ...], eqn: Any = None) -> tuple[str | None, ...]:
        """The axes of a value of ``shape`` broadcast NumPy-style against the accumulator."""
        if len(shape) > len(self.axes):
            at = f" at {self.where(eqn)}" if eqn is not None else ""
            raise EpilogueError(f"the epilogue makes a value of shape {tuple(shape)}{at}, of more "
                                f"dimensions than the accumulator's {self.acc_shape}.")
        return self.axes[len(self.axes) - len(shape):]

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
        """Each of ``jaxpr``'s outputs as (value id, axes), for ``args`` as (value id, axes)."""
        env: dict[Any, tuple[int, tuple]] = {}

        def read(atom: Any) -> tuple[int, tuple]:
            if hasattr(atom, "val"):  # a Literal
                return self.const(atom.val, atom.aval.dtype), self.aligned(np.shape(atom.val))
            return env[atom]

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c, np.asarray(c).dtype), self.aligned(np.shape(c))
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(x) for x in eqn.invars])
            for var, out in zip(eqn.outvars, outs):
                env[var] = out
        return [read(x) for x in jaxpr.outvars]

    def eqn(self, eqn: Any, args: list[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
        name = eqn.primitive.name
        if name in _CALLS:
            sub = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr", eqn.params.get("fun_jaxpr")))
            self._callers.append(_source(eqn))
            try:
                if hasattr(sub, "jaxpr"):  # ClosedJaxpr
                    return self.run(sub.jaxpr, sub.consts, args[-len(sub.jaxpr.invars):])
                return self.run(sub, [], args[-len(sub.invars):])
            finally:
                self._callers.pop()
        in_shapes = [tuple(getattr(x.aval, "shape", ())) for x in eqn.invars]
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if name == "broadcast_in_dim":
            ((x, axes),) = args[:1]
            out = list(self.aligned(out_shape, eqn))
            for i, d in enumerate(eqn.params["broadcast_dimensions"]):
                if in_shapes[0][i] == out_shape[d]:
                    out[d] = axes[i]
            return [(x, self.checked(tuple(out), out_shape, eqn))]
        if name in ("reshape", "squeeze", "expand_dims"):
            ((x, axes),) = args[:1]
            in_shape = in_shapes[0]
            kept = [a for a, d in zip(axes, in_shape) if d != 1]
            if tuple(d for d in in_shape if d != 1) != tuple(d for d in out_shape if d != 1):
                raise EpilogueError(
                    f"the epilogue reshapes {in_shape} to {out_shape} at {self.where(eqn)}; an epilogue must "
                    "be elementwise over the (M, N) tile (or reduce over it with sum, max or min)."
                )
            it = iter(kept)
            out = [next(it) if d != 1 else a for a, d in zip(self.aligned(out_shape, eqn), out_shape)]
            out = [None if d == 1 and a in kept else a for a, d in zip(out, out_shape)]
            return [(x, self.checked(tuple(out), out_shape, eqn))]
        if name in REDUCTIONS:
            return [self.reduction(eqn, REDUCTIONS[name], *args[0], in_shapes[0])]
        op = _PRIMITIVES.get(name, "unsupported")
        if op == "unsupported":
            raise EpilogueError(
                f"the epilogue uses `{name}` at {self.where(eqn)}, which is not an operation "
                "jax_efc can fuse. Supported: arithmetic, comparisons, where/select, min/max, "
                "abs/neg/sign, exp/exp2/log/log1p/expm1, tanh/sigmoid/erf, sqrt/rsqrt, pow, "
                "sin/cos/tan, casts, and sum/max/min over the tile's axes. Compute it outside the "
                "epilogue (before or after the GEMM)."
            )
        axes = self.elementwise_axes(eqn, args, in_shapes, out_shape)
        vids = [a for a, _ in args]
        return [(vid, axes) for vid in self.elementwise(op, eqn, vids)]

    def elementwise_axes(self, eqn: Any, args: list, in_shapes: list, out_shape: tuple) -> tuple:
        """The axes of an elementwise result: its arguments' (each of the result's shape or
        0-d), which must agree wherever a dimension is longer than 1."""
        seen: list[str | None] = [None] * len(out_shape)
        for (_, axes), shape in zip(args, in_shapes):
            if len(shape) != len(out_shape):
                continue
            for i, (a, d) in enumerate(zip(axes, shape)):
                if d == 1:
                    continue
                if seen[i] is not None and seen[i] != a:
                    raise EpilogueError(
                        f"the epilogue combines, at {self.where(eqn)}, a value that varies along "
                        f"{_AXIS_WORDS[seen[i]]} with one that varies along {_AXIS_WORDS[a]} "
                        "position by position: keep the reduced axis (keepdims=True) so that it "
                        "broadcasts, e.g. jnp.sum(x, axis=1, keepdims=True) for a value per row."
                    )
                seen[i] = a
        axes = tuple(s if s is not None else d for s, d in zip(seen, self.aligned(out_shape, eqn)))
        return self.checked(axes, out_shape, eqn)

    def checked(self, axes: tuple, shape: tuple, eqn: Any) -> tuple:
        """``axes`` if every dimension longer than 1 runs along its own axis, in the tile's
        order (the broadcasting a canonical layout can hold); else the error."""
        long = [a for a, d in zip(axes, shape) if d != 1]
        # a value of the tile's rank holds each axis in its place; a lower rank (a value
        # reduced over N is (M,)) only in order
        misplaced = len(shape) == len(self.axes) and any(
            d != 1 and a != t for a, t, d in zip(axes, self.axes, shape))
        if None in long or long != sorted(set(long), key=AXES.index) or misplaced:
            raise EpilogueError(
                f"the epilogue moves an axis at {self.where(eqn)} (a value of shape {shape} whose "
                f"dimensions run along {[_AXIS_WORDS[a] if d != 1 else 'no axis' for a, d in zip(axes, shape)]}); "
                "only NumPy-style broadcasting against the (M, N) tile is elementwise. Keep a "
                "reduced axis so that it broadcasts (jnp.sum(x, axis=1, keepdims=True) is one value "
                "per row), and pass a column vector as shape (M, 1) rather than transposing a row vector."
            )
        return tuple(None if d == 1 and a in long else a for a, d in zip(axes, shape))

    def reduction(self, eqn: Any, kind: str, x: int, axes: tuple, shape: tuple) -> tuple[int, tuple]:
        """A sum, max or min over some of the tile's axes: over M and N in one instruction,
        over L (whose batches the kernels reduce apart) in a second."""
        dims = tuple(eqn.params["axes"])
        # a dimension as long as the tile's along its axis is reduced (even of length 1, where
        # M or N is 1: the result is still a reduction); a broadcast one reduces to itself
        extent = dict(zip(self.axes, self.acc_shape))
        over = {axes[d] for d in dims if axes[d] is not None and shape[d] == extent[axes[d]]}
        dtype = np.dtype(eqn.outvars[0].aval.dtype).name
        for group in (tuple(a for a in ("m", "n") if a in over), ("l",) if "l" in over else ()):
            if group:
                x = self.emit(Instr("reduce", (x,), dtype, (kind, group)))
        if not over and self.dtype_of(x) != dtype:
            x = self.emit(Instr("convert", (x,), dtype))
        return x, tuple(a for d, a in enumerate(axes) if d not in dims)

    def elementwise(self, op: str | None, eqn: Any, args: list[int]) -> list[int]:
        dtype = np.dtype(eqn.outvars[0].aval.dtype).name
        if op is None:
            return args
        if op == "square":
            return [self.emit(Instr("mul", (args[0], args[0]), dtype))]
        if op == "one_minus_square":
            square = self.emit(Instr("mul", (args[0], args[0]), dtype))
            return [self.emit(Instr("sub", (self.const(1.0, dtype), square), dtype))]
        if op == "convert":
            (x,) = args
            if self.dtype_of(x) == dtype:
                return [x]
            if x >= len(self.inputs) and self.instrs[x - len(self.inputs)].op == "const":
                return [self.const(self.instrs[x - len(self.inputs)].attr, dtype)]
            return [self.emit(Instr("convert", (x,), dtype))]
        if op == "integer_pow":
            return [self.emit(Instr("integer_pow", tuple(args), dtype, int(eqn.params["y"])))]
        return [self.emit(Instr(op, tuple(args), dtype))]


_AXIS_WORDS = {"l": "the batch", "m": "rows (M)", "n": "columns (N)", None: "no axis"}


def _output_items(out: Any) -> tuple[list[str], list[Any], Any]:
    if isinstance(out, Mapping):
        names = [str(k) for k in out]
        return names, [out[k] for k in out], ("dict", tuple(out))
    if isinstance(out, (tuple, list)):
        return [str(i) for i in range(len(out))], list(out), ("tuple", len(out))
    return ["0"], [out], ("array", None)


def trace_epilogue(
    fn: Callable[..., Any],
    acc_shape: tuple[int, ...],
    operand_shapes: Sequence[tuple[int, ...]],
    operand_dtypes: Sequence[Any],
    static_scalars: Mapping[str, Any],
    dynamic_scalars: Mapping[str, Any],
    out_dtypes: Any,
    default_out_dtype: Any,
    epi_dtype: Any = jnp.float32,
    gated: int = 0,
) -> tuple[EpilogueIR, Any, list[Role], list[bool]]:
    """Trace ``fn(acc, *operands, **scalars)`` into an :class:`EpilogueIR`; with ``gated`` (a
    gated GEMM's block width), ``fn(gate_acc, up_acc, *operands, **scalars)``.

    Returns the IR, the output structure (for rebuilding a dict/tuple), and for each
    operand (positional, then the dynamic scalars by sorted name) its role and whether it
    carries the batch dimension.
    """
    epi = np.dtype(epi_dtype)
    if not jnp.issubdtype(epi, jnp.floating):
        raise TypeError(f"epi_dtype must be a floating dtype, got {epi}.")
    roles, batched = [], []
    inputs = ([Input(Role.ACC, epi.name, "gate_acc"), Input(Role.ACC, epi.name, "up_acc")] if gated
              else [Input(Role.ACC, epi.name, "acc")])
    n_acc = len(inputs)
    avals = []
    for i, (shape, dtype) in enumerate(zip(operand_shapes, operand_dtypes)):
        what = f"epilogue operand {i}"
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{what} has dtype {np.dtype(dtype).name}; epilogue operands must be floating point "
                "(cast masks and integer data to the epilogue dtype first)."
            )
        role, b = classify(tuple(shape), acc_shape, what)
        roles.append(role)
        batched.append(b)
        inputs.append(Input(role, np.dtype(dtype).name, what))
        avals.append(jax.ShapeDtypeStruct(tuple(shape), epi))
    dyn_names = sorted(dynamic_scalars)
    for name in dyn_names:
        value = dynamic_scalars[name]
        shape = tuple(np.shape(value))
        if shape != ():
            raise EpilogueError(
                f"scalar {name!r} has shape {shape}; keyword scalars must be 0-d. Pass arrays as "
                "positional operands."
            )
        dtype = jnp.result_type(value)
        inputs.append(Input(Role.SCALAR, np.dtype(dtype).name if jnp.issubdtype(dtype, jnp.floating)
                            else epi.name, f"scalar {name!r}"))
        roles.append(Role.SCALAR)
        batched.append(False)

    n_pos = len(operand_shapes)

    def wrapped(*args):
        accs, args = args[:n_acc], args[n_acc:]
        kw = dict(static_scalars)
        kw.update(zip(dyn_names, args[n_pos:]))
        return fn(*accs, *args[:n_pos], **kw)

    scalar_avals = [jax.ShapeDtypeStruct((), epi) for _ in dyn_names]
    try:
        closed, out_shape = jax.make_jaxpr(wrapped, return_shape=True)(
            *[jax.ShapeDtypeStruct(tuple(acc_shape), epi)] * n_acc, *avals, *scalar_avals
        )
    except EpilogueError:
        raise
    except Exception as e:  # the user's function failed on abstract values
        raise EpilogueError(f"tracing the epilogue failed: {type(e).__name__}: {e}") from e

    names, leaves, structure = _output_items(out_shape)
    if not leaves:
        raise EpilogueError(f"the epilogue returns no outputs (an empty {structure[0]}); return an array "
                            f"shaped like the accumulator, {tuple(acc_shape)}, or a tuple or dict of them.")
    for name, leaf in zip(names, leaves):
        if leaf is None:
            raise EpilogueError(f"epilogue output {name!r} is None; every output must be an array.")
    builder = _Builder(inputs, tuple(acc_shape))
    in_axes = ([builder.aligned(tuple(acc_shape))] * n_acc
               + [builder.aligned(tuple(a.shape)) for a in avals + scalar_avals])
    flat_out = builder.run(closed.jaxpr, closed.consts, list(zip(range(len(inputs)), in_axes)))
    ir = EpilogueIR(tuple(inputs), tuple(builder.instrs), (), epi.name, gated)
    reduced = after_reduction(ir)
    for name, leaf, (vid, _) in zip(names, leaves, flat_out):
        if tuple(leaf.shape) != tuple(acc_shape) and not reduced[vid]:
            raise EpilogueError(
                f"epilogue output {name!r} has shape {tuple(leaf.shape)}; every output must be an "
                f"array elementwise over the accumulator, shape {tuple(acc_shape)}, or a reduction "
                "of one (jnp.sum, jnp.max or jnp.min over its axes)."
            )
    defaults = [ir.instrs[vid - len(inputs)].dtype if reduced[vid] and tuple(leaf.shape) != tuple(acc_shape)
                else np.dtype(default_out_dtype).name for (vid, _), leaf in zip(flat_out, leaves)]
    dtypes = _resolve_out_dtypes(out_dtypes, names, structure, defaults)
    outputs = tuple(Output(nm, vid, dt) for nm, (vid, _), dt in zip(names, flat_out, dtypes))
    leaf_shapes = tuple((tuple(leaf.shape), axes) for leaf, (_, axes) in zip(leaves, flat_out))
    return ir.with_outputs(outputs), (*structure, leaf_shapes), roles, batched


def _resolve_out_dtypes(out_dtypes: Any, names: list[str], structure: Any, defaults: list[str]) -> list[str]:
    kind, keys = structure
    if out_dtypes is None:
        return list(defaults)
    if isinstance(out_dtypes, Mapping):
        if kind != "dict" or set(map(str, out_dtypes)) != set(names):
            raise EpilogueError(
                f"out_dtypes has keys {sorted(map(str, out_dtypes))} but the epilogue returns "
                f"{names if kind == 'dict' else 'a ' + kind}; give one dtype per output."
            )
        by_name = {str(k): v for k, v in out_dtypes.items()}
        return [np.dtype(by_name[n]).name for n in names]
    if isinstance(out_dtypes, (tuple, list)):
        if kind != "tuple" or len(out_dtypes) != len(names):
            raise EpilogueError(
                f"out_dtypes has {len(out_dtypes)} entries but the epilogue returns "
                f"{len(names)} output(s) as a {kind}; give one dtype per output."
            )
        return [np.dtype(d).name for d in out_dtypes]
    return [np.dtype(out_dtypes).name] * len(names)
