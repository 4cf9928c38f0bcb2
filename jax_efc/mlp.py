"""``fused_mlp``: a two-layer MLP whose backward fuses the activation's derivative into a GEMM.

Differentiated layer by layer, an MLP's backward computes the hidden cotangent with one GEMM
(the down projection's data gradient), then multiplies it by the activation's derivative in
an elementwise pass of its own, and sums it over rows for the bias gradient in another. Here
the derivative and the bias gradients' column sums are the epilogue of the same GEMM, so the
hidden cotangent is never written and not read back for the sums.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import activations
from .epilogue import EpilogueError
from .gated import check_block, interleave_gated, split_gated
from .ops import fused_dense, gemm
from .log import log_once

__all__ = ["fused_mlp"]


@dataclasses.dataclass(frozen=True)
class _Mlp:
    """The static part of one call."""

    activation: Callable[[Any], Any]
    precision: Any
    block: int = 0  # the first layer holds gate and up interleaved in blocks of this width (jax_efc.gated)


@functools.lru_cache(maxsize=256)
def _hidden(activation: Callable[[Any], Any], bias: bool, gated: bool) -> Callable[..., Any]:
    """``h(acc, [bias], [up]) = activation(acc + bias) [* up]``: the hidden layer's value."""

    def h(acc, *ops):
        z = acc + ops[0] if bias else acc
        return activation(z) * ops[-1] if gated else activation(z)

    return h


@functools.lru_cache(maxsize=256)
def _forward_epilogue(activation: Callable[[Any], Any], bias: bool, gated: bool) -> Callable[..., Any]:
    """The first GEMM's epilogue: the hidden value and the accumulator (the backward's residual)."""
    h = _hidden(activation, bias, gated)

    def epilogue(acc, *ops):
        return h(acc, *ops), acc

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


@functools.lru_cache(maxsize=256)
def _backward_epilogue(activation: Callable[[Any], Any], bias: bool, gated: bool,
                       summed: tuple[bool, ...]) -> Callable[..., Any]:
    """The data-gradient GEMM's epilogue: its product is the hidden cotangent, and it returns the
    cotangents of the first GEMM's accumulator (and, gated, of the up projection), then the
    column sums (float32) of those whose layer has a bias (``summed``, one flag per cotangent):
    the bias gradients."""
    h = _hidden(activation, bias, gated)

    def epilogue(d_hidden, acc, *ops):
        fixed, up = (ops[:-1], ops[-1:]) if gated else (ops, ())
        _, pullback = jax.vjp(lambda a, *u: h(a, *fixed, *u), acc, *up)
        cts = pullback(d_hidden)
        return (*cts, *(jnp.sum(g, axis=0) for g, s in zip(cts, summed) if s))

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


@functools.lru_cache(maxsize=256)
def _gated_forward_epilogue(activation: Callable[[Any], Any], bias: bool) -> Callable[..., Any]:
    """The gated GEMM's epilogue: the hidden value, the gate's accumulator and the up projection
    (the backward's residuals, as the two-GEMM form keeps them)."""
    h = _hidden(activation, bias, True)

    def epilogue(g, u, *biases):
        up = u + biases[1] if bias else u
        return h(g, *biases[:1], up), g, up

    epilogue.__efc_builtin__ = activations.is_builtin(activation)
    return epilogue


def _accumulate(acc, partial):
    return acc + partial


_accumulate.__efc_builtin__ = True


def _column_sum(x, like):
    return None if like is None else jnp.sum(x, axis=0, dtype=jnp.float32).astype(like.dtype)


def _hidden_cotangents(epilogue: Callable[..., Any], ct, down_kernel, acc, ops: list[Any], precision: Any
                       ) -> list[Any]:
    """``epilogue(ct @ down_kernel.T, acc, *ops)``: the cotangents of the first GEMM's
    accumulator (and of the up projection) in ``acc``'s dtype, then their bias gradients in
    float32. One GEMM, or, where the activation's derivative holds an operation the kernel
    cannot fuse, the GEMM (fp32 out) and then the derivative in XLA."""
    try:
        return list(gemm(ct, down_kernel, epilogue, acc, *ops, transpose_b=True, precision=precision))
    except EpilogueError as e:
        log_once(logging.WARNING, f"fused_mlp evaluates the activation's derivative unfused: {e}")
    d_hidden = gemm(ct, down_kernel, transpose_b=True, precision=precision, out_dtypes=jnp.float32)
    outs = epilogue(d_hidden, *(x.astype(jnp.float32) for x in (acc, *ops)))
    return [g.astype(acc.dtype) if g.ndim == 2 else g for g in outs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp(static: _Mlp, x, first, up, down):
    return _mlp_fwd(static, x, first, up, down)[0]


def _mlp_fwd(static: _Mlp, x, first, up, down):
    """``first`` is the activation's layer (kernel, bias or None; with ``static.block``, gate and
    up interleaved), ``up`` the gated form's other layer (None when not gated, or interleaved),
    ``down`` the output layer."""
    p, gated, bias = static.precision, up is not None, first[1] is not None
    if static.block:
        biases = split_gated(first[1], static.block) if bias else ()
        hidden, acc, up_value = gemm(x, first[0], _gated_forward_epilogue(static.activation, bias), *biases,
                                     gated=static.block, precision=p)
        return fused_dense(hidden, *down, precision=p), (x, first, up, down, hidden, acc, (up_value,))
    up_value = (fused_dense(x, *up, precision=p),) if gated else ()
    ops = [first[1]] * bias + list(up_value)
    hidden, acc = gemm(x, first[0], _forward_epilogue(static.activation, bias, gated), *ops, precision=p)
    return fused_dense(hidden, *down, precision=p), (x, first, up, down, hidden, acc, up_value)


def _mlp_bwd(static: _Mlp, residuals, ct):
    x, first, up, down, hidden, acc, up_value = residuals
    p, bias = static.precision, first[1] is not None
    gated = up is not None or bool(static.block)
    d_down = (gemm(hidden, ct, transpose_a=True, precision=p), _column_sum(ct, down[1]))
    if static.block:
        # the gate's and the up projection's cotangents from one GEMM (the gated derivative its
        # epilogue), then, interleaved, each of the first layer's gradients from one GEMM
        gate_bias = None if first[1] is None else split_gated(first[1], static.block)[0]
        d_gate, d_up, *sums = _hidden_cotangents(
            _backward_epilogue(static.activation, bias, True, (bias, bias)), ct, down[0], acc,
            [gate_bias] * bias + list(up_value), p)
        d_pair = interleave_gated(d_gate, d_up, static.block)
        d_bias = interleave_gated(*sums, static.block).astype(first[1].dtype) if bias else None
        d_first = (gemm(x, d_pair, transpose_a=True, precision=p), d_bias)
        return gemm(d_pair, first[0], transpose_b=True, precision=p), d_first, None, d_down
    layers = (first, up) if gated else (first,)
    summed = tuple(layer[1] is not None for layer in layers)
    outs = _hidden_cotangents(_backward_epilogue(static.activation, bias, gated, summed), ct, down[0],
                              acc, [first[1]] * bias + list(up_value), p)
    d_values, sums = outs[:len(layers)], iter(outs[len(layers):])
    d_layers = [(gemm(x, d, transpose_a=True, precision=p), None if layer[1] is None else
                 next(sums).astype(layer[1].dtype)) for d, layer in zip(d_values, layers)]
    d_x = gemm(d_values[0], first[0], transpose_b=True, precision=p)
    if gated:
        d_x = gemm(d_values[1], up[0], _accumulate, d_x, transpose_b=True, precision=p)
    return d_x, d_layers[0], d_layers[1] if gated else None, d_down


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _check_layer(name: str, kernel: Any, bias: Any, k: int, n: int | None) -> tuple[Any, Any]:
    kernel = jnp.asarray(kernel)
    if kernel.ndim != 2 or kernel.shape[0] != k or (n is not None and kernel.shape[1] != n):
        want = f"({k}, {'N' if n is None else n})"
        raise ValueError(f"{name}_kernel has shape {kernel.shape}; expected {want}.")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (kernel.shape[1],):
            raise ValueError(f"{name}_bias has shape {bias.shape}; expected ({kernel.shape[1]},).")
    return kernel, bias


def fused_mlp(
    x: Any,
    up_kernel: Any,
    up_bias: Any,
    down_kernel: Any,
    down_bias: Any,
    *,
    activation: str | Callable[[Any], Any] = "gelu_tanh",
    gate_kernel: Any = None,
    gate_bias: Any = None,
    gated: int | None = None,
    precision: Any = None,
) -> Any:
    """``activation(x @ up_kernel + up_bias) @ down_kernel + down_bias``, or with a gate
    ``(activation(x @ gate_kernel + gate_bias) * (x @ up_kernel + up_bias)) @ down_kernel +
    down_bias`` (SwiGLU, GeGLU). Each bias may be None.

    ``x`` is (..., K), ``up_kernel`` and ``gate_kernel`` (K, H), ``down_kernel`` (H, D). The
    activation (and the gate's product) is fused into the first GEMM; in the backward, its
    derivative is fused into the down projection's data-gradient GEMM.

    ``gated=B``: ``up_kernel`` (K, 2H) and ``up_bias`` (2H,) hold the gate and the up projection
    interleaved in blocks of ``B`` columns (``jax_efc.interleave_gated``), and one gated GEMM
    computes both (``gemm(..., gated=B)``); the gradients come back in that layout. With
    ``gate_kernel`` instead, the up projection is a GEMM of its own, read by the gate's.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> x = jnp.ones((4, 16))
    >>> up, down = jnp.full((16, 64), 0.1), jnp.full((64, 16), 0.1)
    >>> y = efc.fused_mlp(x, up, None, down, None, activation="silu", gate_kernel=up)
    >>> y.shape
    (4, 16)
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., K).")
    lead, k = x.shape[:-1], x.shape[-1]
    up = _check_layer("up", up_kernel, up_bias, k, None)
    hidden = up[0].shape[1]
    block = 0
    if gated is not None:
        block = check_block(gated, "gated")
        if gate_kernel is not None or gate_bias is not None:
            raise ValueError("gated: up_kernel holds the gate already; give gate_kernel and gate_bias, or gated, "
                             "not both.")
        if hidden % (2 * block):
            raise ValueError(f"gated={block}: up_kernel has {hidden} columns, not a multiple of {2 * block} (whole "
                             "gate and up blocks; jax_efc.interleave_gated builds the layout).")
        hidden //= 2
    gate = None if gate_kernel is None else _check_layer("gate", gate_kernel, gate_bias, k, hidden)
    if gate is None and gate_bias is not None:
        raise ValueError("gate_bias given without gate_kernel.")
    down = _check_layer("down", down_kernel, down_bias, hidden, None)
    first, other = (up, None) if gate is None else (gate, up)
    rows = x.reshape(math.prod(lead), k)  # not -1: a reshape cannot infer it when K is 0
    y = _mlp(_Mlp(activations.resolve(activation), precision, block), rows, first, other, down)
    return y.reshape(*lead, y.shape[-1])
