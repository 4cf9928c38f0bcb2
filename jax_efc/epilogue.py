"""Epilogue IR: a user's epilogue traced into a flat, hashable SSA program.

The user writes ``epilogue(acc, *operands, **scalars)`` in plain ``jax.numpy``. We trace it
with ``jax.make_jaxpr``, inline the calls JAX wraps around library functions (``jit``,
``custom_jvp_call``, ...), and keep only whitelisted elementwise primitives and the sum, max
and min reductions. The result is an :class:`EpilogueIR`: value ``i < len(inputs)`` is an
input (the accumulator, then each operand, each already converted to the epilogue dtype),
value ``len(inputs) + j`` is the result of ``instrs[j]``. Every value is held in its canonical
shape: broadcast against the (L, M, N) tile, with size 1 along the axes it does not vary
over (a sum over M is (1, N)). The reference evaluates the program with ``jax.numpy``; the
kernels evaluate the same program on register fragments.

Reductions: a primitive's program (what one fused GEMM computes) has only elementwise
instructions, and an output may be a reduction of one of its values over M, N or both
(``Output.reduce``). A traced program may reduce anywhere: :func:`split_at_reductions` gives
the GEMM the part up to the first reductions (what is consumed past them is stored in the
epilogue dtype) and evaluates the rest in XLA.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .arguments import is_8bit_float

__all__ = [
    "Role",
    "Input",
    "Instr",
    "Output",
    "EpilogueIR",
    "EpilogueError",
    "OPS",
    "trace_epilogue",
    "evaluate",
    "canonical_shape",
    "identity_ir",
    "exact",
    "with_acc_output",
    "REDUCTIONS",
    "output_shape",
    "Split",
    "split_at_reductions",
]


class EpilogueError(ValueError):
    """An epilogue that cannot be fused: the message names the cause and the fix."""


class Role(str, enum.Enum):
    """How an epilogue input maps onto the (M, N) output tile (an optional batch L leads)."""

    ACC = "acc"  # the accumulator, (M, N)
    TILE = "tile"  # (M, N) or (L, M, N)
    ROW = "row"  # one value per column n: (1, N) or (L, 1, N), broadcast over rows (a bias)
    COL = "col"  # one value per row m: (M, 1) or (L, M, 1), broadcast over columns
    SCALAR = "scalar"  # one value: () or (L, 1, 1), read at run time


@dataclasses.dataclass(frozen=True)
class Input:
    role: Role
    dtype: str  # storage dtype; the program sees it converted to the epilogue dtype
    name: str  # the user's name for it: "acc", "operand 0", "scalar 'alpha'"


def exact(value: Any) -> Any:
    """A key for a constant that tells apart what ``==`` does not (-0.0 from 0.0; 1 from 1.0
    from True) and holds NaN equal to itself, so programs that differ only there neither share
    a trace nor a compiled kernel."""
    if isinstance(value, (float, np.floating)):
        return ("float", float(value).hex())
    return (type(value).__name__, value)


@dataclasses.dataclass(frozen=True, eq=False)
class Instr:
    op: str  # a key of OPS
    args: tuple[int, ...]  # value ids
    dtype: str  # result dtype
    attr: Any = None  # "const": the value; "integer_pow": the exponent; "convert": unused

    def _key(self) -> tuple:
        return (self.op, self.args, self.dtype, exact(self.attr))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Instr) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# the reductions an epilogue may use: jaxpr primitive -> our kind
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
_AXES = ("l", "m", "n")  # the tile's axes: batch, rows, columns


@dataclasses.dataclass(frozen=True)
class Output:
    name: str
    value: int
    dtype: str  # storage dtype of the output
    reduce: str | None = None  # "sum", "max" or "min" of ``value`` over the axes ``over``
    over: tuple[str, ...] = ()  # a subset of ("m", "n"): per batch, never over L


def output_shape(out: Output, tile_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The canonical shape of ``out`` for a tile of ``tile_shape`` ((M, N) or (L, M, N)):
    the tile's, with size 1 along the axes it reduces."""
    names = _AXES[-len(tile_shape):]
    return tuple(1 if a in out.over else d for a, d in zip(names, tile_shape))


@dataclasses.dataclass(frozen=True)
class EpilogueIR:
    inputs: tuple[Input, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[Output, ...]
    epi_dtype: str

    @property
    def operands(self) -> tuple[Input, ...]:
        """The inputs after the accumulator, in the order the primitive takes them."""
        return self.inputs[1:]

    @property
    def fingerprint(self) -> str:
        """A stable key: the same program gives the same key in every process."""
        text = repr((self.epi_dtype, self.inputs, self.instrs, self.outputs))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def with_outputs(self, outputs: Sequence[Output]) -> EpilogueIR:
        return dataclasses.replace(self, outputs=tuple(outputs))

    def live(self) -> set[int]:
        """The values some output depends on."""
        live = {o.value for o in self.outputs}
        base = len(self.inputs)
        for j in reversed(range(len(self.instrs))):
            if base + j in live:
                live.update(self.instrs[j].args)
        return live

    def uses(self, value: int) -> bool:
        """Whether any output depends on ``value``."""
        return value in self.live()

    def pruned(self) -> EpilogueIR:
        """The program without the instructions no output uses, renumbered."""
        n_in, live = len(self.inputs), self.live()
        new_id = {i: i for i in range(n_in)}
        instrs: list[Instr] = []
        for j, ins in enumerate(self.instrs):
            if n_in + j in live:
                instrs.append(dataclasses.replace(ins, args=tuple(new_id[a] for a in ins.args)))
                new_id[n_in + j] = n_in + len(instrs) - 1
        return dataclasses.replace(self, instrs=tuple(instrs), outputs=tuple(
            dataclasses.replace(o, value=new_id[o.value]) for o in self.outputs))

    @property
    def reduces(self) -> bool:
        """Whether the program reduces anywhere (an instruction or an output)."""
        return any(o.reduce for o in self.outputs) or any(i.op == "reduce" for i in self.instrs)


def _const(value: Any, dtype: str) -> Any:
    return np.asarray(value, dtype=dtype)


# op name -> (arity, jnp implementation). The kernels keep their own table with the same keys.
OPS: dict[str, tuple[int, Callable[..., Any]]] = {
    "add": (2, jnp.add),
    "sub": (2, jnp.subtract),
    "mul": (2, jnp.multiply),
    "div": (2, jnp.divide),
    "max": (2, jnp.maximum),
    "min": (2, jnp.minimum),
    "pow": (2, jnp.power),
    "eq": (2, jnp.equal),
    "ne": (2, jnp.not_equal),
    "lt": (2, jnp.less),
    "le": (2, jnp.less_equal),
    "gt": (2, jnp.greater),
    "ge": (2, jnp.greater_equal),
    "and": (2, jnp.logical_and),
    "or": (2, jnp.logical_or),
    "not": (1, jnp.logical_not),
    "neg": (1, jnp.negative),
    "abs": (1, jnp.abs),
    "sign": (1, jnp.sign),
    "floor": (1, jnp.floor),
    "ceil": (1, jnp.ceil),
    "exp": (1, jnp.exp),
    "exp2": (1, jnp.exp2),
    "log": (1, jnp.log),
    "log1p": (1, jnp.log1p),
    "expm1": (1, jnp.expm1),
    "tanh": (1, jnp.tanh),
    "logistic": (1, jax.nn.sigmoid),
    "erf": (1, lax.erf),
    "erfc": (1, lax.erfc),
    "sqrt": (1, jnp.sqrt),
    "rsqrt": (1, lax.rsqrt),
    "sin": (1, jnp.sin),
    "cos": (1, jnp.cos),
    "tan": (1, jnp.tan),
    "select": (3, lambda p, on_false, on_true: jnp.where(p, on_true, on_false)),
    "stop_gradient": (1, lax.stop_gradient),  # the identity, but to autodiff (softmax's max)
    "integer_pow": (1, None),  # attr = exponent
    "convert": (1, None),  # to Instr.dtype
    "const": (0, None),  # attr = value
    "reduce": (1, None),  # attr = (kind, axes): a REDUCTIONS kind over a subset of ("l", "m", "n")
}

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


def canonical_shape(role: Role, batch: int | None, m: int, n: int) -> tuple[int, ...]:
    """The shape an input of ``role`` has as a primitive operand."""
    core = {Role.ACC: (m, n), Role.TILE: (m, n), Role.ROW: (1, n), Role.COL: (m, 1)}.get(role)
    if role is Role.SCALAR:
        return () if batch is None else (batch, 1, 1)
    return core if batch is None else (batch, *core)


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
        self.axes = _AXES[-len(acc_shape):]
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
        if None in long or long != sorted(set(long), key=_AXES.index) or misplaced:
            raise EpilogueError(
                f"the epilogue moves an axis at {self.where(eqn)} (a value of shape {shape} along "
                f"{[_AXIS_WORDS.get(a, 'no axis') for a in axes]}); only NumPy-style broadcasting "
                "against the (M, N) tile is elementwise. Pass a column vector as shape (M, 1) "
                "rather than transposing a row vector."
            )
        return tuple(None if d == 1 and a in long else a for a, d in zip(axes, shape))

    def reduction(self, eqn: Any, kind: str, x: int, axes: tuple, shape: tuple) -> tuple[int, tuple]:
        """A sum, max or min over some of the tile's axes: over M and N in one instruction,
        over L (whose batches the kernels reduce apart) in a second. Dimensions of length 1
        reduce to themselves."""
        dims = tuple(eqn.params["axes"])
        over = {axes[d] for d in dims if shape[d] != 1}
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
) -> tuple[EpilogueIR, Any, list[Role], list[bool]]:
    """Trace ``fn(acc, *operands, **scalars)`` into an :class:`EpilogueIR`.

    Returns the IR, the output structure (for rebuilding a dict/tuple), and for each
    operand (positional, then the dynamic scalars by sorted name) its role and whether it
    carries the batch dimension.
    """
    epi = np.dtype(epi_dtype)
    if not jnp.issubdtype(epi, jnp.floating):
        raise TypeError(f"epi_dtype must be a floating dtype, got {epi}.")
    roles, batched = [], []
    inputs = [Input(Role.ACC, epi.name, "acc")]
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

    def wrapped(acc, *args):
        kw = dict(static_scalars)
        kw.update(zip(dyn_names, args[n_pos:]))
        return fn(acc, *args[:n_pos], **kw)

    scalar_avals = [jax.ShapeDtypeStruct((), epi) for _ in dyn_names]
    try:
        closed, out_shape = jax.make_jaxpr(wrapped, return_shape=True)(
            jax.ShapeDtypeStruct(tuple(acc_shape), epi), *avals, *scalar_avals
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
    in_axes = [builder.aligned(tuple(acc_shape))] + [builder.aligned(tuple(a.shape)) for a in avals + scalar_avals]
    flat_out = builder.run(closed.jaxpr, closed.consts, list(zip(range(len(inputs)), in_axes)))
    ir = EpilogueIR(tuple(inputs), tuple(builder.instrs), (), epi.name)
    reduced = _after_reduction(ir)
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


def _after_reduction(ir: EpilogueIR) -> list[bool]:
    """For each value, whether it is a reduction or depends on one."""
    after = [False] * len(ir.inputs)
    for ins in ir.instrs:
        after.append(ins.op == "reduce" or any(after[a] for a in ins.args))
    return after


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


def _reduced(x: Any, kind: str, axes: Sequence[str], shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` (broadcast against a tile of ``shape``) reduced over ``axes``, keeping them as size
    1: floats accumulate in at least float32, integers in at least int32; the result in
    ``dtype``."""
    names = _AXES[-len(shape):]
    dims = tuple(names.index(a) for a in axes)
    x = jnp.asarray(x)
    along = tuple(d if names[i] in axes else 1 for i, d in enumerate(shape))
    x = jnp.broadcast_to(x, jnp.broadcast_shapes(x.shape, along))
    wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
    x = x.astype(jnp.promote_types(x.dtype, wide))
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind]
    return fn(x, axis=dims, keepdims=True).astype(dtype)


def evaluate(ir: EpilogueIR, acc: Any, operands: Sequence[Any], *, given: Mapping[int, Any] | None = None,
             shape: tuple[int, ...] | None = None) -> list[Any]:
    """Run the program with ``jax.numpy`` on arrays in their canonical shapes; returns the
    outputs in their storage dtypes. This is the reference the kernels are checked against.

    Only the values the outputs need are computed; ``given`` supplies some of them (the rest
    of a program :func:`split_at_reductions` split, with ``acc`` None), and ``shape`` is the
    tile's (by default the inputs' broadcast shape)."""
    epi = jnp.dtype(ir.epi_dtype)
    n_in = len(ir.inputs)
    inputs = [acc, *operands]
    if shape is None:
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in inputs))
    values: dict[int, Any] = dict(given or {})
    needed, stack = set(), [o.value for o in ir.outputs]
    while stack:
        v = stack.pop()
        if v not in needed and v not in values:
            needed.add(v)
            stack.extend(ir.instrs[v - n_in].args if v >= n_in else ())
    reduced = _after_reduction(ir)
    for v in sorted(needed):
        if v < n_in:
            values[v] = jnp.asarray(inputs[v]).astype(epi)
            continue
        ins = ir.instrs[v - n_in]
        args = [values[a] for a in ins.args]
        if ins.op == "const":
            values[v] = jnp.asarray(_const(ins.attr, ins.dtype))
        elif ins.op == "convert":
            values[v] = args[0].astype(ins.dtype)
        elif ins.op == "integer_pow":
            values[v] = lax.integer_pow(args[0], ins.attr)
        elif ins.op == "reduce":
            values[v] = _reduced(args[0], *ins.attr, shape, ins.dtype)
        else:
            values[v] = OPS[ins.op][1](*args).astype(ins.dtype)
    outs = []
    for o in ir.outputs:
        # an output that is the accumulator itself is stored from it, not from its epilogue-dtype
        # copy: an int32 accumulator stays exact past float32's 24 bits
        v = acc if o.value == 0 and acc is not None else values[o.value]
        if o.reduce:
            v = _reduced(v, o.reduce, o.over, shape, _accumulation_dtype(v))
        elif reduced[o.value] or o.value in (given or {}):
            v = jnp.broadcast_to(v, jnp.broadcast_shapes(jnp.shape(v), (1,) * len(shape)))
        else:
            v = jnp.broadcast_to(v, shape)
        outs.append(store_as(v, o.dtype))
    return outs


def _accumulation_dtype(x: Any) -> Any:
    wide = jnp.float32 if jnp.issubdtype(jnp.result_type(x), jnp.floating) else jnp.int32
    return jnp.promote_types(jnp.result_type(x), wide)


@dataclasses.dataclass(frozen=True)
class Split:
    """A traced program split at its first reductions: what one fused GEMM computes (elementwise,
    reductions only as outputs), and how the traced program's outputs come from it."""

    gemm: EpilogueIR
    direct: tuple[int | None, ...]  # per traced output: its index among gemm's, or None (computed after)
    given: tuple[tuple[int, int], ...]  # (traced value, index among gemm's outputs) read after

    def finish(self, ir: EpilogueIR, outs: Sequence[Any], operands: Sequence[Any],
               shape: tuple[int, ...]) -> list[Any]:
        """The traced program ``ir``'s outputs from the GEMM's outputs ``outs``."""
        if None not in self.direct:
            return [outs[d] for d in self.direct]
        rest = ir.with_outputs([o for o, d in zip(ir.outputs, self.direct) if d is None])
        later = iter(evaluate(rest, None, operands, given={v: outs[i] for v, i in self.given}, shape=shape))
        return [outs[d] if d is not None else next(later) for d in self.direct]


def split_at_reductions(ir: EpilogueIR) -> Split:
    """Split a traced program where it consumes a reduction. The GEMM computes every value that
    depends on no reduction, and the reductions of those over M and N (its outputs);
    reductions of reductions, reductions over L and what uses a reduction are evaluated in XLA
    from the GEMM's outputs: the reductions and every value of a tile's size they need (in
    its own dtype: the epilogue's, so nothing is rounded in between). Values that do not span
    the tile (of row, column and scalar operands) are recomputed there."""
    n_in = len(ir.inputs)
    if not any(i.op == "reduce" for i in ir.instrs):
        return Split(ir, tuple(range(len(ir.outputs))), ())
    after = _after_reduction(ir)
    heavy = [i == 0 or x.role is Role.TILE for i, x in enumerate(ir.inputs)]
    first: dict[int, tuple[str, tuple[str, ...], int]] = {}
    for j, ins in enumerate(ir.instrs):
        heavy.append(any(heavy[a] for a in ins.args))
        kind, axes = ins.attr if ins.op == "reduce" else (None, ())
        if ins.op == "reduce" and not after[ins.args[0]] and "l" not in axes:
            first[n_in + j] = (kind, axes, ins.args[0])

    def in_gemm(v: int) -> bool:
        return not after[v] or v in first

    def output(name: str, v: int, dtype: str) -> Output:
        if v in first:
            kind, axes, arg = first[v]
            return Output(name, arg, dtype, kind, axes)
        return Output(name, v, dtype)

    outputs: list[Output] = []
    direct: list[int | None] = []
    for o in ir.outputs:
        direct.append(len(outputs) if in_gemm(o.value) else None)
        if in_gemm(o.value):
            outputs.append(output(o.name, o.value, o.dtype))
    given, stack, seen = set(), [o.value for o, d in zip(ir.outputs, direct) if d is None], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if in_gemm(v):
            if heavy[v] or v in first:
                given.add(v)
        elif v >= n_in:
            stack.extend(ir.instrs[v - n_in].args)
    read = []
    for v in sorted(given):
        read.append((v, len(outputs)))
        dtype = ir.inputs[v].dtype if v < n_in else ir.instrs[v - n_in].dtype
        outputs.append(output(f"__value{v}__", v, dtype))
    gemm = ir.with_outputs(outputs).pruned()
    return Split(gemm, tuple(direct), tuple(read))


def restructure(structure: Any, ir: EpilogueIR, outs: list[Any]) -> Any:
    """``ir``'s outputs ``outs`` (canonical shapes) in the structure and shapes the epilogue
    returned them in (an array, a tuple, a dict), as ``trace_epilogue`` recorded it."""
    kind, keys, leaves = structure
    outs = [_as_leaf(o, *leaf) for o, leaf in zip(outs, leaves)]
    if kind == "dict":
        by_name = dict(zip([o.name for o in ir.outputs], outs))
        return {k: by_name[str(k)] for k in keys}
    if kind == "tuple":
        return tuple(outs)
    return outs[0]


def _as_leaf(out: Any, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> Any:
    """A canonical output in the shape the epilogue gave it (a sum over M of an (M, N) value
    is (1, N) here, (N,) there)."""
    if tuple(out.shape) == tuple(shape):
        return out
    sizes = dict(zip(_AXES[-out.ndim:], out.shape))
    return jnp.broadcast_to(out.reshape([sizes.get(a, 1) for a in axes]), shape)


def store_as(v: Any, dtype: Any) -> Any:
    """``v`` converted to an output's dtype as the kernels store it: to 8-bit floats rounded to
    nearest even and saturated to the finite range (NaN stays NaN; e4m3fn has no Inf, and a
    plain cast would make an overflow NaN); to integers saturated (floats rounded toward zero,
    as XLA converts them; an int32 accumulator clipped, where a plain cast would wrap); to
    other dtypes by a plain cast."""
    dtype = jnp.dtype(dtype)
    if is_8bit_float(dtype):
        top = float(jnp.finfo(dtype).max)
        v = jnp.clip(v, -top, top)
    elif jnp.issubdtype(dtype, jnp.integer) and jnp.dtype(v.dtype) != dtype:
        info = jnp.iinfo(dtype)
        v = jnp.clip(v, info.min, info.max)
    return v.astype(dtype)


def identity_ir(out_dtype: Any, epi_dtype: Any = jnp.float32) -> EpilogueIR:
    """The plain GEMM: the accumulator, converted to ``out_dtype``."""
    epi = np.dtype(epi_dtype).name
    return EpilogueIR((Input(Role.ACC, epi, "acc"),), (), (Output("0", 0, np.dtype(out_dtype).name),), epi)


def with_acc_output(ir: EpilogueIR, dtype: Any) -> EpilogueIR:
    """``ir`` with the accumulator appended as an extra output in ``dtype`` (a residual that the
    backward pass reads)."""
    return ir.with_outputs(ir.outputs + (Output("__acc__", 0, np.dtype(dtype).name),))
