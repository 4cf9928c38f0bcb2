"""``fp8_dense``: a dense layer whose three GEMMs run on FP8 inputs, with the scaling recipe of
Flax's FP8 ops.

Forward, ``x`` and ``kernel`` are quantised to e4m3 with one scale each; the GEMM's epilogue
dequantises (``acc * (sx * sw)``), adds the bias and applies the activation, so the only
passes outside the GEMM are the quantisations themselves. Backward, the output's cotangent
times the activation's derivative is quantised to e5m2 in one pass, the epilogue of a GEMM
whose accumulator is zero (which also takes its amax and column sums, the bias gradient), and
the data and weight gradients are FP8 GEMMs whose epilogues dequantise. Each quantisation also
writes the K-major copy its GEMM reads (Hopper's 8-bit WGMMA reads both operands K-major only),
so no GEMM transposes an FP8 operand: the weight is written both ways, the input and the
gradient once more transposed. A tensor that a GEMM's epilogue quantises (the gradient in its
pass; in ``fp8_mlp`` the hidden value and its gradient too) gets its transposed copy from that
kernel's store; the rest from XLA, rows padded with zeros to a multiple of 16, as TMA needs of
the weight gradient's contraction.

Scaling: with ``meta=None``, *current* scaling (each tensor's scale is its amax over the
format's largest finite value, this step); with an :class:`Fp8Meta`, *delayed* scaling exactly
as ``flax.linen.fp8_ops`` does it: the scale comes from the largest amax of the history, the
history then takes this step's amax, and the gradient of ``meta`` *is* the updated meta (Flax's
``_overwrite_with_gradient`` convention: the training step replaces the meta by its gradient
instead of applying an optimizer to it). Conversions to FP8 saturate to the finite range and
round to nearest even; a NaN stays NaN. Under current scaling, an input or gradient holding
Inf or NaN makes the whole result NaN (its scale is not finite); under delayed scaling, as in
Flax, such an amax enters the history and the scale stays at its last finite value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import activations, arguments
from .ops import gemm

__all__ = ["fp8_dense", "fp8_mlp", "Fp8Meta", "E4M3", "E5M2"]

E4M3 = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, largest finite 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest finite 57344


class Fp8Meta(NamedTuple):
    """The delayed-scaling state of one layer, named and shaped as Flax's FP8 ops keep it: a
    scale ((1,) float32, x ~ q * scale) and an amax history ((length,) float32; each step
    rotates it by one and writes its amax at index 0)
    for the input, the kernel and the output's gradient."""

    input_scale: Any
    input_amax_history: Any
    kernel_scale: Any
    kernel_amax_history: Any
    output_grad_scale: Any
    output_grad_amax_history: Any

    @classmethod
    def init(cls, history_length: int = 1024) -> Fp8Meta:
        """Scales of one and empty histories (Flax's initial values)."""
        if not isinstance(history_length, int) or history_length < 1:
            raise ValueError(f"history_length must be a positive int, got {history_length!r}.")
        ones, zeros = jnp.ones((1,), jnp.float32), jnp.zeros((history_length,), jnp.float32)
        return cls(ones, zeros, ones, zeros, ones, zeros)


def _fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def _amax(x: Any) -> Any:
    """max |x|, NaN if x holds one (XLA's CPU max reduction can drop NaNs: say so explicitly)."""
    return jnp.where(jnp.isnan(x).any(), jnp.nan, jnp.max(jnp.abs(x))).astype(jnp.float32)


def _current_scale(amax: Any, dtype: Any) -> Any:
    """The scale that maps ``amax`` onto ``dtype``'s largest finite value; one for a zero
    tensor. A tensor holding Inf or NaN gets an Inf or NaN scale, so the whole result is NaN
    rather than finite values scaled wrongly."""
    return jnp.where(amax == 0, 1.0, amax / _fp8_max(dtype)).reshape(1)


def _delayed_scale(dtype: Any, scale: Any, history: Any) -> Any:
    """Flax's delayed scale: from the history's largest amax (the previous scale where that is
    zero or not finite)."""
    amax = jnp.max(history, axis=0)
    return jnp.where((amax > 0) & jnp.isfinite(amax), amax / _fp8_max(dtype), scale)


def _pushed(history: Any, amax: Any) -> Any:
    """The amax history with this step's ``amax`` entered, as Flax's FP8 ops enter it."""
    return jnp.roll(history, -1, axis=0).at[0].set(amax)


def _delayed(x: Any, dtype: Any, scale: Any, history: Any) -> tuple[Any, Any]:
    """Flax's delayed-scaling step for ``x``: its scale, and the history with its amax entered."""
    return _delayed_scale(dtype, scale, history), _pushed(history, _amax(x))


# 8-bit values a TMA row must hold a multiple of (16 bytes): the weight gradient contracts over
# the tokens, so its operands' rows are padded with zeros to this many (which add nothing)
_ALIGN = 16


def _transposed(q: Any, align: int = _ALIGN) -> Any:
    """``q`` (M, X) as (X, M') with M' the next multiple of ``align``, zeros past M: the K-major
    copy of an 8-bit operand (of the weight gradient, which contracts over M; of a weight, with
    ``align=1``). The transpose reads ``q`` as stored: the barrier keeps XLA from recomputing
    ``q``'s producer inside the transposing pass (a second, slower pass over 16-bit inputs)."""
    q = jax.lax.optimization_barrier(q)
    return jnp.pad(q, ((0, -q.shape[0] % align), (0, 0))).T


def _quantize(x: Any, dtype: Any, scale: Any) -> Any:
    """``x / scale`` saturated to ``dtype``'s finite range and rounded to it (in float32)."""
    top = _fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale[0], -top, top).astype(dtype)


def _twice(q: Any, transposed: bool) -> tuple[Any, ...]:
    """An epilogue's 8-bit output, returned once more where its call stores a transposed copy."""
    return (q, q) if transposed else (q,)


@functools.lru_cache(maxsize=64)
def _forward_epilogue(activation: Callable[[Any], Any], has_bias: bool, keep_z: bool) -> Callable[..., Any]:
    """``activation(acc * s + bias)`` and, where the backward needs it, the pre-activation."""

    def epilogue(acc, *ops, s):
        z = acc * s + ops[0] if has_bias else acc * s
        return (activation(z), z) if keep_z else activation(z)

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


def _dequantize(acc, *, s):
    return acc * s


_dequantize.__efc_builtin__ = True


def _times_derivative(activation: Callable[[Any], Any], g: Any, z: Any) -> Any:
    """``g`` times ``activation``'s derivative at ``z``: its VJP, in their dtype."""
    return jax.vjp(activation, z)[1](g)[0]


@functools.lru_cache(maxsize=64)
def _gradient_epilogue(activation: Callable[[Any], Any], has_z: bool, transposed: bool) -> Callable[..., Any]:
    """The output gradient's pass as an epilogue (the accumulator unused): the gradient (times
    the activation's derivative) over its scale, stored in e5m2 as is and, where ``transposed``,
    again (the call stores that copy transposed); its amax; its column sums."""

    def epilogue(acc, g, *z, inv_scale):
        if has_z:
            g = _times_derivative(activation, g, z[0])
        return (*_twice(g * inv_scale, transposed), jnp.max(jnp.abs(g)), jnp.sum(g, axis=0))

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


# K of the GEMM whose epilogue is the gradient's pass: the least a 16-bit WGMMA and a TMA row take
_PASS_K = 16


def _stored_both_ways(rows: int, call: Callable[[bool], Sequence[Any]]) -> tuple[Any, ...]:
    """``call(transposed)``'s results with the first one's K-major copy second (an operand of a
    weight gradient, which contracts over the ``rows``). Where ``rows`` is a multiple of
    ``_ALIGN`` the GEMM's kernel stores that copy itself (``call(True)``: the epilogue returns the
    value twice and the call stores the second transposed); elsewhere XLA pads and transposes it.
    Left to XLA, the transpose is one more pass over the tensor, and around the gradient's
    derivative XLA laid that whole computation out transposed, in four float32 passes
    (benchmarks/FINDINGS.md, third H100 sitting)."""
    if rows % _ALIGN == 0:
        return tuple(call(True))
    first, *rest = call(False)
    return (first, _transposed(first), *rest)


def _quantized_gradient(activation: Callable[[Any], Any], g: Any, z: Any, scale: Any) -> tuple[Any, Any, Any, Any]:
    """(gq (M, N), gq transposed (N, M'), amax, float32 column sums) of the output gradient ``g``
    (M, N) times ``activation``'s derivative at ``z`` (None: none), quantised to e5m2 with
    ``scale``, in one pass over ``g`` and ``z``: the epilogue of a GEMM whose accumulator is zero
    (K = 16, next to nothing to multiply)."""
    m, n = g.shape
    zeros = jnp.zeros((m, _PASS_K), jnp.bfloat16), jnp.zeros((_PASS_K, n), jnp.bfloat16)

    def call(transposed: bool) -> Any:
        return gemm(*zeros, _gradient_epilogue(activation, z is not None, transposed), g, *(() if z is None else (z,)),
                    inv_scale=1 / scale[0], transposed_outputs=1 if transposed else None,
                    out_dtypes=(*_twice(E5M2, transposed), jnp.float32, jnp.float32))

    return _stored_both_ways(m, call)


@dataclasses.dataclass(frozen=True)
class _Static:
    activation: Callable[[Any], Any]
    delayed: bool
    x_dtype: Any  # of the output and of x's gradient
    kernel_dtype: Any  # of kernel's gradient
    precision: Any  # of every GEMM


def _scales(static: _Static, x: Any, kernel: Any, meta: Any) -> tuple[Any, Any, Any]:
    """(input scale, kernel scale, the meta's update so far) for this step."""
    if not static.delayed:
        return _current_scale(_amax(x), E4M3), _current_scale(_amax(kernel), E4M3), None
    sx, hx = _delayed(x, E4M3, meta.input_scale, meta.input_amax_history)
    sw, hw = _delayed(kernel, E4M3, meta.kernel_scale, meta.kernel_amax_history)
    return sx, sw, (sx, hx, sw, hw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dense(static: _Static, x, kernel, bias, meta):
    return _fp8_dense_fwd(static, x, kernel, bias, meta)[0]


def _fp8_dense_fwd(static: _Static, x, kernel, bias, meta):
    sx, sw, update = _scales(static, x, kernel, meta)
    xq = _quantize(x, E4M3, sx)
    wq = _quantize(kernel, E4M3, sw)  # (K, N): K-major as the data gradient's B
    keep_z = static.activation is not activations.identity
    ops = () if bias is None else (bias,)
    out = gemm(xq, _transposed(wq, 1), _forward_epilogue(static.activation, bias is not None, keep_z), *ops,
               precision=static.precision, transpose_b=True, s=(sx * sw)[0], out_dtypes=x.dtype)
    y, z = out if keep_z else (out, None)
    return y, (_transposed(xq), wq, sx, sw, z, update, meta, bias)


def _fp8_dense_bwd(static: _Static, residuals, g):
    xq_t, wq, sx, sw, z, update, meta, bias = residuals
    if static.delayed:
        sg = _delayed_scale(E5M2, meta.output_grad_scale, meta.output_grad_amax_history)
    else:
        # this step's amax first: one pass over g (and z) more than delayed scaling makes
        g32 = g.astype(jnp.float32)
        sg = _current_scale(_amax(g32 if z is None else _times_derivative(static.activation, g32,
                                                                          z.astype(jnp.float32))), E5M2)
    gq, gq_t, amax_g, db = _quantized_gradient(static.activation, g, z, sg)
    dx = gemm(gq, wq, _dequantize, precision=static.precision, transpose_b=True, s=(sg * sw)[0], out_dtypes=static.x_dtype)
    dw = gemm(xq_t, gq_t, _dequantize, precision=static.precision, transpose_b=True, s=(sx * sg)[0], out_dtypes=static.kernel_dtype)
    db = None if bias is None else db.astype(bias.dtype)
    d_meta = None
    if static.delayed:  # the gradient of the meta is its update (overwrite with gradient)
        d_meta = Fp8Meta(update[0], update[1], update[2], update[3], sg,
                         _pushed(meta.output_grad_amax_history, amax_g))
    return dx, dw, db, d_meta


_fp8_dense.defvjp(_fp8_dense_fwd, _fp8_dense_bwd)


def fp8_dense(
    x: Any,
    kernel: Any,
    bias: Any = None,
    *,
    activation: str | Callable[[Any], Any] | None = None,
    meta: Fp8Meta | None = None,
    precision: Any = None,
) -> Any:
    """``activation(x @ kernel + bias)`` with ``x`` and ``kernel`` in FP8 (e4m3) and, in the
    backward, the output gradient in e5m2: three FP8 GEMMs whose epilogues dequantise.

    ``x`` is (..., K) and ``kernel`` (K, N), both bf16, fp16 or fp32 (the output takes ``x``'s
    dtype, ``kernel``'s gradient ``kernel``'s); ``bias`` (N,). ``meta=None`` scales each tensor
    by its amax this step; an :class:`Fp8Meta` scales by its amax histories (delayed scaling,
    as Flax's FP8 ops) and its gradient is the updated meta. ``precision`` is every GEMM's, as
    ``efc.gemm`` takes it: by default partial sums are promoted into fp32;
    ``jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM`` asks for the tensor cores' fast
    accumulation (what XLA's FP8 dot, and so Flax's FP8 ops, use on large GEMMs: faster, fewer
    bits over a long K).

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> x, w = jnp.ones((4, 32)), jnp.full((32, 16), 0.25)
    >>> round(float(efc.fp8_dense(x, w, activation="relu")[0, 0]), 4)
    8.0
    """
    x = _checked_input("fp8_dense", "x", x)
    kernel, bias = _checked_layer("fp8_dense", "", x.shape[-1], f"x has shape {x.shape}", kernel, bias)
    lead, (k, n) = x.shape[:-1], kernel.shape
    meta = _checked_meta("meta", meta)
    static = _Static(activations.resolve(activation), meta is not None, x.dtype, kernel.dtype,
                     arguments.precision(precision))
    rows = x.reshape(math.prod(lead), k)
    return _fp8_dense(static, rows, kernel, bias, meta).reshape(*lead, n)


def _checked_input(op: str, name: str, x: Any) -> Any:
    x = arguments.array(name, x)
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"{name} is {x.dtype}; {op} quantises bfloat16, float16 or float32 inputs.")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (..., K).")
    return x


def _checked_layer(op: str, prefix: str, k: int, k_from: str, kernel: Any, bias: Any) -> tuple[Any, Any]:
    """``kernel`` (K, N) and ``bias`` (N,) or None, checked, K = ``k`` (``k_from`` says whose
    dimension that is); the arguments named with ``prefix`` (``"up_"``: ``up_kernel``, ``up_bias``)."""
    kernel = _checked_input(op, f"{prefix}kernel", kernel)
    if kernel.ndim != 2:
        raise ValueError(f"{prefix}kernel must be 2-D (K, N), got shape {kernel.shape}.")
    if kernel.shape[0] != k:
        raise ValueError(f"{k_from} but {prefix}kernel is {kernel.shape}: its first dimension must be {k}.")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (kernel.shape[1],):
            raise ValueError(f"{prefix}bias has shape {bias.shape}; expected ({kernel.shape[1]},).")
    return kernel, bias


def _checked_meta(name: str, meta: Any) -> Fp8Meta | None:
    if meta is None:
        return None
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"{name} must be a jax_efc.Fp8Meta or None, got {type(meta).__name__}.")
    for field, value in zip(meta._fields, meta):
        want = (1,) if field.endswith("scale") else meta.input_amax_history.shape
        if jnp.shape(value) != want or len(want) != 1:
            raise ValueError(f"{name}.{field} has shape {jnp.shape(value)}; expected {want} (Fp8Meta.init "
                             "makes a valid one).")
    return Fp8Meta(*(jnp.asarray(v, jnp.float32) for v in meta))


# The MLP ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _up_epilogue(activation: Callable[[Any], Any], has_bias: bool, transposed: bool) -> Callable[..., Any]:
    """The up projection's epilogue: the hidden value quantised with the down projection's input
    scale (stored as e4m3, saturating; where ``transposed``, again: the call stores that copy
    transposed, the down projection's weight gradient's operand), its amax (the down
    projection's input amax this step), and the pre-activation (the backward's residual)."""

    def epilogue(acc, *ops, s, inv_scale):
        z = acc * s + ops[0] if has_bias else acc * s
        h = activation(z)
        return (*_twice(h * inv_scale, transposed), jnp.max(jnp.abs(h)), z)

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


@functools.lru_cache(maxsize=64)
def _hidden_grad_epilogue(activation: Callable[[Any], Any], has_bias: bool, transposed: bool) -> Callable[..., Any]:
    """The down projection's data-gradient epilogue: the up projection's output gradient (the
    hidden gradient times the activation's derivative at ``z``) quantised with its delayed scale
    (stored as e5m2, saturating; where ``transposed``, again, for the call to store transposed:
    the up projection's weight gradient's operand), its amax and, with an up bias, its column
    sums (that bias's gradient)."""

    def epilogue(acc, z, *, s, inv_scale):
        g = _times_derivative(activation, acc * s, z)
        out = (*_twice(g * inv_scale, transposed), jnp.max(jnp.abs(g)))
        return (*out, jnp.sum(g, axis=0)) if has_bias else out

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


@dataclasses.dataclass(frozen=True)
class _MlpStatic:
    activation: Callable[[Any], Any]
    x_dtype: Any
    up_dtype: Any
    down_dtype: Any
    precision: Any  # of every GEMM


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_mlp(static: _MlpStatic, x, up, down, metas):
    return _fp8_mlp_fwd(static, x, up, down, metas)[0]


def _fp8_mlp_fwd(static: _MlpStatic, x, up, down, metas):
    (up_k, up_b), (down_k, down_b), (mu, md) = up, down, metas
    sx, hx = _delayed(x, E4M3, mu.input_scale, mu.input_amax_history)
    swu, hwu = _delayed(up_k, E4M3, mu.kernel_scale, mu.kernel_amax_history)
    swd, hwd = _delayed(down_k, E4M3, md.kernel_scale, md.kernel_amax_history)
    # the hidden value's scale is the down projection's input scale, known from its history
    # before the up GEMM; this step's amax comes out of that GEMM and enters the history after
    sh = _delayed_scale(E4M3, md.input_scale, md.input_amax_history)
    xq, wuq, wdq = _quantize(x, E4M3, sx), _quantize(up_k, E4M3, swu), _quantize(down_k, E4M3, swd)
    up_ops = [b for b in (up_b,) if b is not None]

    def up_gemm(transposed: bool) -> Any:
        return gemm(xq, _transposed(wuq, 1), _up_epilogue(static.activation, up_b is not None, transposed), *up_ops,
                    precision=static.precision, transpose_b=True, s=(sx * swu)[0], inv_scale=1 / sh[0],
                    transposed_outputs=1 if transposed else None,
                    out_dtypes=(*_twice(E4M3, transposed), jnp.float32, static.x_dtype))

    hq, hq_t, amax_h, z = _stored_both_ways(xq.shape[0], up_gemm)
    hh = _pushed(md.input_amax_history, amax_h)
    y = gemm(hq, _transposed(wdq, 1), _forward_epilogue(activations.identity, down_b is not None, False),
             *[b for b in (down_b,) if b is not None], precision=static.precision, transpose_b=True, s=(sh * swd)[0], out_dtypes=static.x_dtype)
    updates = ((sx, hx, swu, hwu), (sh, hh, swd, hwd))
    return y, (_transposed(xq), hq_t, wuq, wdq, z, (sx, swu, sh, swd), updates, metas, up_b, down_b)


def _fp8_mlp_bwd(static: _MlpStatic, residuals, g):
    xq_t, hq_t, wuq, wdq, z, (sx, swu, sh, swd), updates, (mu, md), up_b, down_b = residuals
    sgy = _delayed_scale(E5M2, md.output_grad_scale, md.output_grad_amax_history)
    gyq, gyq_t, amax_gy, d_down_b = _quantized_gradient(activations.identity, g, None, sgy)
    hgy = _pushed(md.output_grad_amax_history, amax_gy)
    # the up projection's output gradient leaves the down projection's data-gradient GEMM
    # quantised with its delayed scale, with its amax and the up bias's gradient
    sg = _delayed_scale(E5M2, mu.output_grad_scale, mu.output_grad_amax_history)

    def hidden_grad_gemm(transposed: bool) -> Any:
        return gemm(gyq, wdq, _hidden_grad_epilogue(static.activation, up_b is not None, transposed), z,
                    precision=static.precision, transpose_b=True, s=(sgy * swd)[0], inv_scale=1 / sg[0],
                    transposed_outputs=1 if transposed else None,
                    out_dtypes=(*_twice(E5M2, transposed), jnp.float32, *([jnp.float32] if up_b is not None else [])))

    gq, gq_t, amax_g, *d_up_b = _stored_both_ways(gyq.shape[0], hidden_grad_gemm)
    hg = _pushed(mu.output_grad_amax_history, amax_g)
    d_down = (gemm(hq_t, gyq_t, _dequantize, precision=static.precision, transpose_b=True, s=(sh * sgy)[0], out_dtypes=static.down_dtype),
              None if down_b is None else d_down_b.astype(down_b.dtype))
    d_up = (gemm(xq_t, gq_t, _dequantize, precision=static.precision, transpose_b=True, s=(sx * sg)[0],
                 out_dtypes=static.up_dtype),
            None if up_b is None else d_up_b[0].astype(up_b.dtype))
    dx = gemm(gq, wuq, _dequantize, precision=static.precision, transpose_b=True, s=(sg * swu)[0], out_dtypes=static.x_dtype)
    (u, d) = updates
    metas = (Fp8Meta(*u, sg, hg), Fp8Meta(*d, sgy, hgy))  # their gradients are their updates
    return dx, d_up, d_down, metas


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)


def fp8_mlp(
    x: Any,
    up_kernel: Any,
    up_bias: Any,
    down_kernel: Any,
    down_bias: Any,
    *,
    activation: str | Callable[[Any], Any] = "gelu_tanh",
    up_meta: Fp8Meta | None = None,
    down_meta: Fp8Meta | None = None,
    precision: Any = None,
) -> Any:
    """``activation(x @ up_kernel + up_bias) @ down_kernel + down_bias`` with FP8 GEMMs, as two
    :func:`fp8_dense` layers compute it (biases may be None).

    With both layers' metas (delayed scaling), the scales the hidden tensors need are known before
    the GEMMs that make them, so those GEMMs quantise them: the up projection's epilogue writes
    the hidden value already in e4m3 with the down projection's input scale, and its amax; in the
    backward the down projection's data-gradient epilogue computes the activation's derivative
    and writes the up projection's output gradient in e5m2, its amax and the up bias's gradient.
    Both also store the transposed copy the weight gradients read. The hidden tensors are never
    written in 16 bits, nor read again for an amax or a transpose. Without metas
    (current scaling, whose scales need this step's amaxes first) it is the two layers composed.
    The metas' gradients are their updates (Flax's overwrite-with-gradient convention).
    ``precision`` is :func:`fp8_dense`'s.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> x, up, down = jnp.ones((4, 32)), jnp.full((32, 64), 0.25), jnp.full((64, 16), 0.125)
    >>> meta = efc.Fp8Meta.init(4)
    >>> round(float(efc.fp8_mlp(x, up, None, down, None, activation="relu", up_meta=meta, down_meta=meta)[0, 0]), 2)
    64.0
    """
    x = _checked_input("fp8_mlp", "x", x)
    up = _checked_layer("fp8_mlp", "up_", x.shape[-1], f"x has shape {x.shape}", up_kernel, up_bias)
    down = _checked_layer("fp8_mlp", "down_", up[0].shape[1], f"up_kernel has shape {up[0].shape}", down_kernel,
                          down_bias)
    metas = (_checked_meta("up_meta", up_meta), _checked_meta("down_meta", down_meta))
    if (metas[0] is None) != (metas[1] is None):
        raise ValueError("give both up_meta and down_meta (delayed scaling) or neither (current scaling).")
    if metas[0] is None:
        hidden = fp8_dense(x, *up, activation=activation, precision=precision)
        return fp8_dense(hidden, *down, precision=precision)
    static = _MlpStatic(activations.resolve(activation), x.dtype, up[0].dtype, down[0].dtype,
                        arguments.precision(precision))
    lead, k = x.shape[:-1], x.shape[-1]
    y = _fp8_mlp(static, x.reshape(math.prod(lead), k), up, down, metas)
    return y.reshape(*lead, y.shape[-1])

