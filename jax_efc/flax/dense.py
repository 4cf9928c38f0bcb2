"""The computation shared by the Flax layers: a dense layer with a fused activation or epilogue."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..activations import resolve
from ..ops import fused_dense, gemm

__all__ = ["dense"]


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
) -> Any:
    """``activation(inputs @ kernel + bias)``, or ``epilogue(inputs @ kernel + bias, *extra)``.

    ``inputs`` is (..., K), ``kernel`` (K, N), ``bias`` (N,) or None (then the epilogue gets
    the bare product). Each extra operand is shaped like the output (..., N), a column
    (..., 1), a row vector (N,) or a scalar; the epilogue may return one array or a pytree.
    """
    if epilogue is None:
        if extra:
            raise TypeError(f"got {len(extra)} extra operand(s) but no epilogue= to take them.")
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


def check_activation(activation: str | Callable[[Any], Any] | None) -> None:
    """Fail at construction, not at the first call, on an unknown activation name."""
    resolve(activation)
