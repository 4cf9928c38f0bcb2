"""The computation shared by the Flax layers: a dense layer with a fused activation or epilogue,
the MLP, and their FP8 forms."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..activations import resolve
from ..fp8 import Fp8Meta, fp8_dense, fp8_mlp
from ..gated import check_block
from ..mlp import fused_mlp
from ..ops import fused_dense, gemm

__all__ = ["dense", "mlp"]

FP8_MODES = (None, "current", "delayed")


@functools.lru_cache(maxsize=None)
def _with_bias(epilogue: Callable[..., Any]) -> Callable[..., Any]:
    """``epilogue(acc + bias, *extra)`` as an epilogue of ``acc`` (cached: one trace per epilogue)."""

    def fused(acc, bias, *extra):
        return epilogue(acc + bias, *extra)

    return fused


def _flatten_extra(x: Any, lead: tuple[int, ...]) -> Any:
    """An extra operand shaped like the output, (..., N) or (..., 1), seen as 2-D like the GEMM;
    a row vector (N,) or a scalar is passed as is."""
    x = jnp.asarray(x)
    if x.ndim == len(lead) + 1 and x.shape[:-1] == lead:
        return x.reshape(math.prod(lead), x.shape[-1])
    return x


def dense(
    inputs: Any,
    kernel: Any,
    bias: Any,
    extra: tuple[Any, ...] = (),
    *,
    activation: str | Callable[[Any], Any] | None = None,
    epilogue: Callable[..., Any] | None = None,
    precision: Any = None,
    fp8: str | None = None,
    meta: Fp8Meta | None = None,
) -> Any:
    """``activation(inputs @ kernel + bias)``, or ``epilogue(inputs @ kernel + bias, *extra)``.

    ``inputs`` is (..., K), ``kernel`` (K, N), ``bias`` (N,) or None (then the epilogue gets
    the bare product). Each extra operand is shaped like the output (..., N), a column
    (..., 1), a row vector (N,) or a scalar; the epilogue may return one array or a pytree.
    With ``fp8`` set, ``jax_efc.fp8_dense`` with ``meta`` (None: current scaling).
    """
    if epilogue is None:
        if extra:
            raise TypeError(f"got {len(extra)} extra operand(s) but no epilogue= to take them.")
        if fp8 is not None:
            return fp8_dense(inputs, kernel, bias, activation=activation, meta=meta, precision=precision)
        return fused_dense(inputs, kernel, bias, activation=activation, precision=precision)
    if activation is not None:
        raise ValueError("pass either activation= or epilogue=, not both; "
                         "apply the activation inside the epilogue.")
    lead, (k, n) = inputs.shape[:-1], kernel.shape
    ops = [_flatten_extra(e, lead) for e in extra]
    fn = epilogue
    if bias is not None:
        fn, ops = _with_bias(epilogue), [bias, *ops]
    out = gemm(inputs.reshape(math.prod(lead), k), kernel, fn, *ops, precision=precision)
    return jax.tree.map(lambda y: y.reshape(*lead, n), out)


def mlp(
    inputs: Any,
    up_kernel: Any,
    up_bias: Any,
    gate_kernel: Any,
    gate_bias: Any,
    down_kernel: Any,
    down_bias: Any,
    *,
    activation: str | Callable[[Any], Any],
    precision: Any = None,
    fp8: str | None = None,
    metas: tuple[Fp8Meta | None, Fp8Meta | None, Fp8Meta | None] = (None, None, None),
    gated: int | None = None,
) -> Any:
    """``jax_efc.fused_mlp`` (``gate_kernel`` None: not gated, or with ``gated``, gate and up
    interleaved in ``up_kernel``); with ``fp8`` set, with the metas
    of ``metas`` (up, gate, down; None: current scaling), ``jax_efc.fp8_mlp``, or gated, each
    projection an ``fp8_dense`` and the product ``act(x @ Wg + bg) * (x @ Wu + bu)`` computed by
    XLA between them."""
    if fp8 is None:
        return fused_mlp(inputs, up_kernel, up_bias, down_kernel, down_bias, activation=activation,
                         gate_kernel=gate_kernel, gate_bias=gate_bias, gated=gated, precision=precision)
    up_meta, gate_meta, down_meta = metas
    if gate_kernel is None:
        return fp8_mlp(inputs, up_kernel, up_bias, down_kernel, down_bias, activation=activation, up_meta=up_meta,
                       down_meta=down_meta, precision=precision)
    hidden = (fp8_dense(inputs, gate_kernel, gate_bias, activation=activation, meta=gate_meta, precision=precision)
              * fp8_dense(inputs, up_kernel, up_bias, meta=up_meta, precision=precision))
    return fp8_dense(hidden, down_kernel, down_bias, meta=down_meta, precision=precision)


def check_gated_block(gated_block: Any, gated: bool, fp8: str | None) -> None:
    """Fail at construction on a ``gated_block`` without ``gated=True``, with ``fp8``, or not a
    block width (``jax_efc.gated``)."""
    if gated_block is None:
        return
    if not gated or fp8 is not None:
        raise ValueError(f"gated_block={gated_block!r} interleaves a gated MLP's gate and up kernels; it needs "
                         "gated=True and fp8=None.")
    check_block(gated_block, "gated_block")


def check_activation(activation: str | Callable[[Any], Any] | None) -> None:
    """Fail at construction, not at the first call, on an unknown activation name."""
    resolve(activation)


def check_fp8(fp8: Any, amax_history_length: Any, epilogue: Callable[..., Any] | None = None) -> None:
    """Fail at construction on a bad ``fp8`` mode, an FP8 layer given an epilogue, or a history
    length that is not a positive int."""
    if not (fp8 is None or (isinstance(fp8, str) and fp8 in FP8_MODES)):
        raise ValueError(f"fp8 must be one of {', '.join(map(repr, FP8_MODES))}; got {fp8!r}.")
    if fp8 is not None and epilogue is not None:
        raise ValueError(f"fp8={fp8!r} supports activation= only, not a custom epilogue=.")
    if isinstance(amax_history_length, bool) or not isinstance(amax_history_length, int) \
            or amax_history_length < 1:
        raise ValueError(f"amax_history_length must be a positive int, got {amax_history_length!r}.")
