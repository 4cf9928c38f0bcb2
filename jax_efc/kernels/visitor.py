"""The epilogue visitor: evaluates an :class:`~jax_efc.epilogue.EpilogueIR` on the
accumulator fragment a thread holds for one epilogue subtile.

Shared by every architecture's kernel. The kernel hands over, per subtile, the fp32
accumulator values as a ``TensorSSA`` and, per value, its (m, n) coordinate in the output;
the visitor gathers the operands at those coordinates (TILE at (m, n), ROW at n, COL at m,
SCALAR once), runs the SSA program (after the cheaper equivalent forms of ``rewrite.py``) with
CuTe math on whole fragments, or paced, a few values at a time in dependent chains, and
returns every output already converted to its storage dtype.

Everything here runs at trace time inside a ``@cute.kernel``: loops are Python loops over
static sizes (fully unrolled), there is no data-dependent Python control flow.
Coordinates past the M/N edge are clamped to the last row/column so partial tiles never read
out of bounds; the TMA store drops those lanes anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute import math as cmath
from cutlass.cutlass_dsl import T

from jax_efc.epilogue import EpilogueIR, Role
from jax_efc.kernels.rewrite import rewrite

__all__ = ["EpilogueVisitor", "cutlass_dtype"]

_DTYPES = {
    "float32": cutlass.Float32,
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "bool": cutlass.Boolean,
}


def cutlass_dtype(name: str) -> type:
    """The cutlass numeric type for a NumPy dtype name."""
    return _DTYPES[name]


def _f32(v: cute.TensorSSA) -> cute.TensorSSA:
    """Widen a 16-bit float fragment to fp32; 16-bit ops compute in fp32 and round after,
    as XLA does on GPUs."""
    return v.to(cutlass.Float32) if v.dtype in (cutlass.BFloat16, cutlass.Float16) else v


def _full(like: cute.TensorSSA, value, dtype: type) -> cute.TensorSSA:
    return cute.full(like.shape, value, dtype)


# A paced evaluation runs this many independent chains of dependent values (see
# EpilogueVisitor.__call__). Two, as cuBLASLt's BIAS_GELU kernel does, gave the other
# consumer's WGMMAs back most of the cycles that dense fp32 work took from them on an H200
# (benchmarks/FINDINGS.md).
_PACE_CHAINS = 2


def _opaque_zero() -> cutlass.Int32:
    """0, as the dynamic shared memory size (under 2^31 bytes) shifted right by 31: a zero
    that neither LLVM nor ptxas can fold away."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [], "{ .reg .b32 size; mov.u32 size, %dynamic_smem_size; shr.u32 $0, size, 31; }",
        "=r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _tie(value: cute.TensorSSA, link: cute.TensorSSA, zero: cutlass.Int32) -> cute.TensorSSA:
    """``value`` unchanged (its bits OR ``link & zero``), made to wait for ``link``: one
    ``lop3`` per value."""
    tied = cute.make_rmem_tensor(value.shape, cutlass.Float32)
    for i in range(cute.size(tied)):
        tied[i] = cutlass.Float32(llvm.inline_asm(
            T.f32(), [cutlass.Float32(value[i]).ir_value(), cutlass.Float32(link[i]).ir_value(),
                      zero.ir_value()],
            "lop3.b32 $0, $1, $2, $3, 0xF8;", "=f,f,f,r", has_side_effects=False,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
    return tied.load()


def _slice(v: cute.TensorSSA, start: int, size: int) -> cute.TensorSSA:
    """Values ``start`` to ``start + size`` of a fragment, by linear index, as a flat one
    (register renaming only)."""
    part = cute.make_rmem_tensor((size,), v.dtype)
    for i in range(size):
        part[i] = v[start + i]
    return part.load()


def _sign(x):
    one = _full(x, 1.0, cutlass.Float32)
    return cute.where(x > 0.0, one, cute.where(x < 0.0, -one, x))


def _integer_pow(x, exponent: int):
    result = None
    base, e = x, abs(exponent)
    while e:  # square-and-multiply, unrolled at trace time
        if e & 1:
            result = base if result is None else result * base
        e >>= 1
        if e:
            base = base * base
    if result is None:
        return _full(x, 1.0, cutlass.Float32)
    return _full(x, 1.0, cutlass.Float32) / result if exponent < 0 else result


def _rcp_approx(x: cute.TensorSSA) -> cute.TensorSSA:
    """1/x by the hardware reciprocal (rcp.approx, ~1 ulp) instead of an IEEE division
    subroutine; the DSL offers it on scalars, so it is applied value by value."""
    frag = cute.make_rmem_tensor(x.shape, cutlass.Float32)
    frag.store(x)
    for i in range(cute.size(frag)):
        frag[i] = cute.arch.rcp_approx(frag[i])
    return frag.load()


# erf(x) ~ x * P(x^2) / Q(x^2) with x clamped to [-4, 4] (beyond, erf rounds to +-1 in fp32):
# a rational fit of ours, 16 instructions a value.
# Evaluated in fp32 its largest error is 4.5e-7 (about 8 ulps of 1.0, near |x| = 3.8).
_ERF_CLAMP = 4.0
_ERF_P = (1.12837899, 0.196252018, 0.0534679405, 0.0040037944, 0.000288047362, 1.97483769e-06)
_ERF_Q = (1.0, 0.507254958, 0.116477735, 0.0154447155, 0.00121640088, 3.74812589e-05)


def _horner(t: cute.TensorSSA, coefficients: Sequence[float]) -> cute.TensorSSA:
    """sum(c_i * t**i), highest power first (one multiply-add per coefficient)."""
    result = _full(t, coefficients[-1], cutlass.Float32)
    for c in reversed(coefficients[:-1]):
        result = result * t + c
    return result


def _erf(x: cute.TensorSSA) -> cute.TensorSSA:
    bound = _full(x, _ERF_CLAMP, cutlass.Float32)
    x = cmath.min(cmath.max(x, -bound, propagate_nan=True), bound, propagate_nan=True)
    t = x * x
    return x * _horner(t, _ERF_P) * _rcp_approx(_horner(t, _ERF_Q))


# erfc(|z|) ~ exp(-z^2) * P(|z|) / Q(|z|), the ratio clamped at |z| = 10 (where erfc is far
# below fp32's range), and erfc(z) = 2 - erfc(-z) for z < 0: keeps erfc's relative accuracy in
# the tail (jax.nn.gelu's exact form is x * erfc(-x / sqrt(2)) / 2) in about 20 instructions
# where the accurate erfcf took about 50. In fp32 its largest relative error for z >= 0 is
# about 6.7e-6 (the rounding of z^2 in the exponent, at large z); the fit itself is within 6e-9.
_ERFC_CLAMP = 10.0
_ERFC_P = (1.0, 1.2375809, 0.730734289, 0.228803724, 0.032709185)
_ERFC_Q = (1.0, 2.3659606, 2.40042591, 1.32374465, 0.405570865, 0.0579748116)
_LOG2_E = 1.4426950408889634


def _erfc(z: cute.TensorSSA) -> cute.TensorSSA:
    a = cmath.abs(z)
    clamped = cmath.min(a, _full(a, _ERFC_CLAMP, cutlass.Float32), propagate_nan=True)
    tail = cmath.exp2(a * (a * -_LOG2_E), fastmath=True) * _horner(clamped, _ERFC_P) \
        * _rcp_approx(_horner(clamped, _ERFC_Q))
    return cute.where(z < 0.0, _full(z, 2.0, cutlass.Float32) - tail, tail)


# op -> function of fp32 (or Boolean) fragments. Keys match jax_efc.epilogue.OPS.
# exp/exp2/tanh use the hardware approximations (ex2.approx, tanh.approx: ~1e-6 and ~5e-4
# relative error) and erf/erfc the rational fits above, far below the bf16/fp16 rounding of the
# outputs, as XLA's fused GPU kernels do; everything else keeps the accurate lowering.
_FLOAT_OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: cmath.max(a, b, propagate_nan=True),
    "min": lambda a, b: cmath.min(a, b, propagate_nan=True),
    "pow": lambda a, b: cmath.pow(a, b),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "neg": lambda a: -a,
    "abs": lambda a: cmath.abs(a),
    "sign": _sign,
    "floor": lambda a: cmath.floor(a),
    "ceil": lambda a: cmath.ceil(a),
    "exp": lambda a: cmath.exp(a, fastmath=True),
    "exp2": lambda a: cmath.exp2(a, fastmath=True),
    "log": lambda a: cmath.log(a),
    "log1p": lambda a: cmath.log1p(a),
    "expm1": lambda a: cmath.expm1(a),
    "tanh": lambda a: cmath.tanh(a, fastmath=True),
    # 1 / (1 + 2^(-a log2 e)): the negation folded into the exponent's scale
    "logistic": lambda a: _rcp_approx(cmath.exp2(a * -_LOG2_E, fastmath=True) + 1.0),
    "erf": _erf,
    "erfc": _erfc,
    "sqrt": lambda a: cmath.sqrt(a),
    "rsqrt": lambda a: cmath.rsqrt(a),
    "sin": lambda a: cmath.sin(a),
    "cos": lambda a: cmath.cos(a),
    "tan": lambda a: cmath.tan(a),
}
_BOOL_OPS = {
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "ne": lambda a, b: a ^ b,
    "eq": lambda a, b: (a ^ b) ^ _full(a, True, cutlass.Boolean),
    "not": lambda a: a ^ _full(a, True, cutlass.Boolean),
}


class EpilogueVisitor:
    """Trace-time evaluator of one epilogue program.

    ``operand_batched[i]`` says whether operand i carries the batch dimension; an operand
    without it is read at batch index 0 for every batch.
    """

    def __init__(self, ir: EpilogueIR, operand_batched: Sequence[bool]):
        self.ir = ir = rewrite(ir)
        self.operand_batched = tuple(operand_batched)
        self.out_dtypes = tuple(cutlass_dtype(o.dtype) for o in ir.outputs)
        # an operand no output depends on is never loaded
        self.live = tuple(ir.uses(i + 1) for i in range(len(ir.operands)))
        # a paced evaluation hands each group's last arithmetic result on to the next group;
        # None where the program does no arithmetic, so pacing has nothing to spread
        arithmetic = [k for k, ins in enumerate(ir.instrs) if ins.op not in ("const", "convert")]
        self.pace_link = len(ir.inputs) + arithmetic[-1] if arithmetic else None

    def _gather(self, tensor: cute.Tensor, role: Role, batch, coords: Sequence[tuple],
                extent_mn, like: cute.TensorSSA) -> cute.TensorSSA:
        """Read an (M|1, N|1, L) operand at every fragment coordinate, widened to fp32."""
        frag = cute.make_rmem_tensor(like.shape, cutlass.Float32)
        m_last, n_last = extent_mn[0] - 1, extent_mn[1] - 1
        for i in range(cute.size(frag)):
            m, n = coords[i][0], coords[i][1]
            mi = cutlass.min(m, m_last) if role in (Role.TILE, Role.COL) else 0
            ni = cutlass.min(n, n_last) if role in (Role.TILE, Role.ROW) else 0
            frag[i] = tensor[(mi, ni, batch)].to(cutlass.Float32)
        return frag.load()

    def prefetch_vectors(self, operands: Sequence[cute.Tensor], origin: tuple, tile_mn: tuple,
                         extent_mn, batch, tid) -> None:
        """Pull the tile's slice of every ROW and COL operand into L1, thread ``tid`` one of
        its 128-byte lines, so that each subtile's vector loads hit there. ``origin``: the
        tile's first (m, n)."""
        for i, (inp, tensor) in enumerate(zip(self.ir.operands, operands)):
            if not self.live[i] or inp.role not in (Role.ROW, Role.COL):
                continue
            axis = 1 if inp.role is Role.ROW else 0
            per_line = 128 * 8 // tensor.element_type.width
            lines = tile_mn[axis] // per_line  # tiles span 64 or more values, a line at most 64
            index = cutlass.min(origin[axis] + (tid % lines) * per_line, extent_mn[axis] - 1)
            b = batch if self.operand_batched[i] else 0
            coord = (0, index, b) if axis == 1 else (index, 0, b)
            ptr = tensor.iterator + cute.crd2idx(coord, tensor.layout)
            cute.arch.prefetch(ptr.to_llvm_ptr(), cache_level="L1")

    def __call__(self, acc: cute.TensorSSA, coords: Sequence[tuple],
                 operands: Sequence[cute.Tensor], extent_mn, batch,
                 preloaded: dict, paced: bool = False) -> list[cute.TensorSSA]:
        """The outputs for one subtile, each converted to its storage dtype.

        ``acc``: fp32 accumulator fragment; ``coords``: the (m, n) output coordinate of each
        fragment value, in linear index order; ``operands``: the epilogue operand tensors,
        each presented as (M|1, N|1, L|1); ``extent_mn``: (M, N) of the output; ``batch``:
        this tile's batch index; ``preloaded``: operand index -> fp32 fragment the kernel
        already read (TILE operands staged in smem by TMA).

        ``paced`` (programs with arithmetic, ``pace_link`` set): evaluate the program
        ``_PACE_CHAINS`` values at a time, each group's accumulators tied to the previous
        group's last arithmetic result, so that the fp32 work issues as that many dependent
        chains instead of as densely as the compiler can schedule it. Slower on its own; for
        epilogues that run under another warpgroup's WGMMAs, which dense fp32 issue slows.
        """
        ir = self.ir
        values: list = [acc]
        for i, (inp, tensor) in enumerate(zip(ir.operands, operands)):
            if not self.live[i]:
                values.append(None)
                continue
            b = batch if self.operand_batched[i] else 0
            if i in preloaded:
                values.append(preloaded[i])
            elif inp.role is Role.SCALAR:
                values.append(_full(acc, tensor[(0, 0, b)].to(cutlass.Float32), cutlass.Float32))
            else:
                values.append(self._gather(tensor, inp.role, b, coords, extent_mn, acc))
        if not paced:
            return self._outputs(self._run(values))
        size = cute.size(acc.shape)
        assert size % _PACE_CHAINS == 0, f"{size} values do not split into {_PACE_CHAINS} chains"
        zero = _opaque_zero()
        outs = [cute.make_rmem_tensor(acc.shape, dt) for dt in self.out_dtypes]
        link = None
        for start in range(0, size, _PACE_CHAINS):
            group = [None if v is None else _slice(v, start, _PACE_CHAINS) for v in values]
            if link is not None:
                group[0] = _tie(group[0], link, zero)
            results = self._run(group)
            for out, part in zip(outs, self._outputs(results)):
                for k in range(_PACE_CHAINS):
                    out[start + k] = part[k]
            link = self._convert(results[self.pace_link], cutlass.Float32)
        return [out.load() for out in outs]

    def _run(self, values: list) -> list:
        """``values`` (the program's inputs) extended by every instruction's result."""
        for ins in self.ir.instrs:
            values.append(self._instr(ins, [values[a] for a in ins.args], values[0]))
        return values

    def _outputs(self, values: list) -> list[cute.TensorSSA]:
        return [self._convert(values[o.value], dt) for o, dt in zip(self.ir.outputs, self.out_dtypes)]

    @staticmethod
    def _instr(ins, args, like):
        dtype = cutlass_dtype(ins.dtype)
        if ins.op == "const":
            value = bool(ins.attr) if dtype is cutlass.Boolean else float(ins.attr)
            return _full(like, value, dtype)
        if ins.op == "convert":
            return EpilogueVisitor._convert(args[0], dtype)
        if ins.op == "select":
            pred, on_false, on_true = args
            return EpilogueVisitor._round(cute.where(pred, _f32(on_true), _f32(on_false)), dtype)
        if all(a.dtype is cutlass.Boolean for a in args) and ins.op in _BOOL_OPS:
            return _BOOL_OPS[ins.op](*args)
        if ins.op == "integer_pow":
            return EpilogueVisitor._round(_integer_pow(_f32(args[0]), ins.attr), dtype)
        result = _FLOAT_OPS[ins.op](*[_f32(a) for a in args])
        return result if dtype is cutlass.Boolean else EpilogueVisitor._round(result, dtype)

    @staticmethod
    def _round(v, dtype):
        return v if v.dtype is dtype else v.to(dtype)

    @staticmethod
    def _convert(v, dtype):
        if v.dtype is dtype:
            return v
        if v.dtype is cutlass.Boolean:
            one = _full(v, 1.0, cutlass.Float32)
            return EpilogueVisitor._round(cute.where(v, one, _full(v, 0.0, cutlass.Float32)), dtype)
        if dtype is cutlass.Boolean:
            return _f32(v) != 0.0
        return v.to(dtype)
