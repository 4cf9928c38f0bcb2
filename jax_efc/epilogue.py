"""Epilogue IR: a user's epilogue as a flat, hashable SSA program (``tracing`` builds it).

An :class:`EpilogueIR`'s value ``i < len(inputs)`` is an
input (the accumulator, or for a gated GEMM the gate's and the up projection's, then each
operand, each already converted to the epilogue dtype),
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
from .gated import split_gated

__all__ = [
    "Role",
    "Input",
    "Instr",
    "Output",
    "EpilogueIR",
    "EpilogueError",
    "OPS",
    "evaluate",
    "evaluate_product",
    "canonical_shape",
    "identity_ir",
    "exact",
    "with_acc_output",
    "accumulators",
    "after_reduction",
    "output_shape",
    "renumbered",
    "with_masked_stores",
    "masked_stores",
    "Split",
    "split_at_reductions",
    "rows_in_tile",
    "in_tile_reason",
    "reads_tile",
    "ROW_TILE_N",
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


AXES = ("l", "m", "n")  # the tile's axes: batch, rows, columns


@dataclasses.dataclass(frozen=True)
class Output:
    name: str
    value: int
    dtype: str  # storage dtype of the output
    reduce: str | None = None  # "sum", "max" or "min" of ``value`` over the axes ``over``
    over: tuple[str, ...] = ()  # a subset of ("m", "n"): per batch, never over L
    inplace: int | None = None  # the operand (its index among the operands) it is written over
    # an in-place output ``where(m, new, c)`` over its operand c, read nowhere else: the value
    # of the bool where it is stored (c elsewhere is left as it is; ``masked_stores``)
    mask: int | None = None
    transposed: bool = False  # stored as its transpose, (N, M) or (L, N, M): M contiguous
    # a reduction the kernel's tiles fold into the result by global atomics, in no fixed order,
    # rather than leave per-tile partials for XLA (``gemm(deterministic=False)``)
    atomic: bool = False


def output_shape(out: Output, tile_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The canonical shape of ``out`` for a tile of ``tile_shape`` ((M, N) or (L, M, N)):
    the tile's, with size 1 along the axes it reduces, or its last two swapped where ``out``
    is stored transposed."""
    names = AXES[-len(tile_shape):]
    shape = tuple(1 if a in out.over else d for a, d in zip(names, tile_shape))
    return (*shape[:-2], shape[-1], shape[-2]) if out.transposed else shape


def renumbered(out: Output, new_id: Mapping[int, int]) -> Output:
    """``out`` with its values moved by ``new_id``."""
    return dataclasses.replace(out, value=new_id[out.value], mask=None if out.mask is None else new_id[out.mask])


@dataclasses.dataclass(frozen=True)
class EpilogueIR:
    inputs: tuple[Input, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[Output, ...]
    epi_dtype: str
    # a gated GEMM's block width (``jax_efc.gated``): the product has 2N columns, gate and up
    # blocks of this width in turn, and the program reads two accumulators of N columns, the
    # gate's and the up projection's (inputs 0 and 1); 0 for a plain GEMM
    gated: int = 0

    @property
    def n_acc(self) -> int:
        """How many accumulator inputs lead the inputs: 2 for a gated GEMM, else 1."""
        return 2 if self.gated else 1

    @property
    def operands(self) -> tuple[Input, ...]:
        """The inputs after the accumulators, in the order the primitive takes them."""
        return self.inputs[self.n_acc:]

    @property
    def fingerprint(self) -> str:
        """A stable key: the same program gives the same key in every process."""
        gated = (self.gated,) if self.gated else ()  # plain programs keep the keys they had
        text = repr((self.epi_dtype, self.inputs, self.instrs, self.outputs, *gated))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def with_outputs(self, outputs: Sequence[Output]) -> EpilogueIR:
        return dataclasses.replace(self, outputs=tuple(outputs))

    def untransposed(self) -> EpilogueIR:
        """The program with every output in the tile's own layout, (M, N): what the
        epilogue's VJP differentiates, its cotangents transposed back first."""
        return self.with_outputs([dataclasses.replace(o, transposed=False) for o in self.outputs])

    def live(self) -> set[int]:
        """The values some output depends on."""
        live = {o.value for o in self.outputs} | {o.mask for o in self.outputs if o.mask is not None}
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
        return dataclasses.replace(self, instrs=tuple(instrs), outputs=tuple(renumbered(o, new_id)
                                                                            for o in self.outputs))

    @property
    def reductions(self) -> tuple[Instr, ...]:
        """The reduction instructions: the reductions the program consumes (an output that
        reduces is ``Output.reduce``)."""
        return tuple(i for i in self.instrs if i.op == "reduce")

    @property
    def reduces(self) -> bool:
        """Whether the program reduces anywhere (an instruction or an output)."""
        return any(o.reduce for o in self.outputs) or bool(self.reductions)


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

def canonical_shape(role: Role, batch: int | None, m: int, n: int) -> tuple[int, ...]:
    """The shape an input of ``role`` has as a primitive operand."""
    core = {Role.ACC: (m, n), Role.TILE: (m, n), Role.ROW: (1, n), Role.COL: (m, 1)}.get(role)
    if role is Role.SCALAR:
        return () if batch is None else (batch, 1, 1)
    return core if batch is None else (batch, *core)


def _flows(ir: EpilogueIR, seeds: Sequence[bool], *, reductions: bool | None = None) -> list[bool]:
    """For each value, whether it depends on an input marked in ``seeds``; a reduction's result
    as its argument's (``reductions`` None), or ``reductions`` itself."""
    flag = list(seeds)
    for ins in ir.instrs:
        flag.append(reductions if ins.op == "reduce" and reductions is not None
                    else any(flag[a] for a in ins.args))
    return flag


def after_reduction(ir: EpilogueIR) -> list[bool]:
    """For each value, whether it is a reduction or depends on one."""
    return _flows(ir, [False] * len(ir.inputs), reductions=True)


def _reduced(x: Any, kind: str, axes: Sequence[str], shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` broadcast to a tile of ``shape`` and reduced over ``axes``, keeping them as size
    1: floats accumulate in at least float32, integers in at least int32, and max and min keep
    NaN; the result in ``dtype``."""
    names = AXES[-len(shape):]
    dims = tuple(names.index(a) for a in axes)
    # over the whole tile, as the kernels evaluate every value at every element of it
    x = jnp.broadcast_to(jnp.asarray(x), shape)
    wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
    x = x.astype(jnp.promote_types(x.dtype, wide))
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind]
    out = fn(x, axis=dims, keepdims=True)
    if kind != "sum" and jnp.issubdtype(x.dtype, jnp.floating):
        # a NaN wins, as in the kernels (XLA's CPU reductions may drop it)
        out = jnp.where(jnp.isnan(x).any(axis=dims, keepdims=True), jnp.nan, out)
    return out.astype(dtype)


def evaluate(ir: EpilogueIR, acc: Any, operands: Sequence[Any], *, given: Mapping[int, Any] | None = None,
             shape: tuple[int, ...] | None = None) -> list[Any]:
    """Run the program with ``jax.numpy`` on arrays in their canonical shapes; returns the
    outputs in their storage dtypes and layouts (a transposed output as its transpose). This is
    the reference the kernels are checked against.

    Only the values the outputs need are computed; ``given`` supplies some of them (the rest
    of a program :func:`split_at_reductions` split, with ``acc`` None), and ``shape`` is the
    tile's (by default the inputs' broadcast shape)."""
    epi = jnp.dtype(ir.epi_dtype)
    n_in = len(ir.inputs)
    inputs = [*accumulators(ir, acc), *operands]
    if shape is None:
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in inputs))
    values: dict[int, Any] = dict(given or {})
    needed, stack = set(), [o.value for o in ir.outputs]
    while stack:
        v = stack.pop()
        if v not in needed and v not in values:
            needed.add(v)
            stack.extend(ir.instrs[v - n_in].args if v >= n_in else ())
    reduced = after_reduction(ir)
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
        v = inputs[o.value] if o.value < ir.n_acc and inputs[o.value] is not None else values[o.value]
        if o.reduce:
            v = _reduced(v, o.reduce, o.over, shape, _accumulation_dtype(v))
        elif reduced[o.value] or o.value in (given or {}):
            v = jnp.broadcast_to(v, jnp.broadcast_shapes(jnp.shape(v), (1,) * len(shape)))
        else:
            v = jnp.broadcast_to(v, shape)
        v = store_as(v, o.dtype)
        outs.append(jnp.swapaxes(v, -1, -2) if o.transposed else v)
    return outs


def evaluate_product(ir: EpilogueIR, product: Any, operands: Sequence[Any]) -> list[Any]:
    """:func:`evaluate` on the GEMM's product: for a gated program, (..., M, 2N) in the gated
    layout, split into its gate and up halves first."""
    return evaluate(ir, split_gated(product, ir.gated) if ir.gated else product, operands)


def accumulators(ir: EpilogueIR, acc: Any) -> tuple[Any, ...]:
    """``acc`` as the program's accumulator inputs: for a gated program the pair (gate, up)
    it is (or None for both), else ``acc`` alone."""
    if not ir.gated:
        return (acc,)
    return (None, None) if acc is None else tuple(acc)


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


# the widest rows whose consumed reductions the GEMM finishes inside one tile. Tiles reach 256
# columns, but a row softmax of 16384 x 256 x 4096 took 0.094-0.101 ms there on an H200, against
# XLA's 0.059-0.061 (its kernel 88 us in 128x256 tiles, where bias+gelu_tanh's took 49), and at
# 128 columns 0.059 against 0.049-0.064 (benchmarks/FINDINGS.md, "Eighth sitting")
ROW_TILE_N = 128


def rows_in_tile(ir: EpilogueIR, n: int) -> bool:
    """Whether one kernel tile can run all of ``ir``, rows of ``n`` columns: it consumes a
    reduction, :func:`in_tile_reason` finds nothing against it, and a tile as wide as the row
    holds all of it (``ROW_TILE_N``)."""
    n_in = len(ir.inputs)
    consumed = {a for i in ir.instrs for a in i.args if a >= n_in and ir.instrs[a - n_in].op == "reduce"}
    return n <= ROW_TILE_N and bool(consumed) and in_tile_reason(ir) is None


def in_tile_reason(ir: EpilogueIR) -> str | None:
    """Why a tile that spans the rows cannot finish the reductions ``ir`` consumes (None: it
    can): each must be over N alone (a row softmax, a row norm), of a value that reads no tile
    operand (those reach the kernel a subtile at a time, as it stores), in a program not gated."""
    if ir.gated:
        return "gated GEMMs do not consume reductions inside the kernel; XLA computes what uses them."
    for ins in ir.reductions:
        if ins.attr[1] != ("n",):
            return (f"the epilogue consumes a {ins.attr[0]} over {ins.attr[1]}; the kernel finishes only "
                    "reductions over N (a row's), inside a tile as wide as the row.")
    tiles = reads_tile(ir)
    if any(tiles[i.args[0]] for i in ir.reductions):
        return ("the epilogue reduces a value that reads a tile operand; the kernel reads those only as it "
                "stores, after its reductions, so XLA computes what uses them.")
    return None


def reads_tile(ir: EpilogueIR) -> list[bool]:
    """For each value, whether it reads a tile operand."""
    return _flows(ir, [x.role is Role.TILE for x in ir.inputs])


def split_at_reductions(ir: EpilogueIR, rows_in_tile: bool = False) -> Split:
    """Split a traced program where it consumes a reduction. The GEMM computes every value that
    depends on no reduction, and the reductions of those over M and N (its outputs);
    reductions of reductions, reductions over L and what uses a reduction are evaluated in XLA
    from the GEMM's outputs: the reductions and every value of a tile's size they need (in
    its own dtype: the epilogue's, so nothing is rounded in between). Values that do not span
    the tile (of row, column and scalar operands) are recomputed there.

    ``rows_in_tile`` (where :func:`rows_in_tile` holds): the GEMM also computes what uses the
    reductions, each tile finishing its rows' reductions before it stores (the kernels'
    ``row_stats``); XLA computes only outputs one value per row (``log(sum(exp(x)))``) from the
    reductions, which the GEMM outputs."""
    n_in = len(ir.inputs)
    if not ir.reductions:
        return Split(ir, tuple(range(len(ir.outputs))), ())
    after = after_reduction(ir)
    heavy = _flows(ir, [i < ir.n_acc or x.role is Role.TILE for i, x in enumerate(ir.inputs)])
    first: dict[int, tuple[str, tuple[str, ...], int]] = {}
    for j, ins in enumerate(ir.instrs):
        kind, axes = ins.attr if ins.op == "reduce" else (None, ())
        if ins.op == "reduce" and (rows_in_tile or (not after[ins.args[0]] and "l" not in axes)):
            first[n_in + j] = (kind, axes, ins.args[0])
    # (in the tile) the values that vary along N: the accumulator's, a tile's or a row's, not
    # through a reduction (over N)
    spans = (_flows(ir, [i < ir.n_acc or x.role in (Role.TILE, Role.ROW) for i, x in enumerate(ir.inputs)],
                    reductions=False) if rows_in_tile else [False] * len(after))

    def in_gemm(v: int) -> bool:
        return not after[v] or v in first or spans[v]

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
            outputs.append(dataclasses.replace(output(o.name, o.value, o.dtype), inplace=o.inplace, mask=o.mask,
                                               transposed=o.transposed))

    def dtype_of(v: int) -> str:
        return ir.inputs[v].dtype if v < n_in else ir.instrs[v - n_in].dtype

    given, stack, seen = set(), [o.value for o, d in zip(ir.outputs, direct) if d is None], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        # (a mask, which no kernel stores, is computed again in XLA from what it compares)
        if in_gemm(v) and (v in first or (heavy[v] and dtype_of(v) != "bool")):
            given.add(v)
        elif v >= n_in and (heavy[v] or not in_gemm(v)):
            stack.extend(ir.instrs[v - n_in].args)
    read = []
    for v in sorted(given):
        read.append((v, len(outputs)))
        outputs.append(output(f"__value{v}__", v, dtype_of(v)))
    gemm = ir.with_outputs(outputs).pruned()
    return Split(gemm, tuple(direct), tuple(read))


def restructure(structure: Any, ir: EpilogueIR, outs: list[Any]) -> Any:
    """``ir``'s outputs ``outs`` (canonical shapes) in the structure and shapes the epilogue
    returned them in (an array, a tuple, a dict), as ``trace_epilogue`` recorded it; a
    transposed output (always a whole tile) as it is."""
    kind, keys, leaves = structure
    outs = [x if o.transposed else _as_leaf(x, *leaf) for x, o, leaf in zip(outs, ir.outputs, leaves)]
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
    names = AXES[-out.ndim:]
    # an axis the epilogue's value did not vary along (it holds copies there): one copy
    leaf = {a: d for a, d in zip(axes, shape) if a is not None}
    out = out[tuple(slice(None) if leaf.get(a, 1) == d else slice(0, 1) for a, d in zip(names, out.shape))]
    sizes = dict(zip(names, out.shape))
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
    """``ir`` with the accumulator (a gated program's two) appended as extra outputs in
    ``dtype`` (a residual that the backward pass reads)."""
    names = ("__acc__", "__up__")[: ir.n_acc]
    return ir.with_outputs(ir.outputs + tuple(Output(nm, i, np.dtype(dtype).name) for i, nm in enumerate(names)))


def _exactly_in(dtype: str, epi_dtype: str) -> bool:
    """Whether every ``dtype`` value converts to ``epi_dtype`` and back unchanged."""
    if dtype == epi_dtype:
        return True
    d, e = jnp.dtype(dtype), jnp.dtype(epi_dtype)
    if jnp.issubdtype(d, jnp.integer) or d == jnp.bool_:
        return d.itemsize * 8 <= jnp.finfo(e).nmant + 1
    return bool(jnp.issubdtype(d, jnp.floating)) and d.itemsize < e.itemsize


def _masked_store(ir: EpilogueIR, k: int) -> tuple[int, bool] | None:
    """(mask, negated) where output ``k``, in place over operand c, is ``where(mask, new, c)``
    (``where(mask, c, new)`` if negated) and nothing else reads c; else None."""
    out, n_in = ir.outputs[k], len(ir.inputs)
    if out.inplace is None or out.reduce or out.transposed or out.value < n_in:
        return None
    c, ins = out.inplace + ir.n_acc, ir.instrs[out.value - n_in]
    if ins.op != "select" or not _exactly_in(ir.inputs[c].dtype, ir.epi_dtype):
        return None
    pred, on_false, on_true = ins.args
    if c not in (on_false, on_true) or on_false == on_true:
        return None
    new = on_true if on_false == c else on_false
    rest = ir.with_outputs([dataclasses.replace(o, value=new, mask=pred) if i == k else o
                            for i, o in enumerate(ir.outputs)])
    return None if rest.uses(c) else (pred, on_true == c)


def with_masked_stores(ir: EpilogueIR) -> EpilogueIR:
    """``ir`` with each in-place output that is ``where(mask, new, c)`` over its operand c (or
    ``where(mask, c, new)``), where nothing else reads c, marked with the mask under which it is
    stored (``Output.mask``; a negated mask is added to the program). The program's values are
    unchanged; a kernel stores such an output only where its mask holds and never reads c. An
    operand read elsewhere too (by another output, by the mask, or by ``new``) is read and
    written whole, as any in-place output's."""
    instrs, outputs = list(ir.instrs), list(ir.outputs)
    for k in range(len(outputs)):
        found = _masked_store(ir, k)
        if found is None:
            continue
        pred, negated = found
        if negated:
            instrs.append(Instr("not", (pred,), "bool"))
            pred = len(ir.inputs) + len(instrs) - 1
        outputs[k] = dataclasses.replace(outputs[k], mask=pred)
    return dataclasses.replace(ir, instrs=tuple(instrs), outputs=tuple(outputs))


def masked_stores(ir: EpilogueIR, kept: Sequence[int]) -> EpilogueIR:
    """The program a kernel evaluates: each masked output of ``kept`` (indices among the
    outputs) computes the new value its mask selects, and reads its operand no more; every
    other output loses its mask (the kernel stores it whole)."""
    n_in, outputs = len(ir.inputs), []
    for k, o in enumerate(ir.outputs):
        if o.mask is not None and k in kept:
            pred, on_false, on_true = ir.instrs[o.value - n_in].args
            o = dataclasses.replace(o, value=on_true if o.mask == pred else on_false)
        outputs.append(dataclasses.replace(o, mask=None) if k not in kept else o)
    return ir.with_outputs(outputs).pruned()
