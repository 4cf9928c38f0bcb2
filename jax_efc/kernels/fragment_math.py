"""The fragment math the epilogue visitor evaluates with: CuTe DSL operations on whole register
fragments (``TensorSSA``), one function per epilogue op (keys match
:data:`jax_efc.epilogue.OPS`), the hardware approximations and rational fits that stand in
for the accurate library calls, the conversions between the value dtypes, and the helpers of
paced evaluation. Every function runs at trace time inside a ``@cute.kernel``.
"""

from __future__ import annotations

from collections.abc import Sequence

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute import math as cmath
from cutlass.cutlass_dsl import T

__all__ = ["FLOAT_OPS", "BOOL_OPS", "PACE_CHAINS", "f32", "full", "opaque_zero", "tie", "take",
           "integer_pow", "round_to", "convert", "store_if"]


def f32(v: cute.TensorSSA) -> cute.TensorSSA:
    """Widen a 16-bit float fragment to fp32; 16-bit ops compute in fp32 and round after,
    as XLA does on GPUs."""
    return v.to(cutlass.Float32) if v.dtype in (cutlass.BFloat16, cutlass.Float16) else v


def full(like: cute.TensorSSA, value, dtype: type) -> cute.TensorSSA:
    """A fragment shaped like ``like`` holding ``value``."""
    return cute.full(like.shape, value, dtype)


# A paced evaluation runs this many independent chains of dependent values (see
# EpilogueVisitor.__call__). Two, as cuBLASLt's BIAS_GELU kernel does, gave the other
# consumer's WGMMAs back most of the cycles that dense fp32 work took from them on an H200
# (benchmarks/FINDINGS.md).
PACE_CHAINS = 2


def opaque_zero() -> cutlass.Int32:
    """0, as the dynamic shared memory size (under 2^31 bytes) shifted right by 31: a zero
    that neither LLVM nor ptxas can fold away."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [], "{ .reg .b32 size; mov.u32 size, %dynamic_smem_size; shr.u32 $0, size, 31; }",
        "=r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def tie(value: cute.TensorSSA, link: cute.TensorSSA, zero: cutlass.Int32) -> cute.TensorSSA:
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


def store_if(tensor: cute.Tensor, coord: tuple, value, pred) -> None:
    """``tensor[coord] = value`` (a global tensor, values of 8 to 32 bits) where ``pred``
    holds: one predicated store. (A Python ``if`` around the store compiles to a branch per
    value, which ptxas may or may not turn back into predicates.)"""
    width = value.dtype.width
    bits = llvm.bitcast(T.i(width), value.ir_value())
    if width == 8:  # PTX has no 8-bit registers: st.b8 stores the low byte of a 16-bit one
        bits = llvm.zext(T.i16(), bits)
    ptr = (tensor.iterator + cute.crd2idx(coord, tensor.layout)).to_llvm_ptr()
    llvm.inline_asm(
        None, [ptr, bits, cutlass.Int32(pred).ir_value()],
        f"{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.b{width} [$0], $1; }}",
        f"l,{'r' if width == 32 else 'h'},r,~{{memory}}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


def take(v: cute.TensorSSA, start: int, size: int) -> cute.TensorSSA:
    """Values ``start`` to ``start + size`` of a fragment, by linear index, as a flat one
    (register renaming only)."""
    part = cute.make_rmem_tensor((size,), v.dtype)
    for i in range(size):
        part[i] = v[start + i]
    return part.load()


def _sign(x):
    one = full(x, 1.0, cutlass.Float32)
    return cute.where(x > 0.0, one, cute.where(x < 0.0, -one, x))


def integer_pow(x, exponent: int):
    result = None
    base, e = x, abs(exponent)
    while e:  # square-and-multiply, unrolled at trace time
        if e & 1:
            result = base if result is None else result * base
        e >>= 1
        if e:
            base = base * base
    if result is None:
        return full(x, 1.0, cutlass.Float32)
    return full(x, 1.0, cutlass.Float32) / result if exponent < 0 else result


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
    result = full(t, coefficients[-1], cutlass.Float32)
    for c in reversed(coefficients[:-1]):
        result = result * t + c
    return result


def _erf(x: cute.TensorSSA) -> cute.TensorSSA:
    bound = full(x, _ERF_CLAMP, cutlass.Float32)
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
    clamped = cmath.min(a, full(a, _ERFC_CLAMP, cutlass.Float32), propagate_nan=True)
    tail = cmath.exp2(a * (a * -_LOG2_E), fastmath=True) * _horner(clamped, _ERFC_P) \
        * _rcp_approx(_horner(clamped, _ERFC_Q))
    return cute.where(z < 0.0, full(z, 2.0, cutlass.Float32) - tail, tail)


# op -> function of fp32 (or Boolean) fragments. Keys match jax_efc.epilogue.OPS.
# exp/exp2/tanh use the hardware approximations (ex2.approx, tanh.approx: ~1e-6 and ~5e-4
# relative error) and erf/erfc the rational fits above, far below the bf16/fp16 rounding of the
# outputs, as XLA's fused GPU kernels do; everything else keeps the accurate lowering.
FLOAT_OPS = {
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
    "stop_gradient": lambda a: a,  # what it stops is the reference's autodiff
}
BOOL_OPS = {
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "ne": lambda a, b: a ^ b,
    "eq": lambda a, b: (a ^ b) ^ full(a, True, cutlass.Boolean),
    "not": lambda a: a ^ full(a, True, cutlass.Boolean),
}


def round_to(v: cute.TensorSSA, dtype: type) -> cute.TensorSSA:
    """``v`` rounded to ``dtype`` (unchanged if it has it)."""
    return v if v.dtype is dtype else v.to(dtype)


def convert(v: cute.TensorSSA, dtype: type) -> cute.TensorSSA:
    """``v`` as ``dtype``, with JAX's bool <-> number conversions, and XLA's saturating ones to
    integers."""
    if v.dtype is dtype:
        return v
    if v.dtype is cutlass.Boolean:
        one = full(v, 1.0, cutlass.Float32)
        return round_to(cute.where(v, one, full(v, 0.0, cutlass.Float32)), dtype)
    if dtype is cutlass.Boolean:
        return f32(v) != 0.0
    if dtype in _INT_RANGE:
        return _to_integer(v, dtype)
    return v.to(dtype)


_INT_RANGE = {cutlass.Int32: (-2**31, 2**31 - 1), cutlass.Int8: (-128, 127), cutlass.Uint8: (0, 255)}
# the largest float32 below 2^31: float32 values from here on saturate to int32's maximum
_F32_BELOW_2_31 = 2147483520.0


def _clamped(v: cute.TensorSSA, lo, hi) -> cute.TensorSSA:
    return cute.where(v > hi, full(v, hi, v.dtype), cute.where(v < lo, full(v, lo, v.dtype), v))


def _to_integer(v: cute.TensorSSA, dtype: type) -> cute.TensorSSA:
    """``v`` converted to an integer ``dtype`` saturating, as XLA converts: floats rounded
    toward zero, NaN to 0; an int32 accumulator clamped to the narrower range."""
    if v.dtype not in _INT_RANGE:
        x = f32(v)
        x = cute.where(x == x, x, full(x, 0.0, cutlass.Float32))  # NaN -> 0
        top = x >= 2.0**31
        i = _clamped(x, -2.0**31, _F32_BELOW_2_31).to(cutlass.Int32)
        v = cute.where(top, full(i, 2**31 - 1, cutlass.Int32), i)
    lo, hi = _INT_RANGE[dtype]
    return v if dtype is cutlass.Int32 else _clamped(v, lo, hi).to(dtype)
