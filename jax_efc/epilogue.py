"""Epilogue IR: a user's elementwise epilogue traced into a flat, hashable SSA program.

The user writes ``epilogue(acc, *operands, **scalars)`` in plain ``jax.numpy``. We trace it
with ``jax.make_jaxpr``, inline the calls JAX wraps around library functions (``jit``,
``custom_jvp_call``, ...), and keep only whitelisted elementwise primitives. The result is an
:class:`EpilogueIR`: value ``i < len(inputs)`` is an input (the accumulator, then each
operand, each already converted to the epilogue dtype), value ``len(inputs) + j`` is the
result of ``instrs[j]``. The reference evaluates the program with ``jax.numpy``; the kernels
evaluate the same program on register fragments.
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


@dataclasses.dataclass(frozen=True)
class Output:
    name: str
    value: int
    dtype: str  # storage dtype of the output


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
    "integer_pow": (1, None),  # attr = exponent
    "convert": (1, None),  # to Instr.dtype
    "const": (0, None),  # attr = value
}

# jaxpr primitive name -> our op name (None: an identity)
_PRIMITIVES: dict[str, str | None] = {
    **{name: name for name in OPS if name not in ("select", "not", "convert", "const")},
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
    """Walks a jaxpr and emits instructions; values are deduplicated (CSE)."""

    def __init__(self, inputs: list[Input], acc_shape: tuple[int, ...]):
        self.inputs = inputs
        self.instrs: list[Instr] = []
        self.acc_shape = acc_shape
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

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[int]) -> list[int]:
        env: dict[Any, int] = {}

        def read(atom: Any) -> int:
            if hasattr(atom, "val"):  # a Literal
                return self.const(atom.val, atom.aval.dtype)
            return env[atom]

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c, np.asarray(c).dtype)
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(x) for x in eqn.invars])
            for var, vid in zip(eqn.outvars, outs):
                env[var] = vid
        return [read(x) for x in jaxpr.outvars]

    def eqn(self, eqn: Any, args: list[int]) -> list[int]:
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
        if name == "broadcast_in_dim":
            (x,) = args
            in_rank = len(eqn.invars[0].aval.shape)
            out_rank = len(eqn.params["shape"])
            if tuple(eqn.params["broadcast_dimensions"]) != tuple(range(out_rank - in_rank, out_rank)):
                raise EpilogueError(
                    f"the epilogue broadcasts a value of shape {eqn.invars[0].aval.shape} to "
                    f"{tuple(eqn.params['shape'])} along dimensions {eqn.params['broadcast_dimensions']} "
                    f"at {self.where(eqn)}; only NumPy-style broadcasting is elementwise. Pass a column "
                    "vector as shape (M, 1) rather than transposing a row vector."
                )
            return [x]
        if name in ("reshape", "squeeze", "expand_dims"):
            in_shape = tuple(eqn.invars[0].aval.shape)
            out_shape = tuple(eqn.outvars[0].aval.shape)
            if tuple(d for d in in_shape if d != 1) == tuple(d for d in out_shape if d != 1) and (
                _right_aligned(in_shape, out_shape)
            ):
                return args
            raise EpilogueError(
                f"the epilogue reshapes {in_shape} to {out_shape} at {self.where(eqn)}; an epilogue must "
                "be elementwise over the (M, N) tile."
            )
        op = _PRIMITIVES.get(name, "unsupported")
        if op == "unsupported":
            raise EpilogueError(
                f"the epilogue uses `{name}` at {self.where(eqn)}, which is not an elementwise operation "
                "jax_efc can fuse. Supported: arithmetic, comparisons, where/select, min/max, "
                "abs/neg/sign, exp/exp2/log/log1p/expm1, tanh/sigmoid/erf, sqrt/rsqrt, pow, "
                "sin/cos/tan, casts. Compute it outside the epilogue (before or after the GEMM)."
            )
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


def _right_aligned(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether a reshape between ``a`` and ``b`` only adds or drops leading unit dimensions."""
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    return long[len(long) - len(short):] == short and all(d == 1 for d in long[: len(long) - len(short)])


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
        if leaf is None or tuple(getattr(leaf, "shape", ())) != tuple(acc_shape):
            got = "is None" if leaf is None else f"has shape {tuple(getattr(leaf, 'shape', ()))}"
            raise EpilogueError(
                f"epilogue output {name!r} {got}; every output must be an array elementwise over the "
                f"accumulator, shape {tuple(acc_shape)}."
            )
    builder = _Builder(inputs, tuple(acc_shape))
    flat_out = builder.run(closed.jaxpr, closed.consts, list(range(len(inputs))))
    dtypes = _resolve_out_dtypes(out_dtypes, names, structure, default_out_dtype)
    outputs = tuple(Output(nm, vid, dt) for nm, vid, dt in zip(names, flat_out, dtypes))
    ir = EpilogueIR(tuple(inputs), tuple(builder.instrs), outputs, epi.name)
    return ir, structure, roles, batched


def _resolve_out_dtypes(out_dtypes: Any, names: list[str], structure: Any, default: Any) -> list[str]:
    kind, keys = structure
    if out_dtypes is None:
        return [np.dtype(default).name] * len(names)
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


def evaluate(ir: EpilogueIR, acc: Any, operands: Sequence[Any]) -> list[Any]:
    """Run the program with ``jax.numpy`` on arrays in their canonical shapes; returns the
    outputs in their storage dtypes. This is the reference the kernels are checked against."""
    epi = jnp.dtype(ir.epi_dtype)
    values: list[Any] = [acc.astype(epi)] + [jnp.asarray(x).astype(epi) for x in operands]
    for ins in ir.instrs:
        args = [values[a] for a in ins.args]
        if ins.op == "const":
            values.append(jnp.asarray(_const(ins.attr, ins.dtype)))
        elif ins.op == "convert":
            values.append(args[0].astype(ins.dtype))
        elif ins.op == "integer_pow":
            values.append(lax.integer_pow(args[0], ins.attr))
        else:
            values.append(OPS[ins.op][1](*args).astype(ins.dtype))
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in values[: len(ir.inputs)]))
    # an output that is the accumulator itself is stored from it, not from its epilogue-dtype
    # copy: an int32 accumulator stays exact past float32's 24 bits
    return [store_as(jnp.broadcast_to(acc if o.value == 0 else values[o.value], shape), o.dtype)
            for o in ir.outputs]


def restructure(structure: Any, ir: EpilogueIR, outs: list[Any]) -> Any:
    """``ir``'s outputs ``outs`` in the structure the epilogue returned them in (an array, a
    tuple, a dict), as ``trace_epilogue`` recorded it."""
    kind, keys = structure
    if kind == "dict":
        by_name = dict(zip([o.name for o in ir.outputs], outs))
        return {k: by_name[str(k)] for k in keys}
    if kind == "tuple":
        return tuple(outs)
    return outs[0]


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
