"""Differential fuzzing of ``efc.gemm``: random epilogues, shapes, dtypes and layouts, checked
against a float64 NumPy oracle that shares no code with jax_efc.

An epilogue is a random expression tree over the accumulator, tile / row / column / scalar
operands and static and dynamic scalars; each output is one tree, or a reduction of one (a sum,
max, min or amax over M, N or both). The oracle evaluates every
tree in float64 on the very values the call sees (inputs as stored, scalars as float32), and
alongside each value a bound on the error float32 evaluation may carry (a forward error
analysis: an operation adds its own rounding, and scales its arguments' errors by its
derivative there). An element passes when it is within that bound plus its output dtype's
rounding; elements where a comparison or a rounding boundary lies within the bound are not
judged. Non-finite values must match the oracle's exactly (NaN for NaN, Inf of the same sign).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def _gelu_tanh_slope(x):
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


# name -> (jax function, float64 function, |derivative|, whether the kernel uses an approximation)
UNARY = {
    "neg": (jnp.negative, np.negative, lambda x: np.ones_like(x), False),
    "abs": (jnp.abs, np.abs, lambda x: np.ones_like(x), False),
    "relu": (lambda x: jnp.maximum(x, 0.0), lambda x: np.maximum(x, 0.0), lambda x: np.ones_like(x), False),
    "tanh": (jnp.tanh, np.tanh, lambda x: 1 - np.tanh(x) ** 2, True),
    "sigmoid": (jax.nn.sigmoid, _sigmoid, lambda x: _sigmoid(x) * (1 - _sigmoid(x)), True),
    "silu": (jax.nn.silu, lambda x: x * _sigmoid(x),
             lambda x: np.abs(_sigmoid(x) * (1 + x * (1 - _sigmoid(x)))), True),
    "gelu_tanh": (jax.nn.gelu, _gelu_tanh, lambda x: np.abs(_gelu_tanh_slope(x)), True),
    "gelu": (lambda x: jax.nn.gelu(x, approximate=False), _gelu,
             lambda x: np.abs(0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)),
             True),
    "erf": (lax.erf, _erf, lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x), True),
    "sin": (jnp.sin, np.sin, lambda x: np.abs(np.cos(x)), True),
    "square": (jnp.square, np.square, lambda x: 2 * np.abs(x), False),
}
BINARY = ("add", "sub", "mul", "max", "min")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# unit roundoff of each storage dtype
_EPS = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# the smallest normal number of each: below it an output may round to a subnormal or flush to 0
_TINY = {"float32": 2.0 ** -126, "bfloat16": 2.0 ** -126, "float16": 2.0 ** -14}
_MAX = {"float32": float(np.finfo(np.float32).max), "bfloat16": 3.38e38, "float16": 65504.0}


@dataclass
class Case:
    """One random call of ``efc.gemm`` and everything its oracle needs."""

    m: int
    n: int
    k: int
    batch: int | None
    ab_dtype: str
    transpose_a: bool
    transpose_b: bool
    operands: list[tuple[str, str]]  # (role, dtype) per positional operand
    static: dict[str, float]
    dynamic: list[str]
    outputs: dict[str, Any]  # name -> expression tree
    out_dtypes: dict[str, str]
    poison: bool  # a NaN or Inf in A and in a tile operand
    seed: int
    as_dict: bool = field(default=True)
    b_shared: bool = False  # B 2-D, shared by every batch of A
    # output name -> (kind: sum, max, min or amax; axes: "m", "n" or "mn"), for outputs that reduce
    reductions: dict[str, tuple[str, str]] = field(default_factory=dict)


def _leaves(n_ops: int, static: list[str], dynamic: list[str]):
    options = [st.just(("acc",))]
    options += [st.just(("op", i)) for i in range(n_ops)]
    options += [st.just(("scalar", s)) for s in static + dynamic]
    options.append(st.sampled_from([0.5, -1.25, 2.0, 0.0, 3.0]).map(lambda v: ("const", v)))
    return st.one_of(options)


def _tree(n_ops: int, static: list[str], dynamic: list[str]):
    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(sorted(UNARY)), children).map(lambda t: ("unary", *t)),
            st.tuples(st.sampled_from(BINARY), children, children).map(lambda t: ("binary", *t)),
            st.tuples(children, children, children, children).map(lambda t: ("where", *t)),
            # a softmax's shift, x - max(x) over N: a reduction consumed inside the epilogue
            children.map(lambda c: ("rowshift", c)),
        )

    return st.recursive(_leaves(n_ops, static, dynamic), extend, max_leaves=8)


# operand roles and their shapes (L: the batch); the batched ones only where there is a batch
_ROLE_SHAPES = {"tile": lambda m, n, lead: lead + (m, n), "row": lambda m, n, lead: (n,),
                "col": lambda m, n, lead: lead + (m, 1), "scalar": lambda m, n, lead: (),
                "shared_tile": lambda m, n, lead: (m, n), "batch_row": lambda m, n, lead: lead + (1, n),
                "batch_scalar": lambda m, n, lead: lead + (1, 1)}
_BATCH_ROLES = ("shared_tile", "batch_row", "batch_scalar")


@st.composite
def cases(draw, *, kernel: bool = False, floats32: bool = False) -> Case:
    """A random call; ``kernel=True`` keeps to what the SM90 kernel runs (16-bit A and B, the
    16-byte alignment TMA needs), with partial tiles; ``floats32=True`` makes every input and
    output float32 and leaves out non-finite inputs (for gradients)."""
    if kernel:
        m = draw(st.integers(1, 300))
        n = 8 * draw(st.integers(1, 40))
        k = 8 * draw(st.integers(1, 40))
        ab = draw(st.sampled_from(["bfloat16", "float16"]))
    else:
        m, n, k = (draw(st.integers(1, 48)) for _ in range(3))
        ab = "float32" if floats32 else draw(st.sampled_from(sorted(DTYPES)))
    floats = ["float32"] if floats32 else sorted(DTYPES)
    transpose_a, transpose_b = draw(st.booleans()), draw(st.booleans())
    if kernel and transpose_a:  # M is then A's contiguous dimension
        m = 8 * -(-m // 8)
    batch = draw(st.sampled_from([None, None, 1, 3]))
    b_shared = batch is not None and draw(st.booleans())  # a batched A against a 2-D B
    roles = ["tile", "row", "col", "scalar"] + (list(_BATCH_ROLES) if batch is not None else [])
    operands = [(r, draw(st.sampled_from(floats))) for r in draw(st.lists(st.sampled_from(roles), max_size=3))]
    static = {f"s{i}": draw(st.sampled_from([0.5, -2.0, 1.5, 0.0, -0.0])) for i in range(draw(st.integers(0, 2)))}
    dynamic = [f"d{i}" for i in range(draw(st.integers(0, 1)))]
    n_out = draw(st.integers(1, 3))
    tree = _tree(len(operands), sorted(static), dynamic)
    outputs = {f"o{i}": draw(tree) for i in range(n_out)}
    if kernel and _shifted_light(outputs["o0"], operands):
        # a value after its row shift that reads neither the accumulator nor a tile (0.5 -
        # max(0.5), row - max(row)) is XLA's to compute from the GEMM's reductions and the
        # operands, which would leave the kernel no tile to store: make o0 read the accumulator
        outputs["o0"] = ("binary", "add", outputs["o0"], ("acc",))
    out_dtypes = {name: draw(st.sampled_from(floats)) for name in outputs}
    poison = not floats32 and draw(st.booleans())
    # the kernel stores at least one tile: its first output never reduces
    reducible = list(outputs)[1:] if kernel else list(outputs)
    reductions = {name: r for name in reducible
                  if (r := draw(st.sampled_from(_REDUCTIONS))) is not None}
    return Case(m, n, k, batch, ab, transpose_a, transpose_b, operands, static, dynamic, outputs,
                out_dtypes, poison, draw(st.integers(0, 2**31 - 1)), draw(st.booleans()), b_shared, reductions)


def _reads_tile(tree, operands) -> bool:
    """Whether ``tree`` reads the accumulator or a tile operand: a value of the tile's size, which
    the GEMM computes (values of row, column and scalar operands alone XLA computes again)."""
    if tree[0] == "acc":
        return True
    if tree[0] == "op":
        return operands[tree[1]][0] in ("tile", "shared_tile")
    return any(_reads_tile(t, operands) for t in tree[1:] if isinstance(t, tuple))


def _shifted_light(tree, operands) -> bool:
    """Whether ``tree`` holds a row shift yet reads neither the accumulator nor a tile."""
    return "rowshift" in repr(tree) and not _reads_tile(tree, operands)


_REDUCTIONS = (None, None, None, ("sum", "m"), ("sum", "n"), ("sum", "mn"), ("max", "n"), ("min", "m"),
               ("amax", "mn"), ("amax", "m"))
_AXES = {"m": (-2,), "n": (-1,), "mn": (-2, -1)}


def _reduce_jax(v, kind, axes):
    if kind == "amax":
        return jnp.max(jnp.abs(v), axis=_AXES[axes])
    return {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](v, axis=_AXES[axes])


def out_shape(case: Case, name: str) -> tuple[int, ...]:
    """The shape of output ``name``: the tile's, less the axes it reduces."""
    shape = (() if case.batch is None else (case.batch,)) + (case.m, case.n)
    if name not in case.reductions:
        return shape
    dropped = {len(shape) + d for d in _AXES[case.reductions[name][1]]}
    return tuple(d for i, d in enumerate(shape) if i not in dropped)


def _jax_eval(tree, acc, ops, scalars):
    kind = tree[0]
    if kind == "acc":
        return acc
    if kind == "op":
        return ops[tree[1]]
    if kind == "scalar":
        return scalars[tree[1]]
    if kind == "const":
        return tree[1]
    if kind == "unary":
        return UNARY[tree[1]][0](_jax_eval(tree[2], acc, ops, scalars))
    if kind == "rowshift":
        x = jnp.broadcast_to(_jax_eval(tree[1], acc, ops, scalars), acc.shape)
        return x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    if kind == "binary":
        x, y = (_jax_eval(t, acc, ops, scalars) for t in tree[2:])
        return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum,
                "min": jnp.minimum}[tree[1]](x, y)
    p, q, x, y = (_jax_eval(t, acc, ops, scalars) for t in tree[1:])
    return jnp.where(p > q, x, y)


def epilogue_of(case: Case):
    """The case's epilogue as a user writes it: plain jax.numpy, outputs as a dict or tuple."""
    n_ops = len(case.operands)

    def epilogue(acc, *ops, **scalars):
        outs = {name: jnp.broadcast_to(_jax_eval(t, acc, ops[:n_ops], scalars), acc.shape)
                for name, t in case.outputs.items()}
        outs = {name: _reduce_jax(v, *case.reductions[name]) if name in case.reductions else v
                for name, v in outs.items()}
        return outs if case.as_dict else tuple(outs.values())

    return epilogue


def inputs_of(case: Case) -> tuple[Any, Any, list[Any], dict[str, Any]]:
    """A, B (as stored: transposed where the case says), operands and dynamic scalars."""
    rng = np.random.default_rng(case.seed)
    lead = () if case.batch is None else (case.batch,)
    a_shape = lead + ((case.k, case.m) if case.transpose_a else (case.m, case.k))
    b_shape = (() if case.b_shared else lead) + ((case.n, case.k) if case.transpose_b else (case.k, case.n))
    a = rng.standard_normal(a_shape) / math.sqrt(case.k)
    b = rng.standard_normal(b_shape)
    ops = [rng.standard_normal(_ROLE_SHAPES[r](case.m, case.n, lead)) for r, _ in case.operands]
    if case.poison:
        a.reshape(-1)[rng.integers(a.size)] = rng.choice([np.nan, np.inf, -np.inf])
        for (role, _), x in zip(case.operands, ops):
            if role in ("tile", "shared_tile"):
                x.reshape(-1)[rng.integers(x.size)] = rng.choice([np.nan, np.inf, -np.inf])
                break
    ab = DTYPES[case.ab_dtype]
    dyn = {d: jnp.asarray(rng.standard_normal(), jnp.float32) for d in case.dynamic}
    return (jnp.asarray(a, ab), jnp.asarray(b, ab),
            [jnp.asarray(x, DTYPES[dt]) for x, (_, dt) in zip(ops, case.operands)], dyn)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def oracle(case: Case, a, b, ops, dyn, *, kernel: bool) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per output: the float64 value, the float32-evaluation error bound, and a mask of the
    elements too close to a decision (a comparison, a rounding boundary) to judge."""
    a, b = _f64(a), _f64(b)
    if case.transpose_a:
        a = np.swapaxes(a, -1, -2)
    if case.transpose_b:
        b = np.swapaxes(b, -1, -2)
    if case.b_shared:
        b = np.broadcast_to(b, a.shape[:-2] + b.shape)
    with np.errstate(all="ignore"):
        acc = np.einsum("...mk,...kn->...mn", a, b)
        # fp32 accumulation of exact products: each partial sum rounds once
        acc_err = (case.k + 2) * 2.0 ** -23 * np.einsum("...mk,...kn->...mn", np.abs(a), np.abs(b))
        acc_err = np.where(np.isfinite(acc_err), acc_err, np.inf)
    op_vals = [_f64(x) for x in ops]
    for i, (role, _) in enumerate(case.operands):
        if role == "row":
            op_vals[i] = op_vals[i].reshape(1, -1)
    scalars = {k: float(np.float32(v)) for k, v in case.static.items()}
    scalars.update({k: float(v) for k, v in dyn.items()})
    shape = acc.shape
    ambiguous = np.zeros(shape, bool)
    op_eps = 2.0 ** -10 if kernel else 2.0 ** -20  # the kernel's tanh.approx is good to ~2^-11

    def ev(tree):
        value, err = _ev(tree)
        nonlocal ambiguous
        ambiguous = ambiguous | (np.abs(value) + err >= 1e37)  # float32 could overflow on the way
        return value, err

    def _ev(tree):
        nonlocal ambiguous
        kind = tree[0]
        if kind == "acc":
            return acc, acc_err
        if kind in ("op", "scalar", "const"):
            v = op_vals[tree[1]] if kind == "op" else scalars[tree[1]] if kind == "scalar" else tree[1]
            v = np.broadcast_to(np.float64(v), shape) if np.ndim(v) == 0 else np.broadcast_to(v, shape)
            return v, np.zeros(shape)
        if kind == "unary":
            _, fn, slope, approx = UNARY[tree[1]]
            x, e = ev(tree[2])
            y = fn(x)
            # what the float32 evaluation rounds: the result, and for the GELUs the x / 2 that
            # multiplies 1 + tanh (or erf), which cancels for negative x
            scale = np.abs(y) + (np.abs(x) if tree[1].startswith("gelu") else 0)
            return y, slope(x) * e + scale * (op_eps if approx else 2.0 ** -23) + 2.0 ** -126
        if kind == "rowshift":
            # the max is one of the values, off by at most the largest of their errors
            x, e = ev(tree[1])
            z = x - x.max(-1, keepdims=True)
            return z, e + e.max(-1, keepdims=True) + np.abs(z) * 2.0 ** -23
        if kind == "binary":
            (x, ex), (y, ey) = ev(tree[2]), ev(tree[3])
            op = tree[1]
            if op in ("add", "sub"):
                z = x + y if op == "add" else x - y
                return z, ex + ey + np.abs(z) * 2.0 ** -23
            if op == "mul":
                z = x * y
                return z, np.abs(x) * ey + np.abs(y) * ex + ex * ey + np.abs(z) * 2.0 ** -23
            z = np.maximum(x, y) if op == "max" else np.minimum(x, y)
            return z, np.maximum(ex, ey)
        (p, ep), (q, eq), (x, ex), (y, ey) = (ev(t) for t in tree[1:])
        ambiguous = ambiguous | (np.abs(p - q) <= 2 * (ep + eq)) | np.isinf(ep + eq)
        return np.where(p > q, x, y), np.where(p > q, ex, ey)

    result = {}
    with np.errstate(all="ignore"):
        for name, tree in case.outputs.items():
            ambiguous = np.zeros(shape, bool)
            value, err = ev(tree)
            if name in case.reductions:
                value, err, ambiguous = _reduce_oracle(value, err, ambiguous, *case.reductions[name])
            dt = case.out_dtypes[name]
            near_max = np.abs(value) + err >= 0.9 * _MAX[dt]
            result[name] = (value, err, ambiguous | near_max)
    return result


def _reduce_oracle(value, err, ambiguous, kind, axes):
    """A reduction's float64 value and error bound (a sum adds its terms' errors and, accumulated
    in float32, one rounding of its running sum per term), judged only where every term is."""
    axes = _AXES[axes]
    if kind == "amax":
        value, kind = np.abs(value), "max"
    if kind == "sum":
        count = math.prod(value.shape[a] for a in axes)
        out = value.sum(axes)
        bound = err.sum(axes) + count * 2.0 ** -23 * np.abs(value).sum(axes)
    else:
        out = value.max(axes) if kind == "max" else value.min(axes)
        bound = err.max(axes)
    return out, bound, ambiguous.any(axes)


def check(case: Case, got: dict[str, Any], want: dict[str, tuple]) -> None:
    """Assert each output agrees with the oracle: same non-finite pattern, finite values within
    the error bound plus the output dtype's rounding."""
    for name, (value, err, ambiguous) in want.items():
        out = np.asarray(jnp.asarray(got[name], jnp.float32), np.float64)
        dt = case.out_dtypes[name]
        assert out.shape == value.shape, (name, out.shape, value.shape)
        judged = ~ambiguous
        nan_w, nan_g = np.isnan(value), np.isnan(out)
        bad = judged & (nan_w != nan_g)
        assert not bad.any(), f"{name}: NaN where the oracle has {value[bad][:4]}, got {out[bad][:4]}"
        inf_w = np.isinf(value) & judged
        assert np.array_equal(out[inf_w], value[inf_w]), f"{name}: infinities differ"
        finite = judged & np.isfinite(value)
        assert np.isfinite(out[finite]).all(), f"{name}: non-finite where the oracle is finite"
        tol = 2 * err[finite] + 2 * _EPS[dt] * np.abs(value[finite]) + _TINY[dt]
        tol = np.where(np.isnan(tol), np.inf, tol)
        gap = np.abs(out[finite] - value[finite])
        worst = np.argmax(gap - tol) if gap.size else None
        assert gap.size == 0 or (gap <= tol).all(), (
            f"{name} ({dt}): |got - want| = {gap[worst]:.3g} > {tol[worst]:.3g} at want = {value[finite][worst]:.6g}")


def run(case: Case, *, kernel: bool = False, config: Any = None) -> None:
    """Call ``efc.gemm`` for ``case`` and check it against the oracle."""
    import jax_efc as efc

    a, b, ops, dyn = inputs_of(case)
    out_dtypes = dict(case.out_dtypes) if case.as_dict else list(case.out_dtypes.values())
    got = efc.gemm(a, b, epilogue_of(case), *ops, out_dtypes=out_dtypes, transpose_a=case.transpose_a,
                   transpose_b=case.transpose_b, config=config, **case.static, **dyn)
    if not case.as_dict:
        got = dict(zip(case.outputs, got))
    check(case, got, oracle(case, a, b, ops, dyn, kernel=kernel))


@contextlib.contextmanager
def strict():
    """``JAX_EFC_STRICT=1`` for the calls inside, a fallback an error; and
    ``JAX_EFC_UNVERIFIED_KERNELS=1``, so that the kernel's epilogue reductions run too."""
    settings = {"JAX_EFC_STRICT": "1", "JAX_EFC_UNVERIFIED_KERNELS": "1"}
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def run_grad(case: Case) -> None:
    """The gradients of a random weighting of ``case``'s outputs with respect to A, B, every
    operand and every dynamic scalar, against the same epilogue differentiated by JAX in
    float64 on ``a @ b``: relative Frobenius error at most 1e-4 (float32 arithmetic)."""
    import jax_efc as efc

    a, b, ops, dyn = inputs_of(case)
    rng = np.random.default_rng(case.seed + 1)
    fn = epilogue_of(case)
    names = sorted(dyn)
    lead = () if case.batch is None else (case.batch,)
    weights = {name: rng.standard_normal(out_shape(case, name)) for name in case.outputs}

    def loss(matmul, a, b, ops, scalars):
        outs = fn(matmul(a, b), *ops, **case.static, **dict(zip(names, scalars)))
        outs = outs if case.as_dict else dict(zip(case.outputs, outs))
        return sum(jnp.sum(outs[k] * weights[k]) for k in case.outputs)

    def fused(a, b, ops, scalars):
        outs = efc.gemm(a, b, fn, *ops, transpose_a=case.transpose_a, transpose_b=case.transpose_b,
                        **case.static, **dict(zip(names, scalars)))
        outs = outs if case.as_dict else dict(zip(case.outputs, outs))
        return sum(jnp.sum(outs[k] * weights[k]) for k in case.outputs)

    def plain_matmul(a, b):
        a = jnp.swapaxes(a, -1, -2) if case.transpose_a else a
        b = jnp.swapaxes(b, -1, -2) if case.transpose_b else b
        return jnp.matmul(a, b, precision="highest")

    scalars = [dyn[k] for k in names]
    got = jax.grad(fused, argnums=(0, 1, 2, 3))(a, b, ops, scalars)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        want = jax.grad(lambda *x: loss(plain_matmul, *x), argnums=(0, 1, 2, 3))(
            f64(a), f64(b), [f64(x) for x in ops], [f64(x) for x in scalars])
        want = jax.tree.map(np.asarray, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (g.shape, w.shape)
        scale = max(np.linalg.norm(w), 1e-6 * math.sqrt(w.size) + 1e-30)
        assert np.linalg.norm(g - w) <= 1e-4 * scale + 1e-6, (np.linalg.norm(g - w), np.linalg.norm(w))
