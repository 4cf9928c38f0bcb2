"""Built-in activations by name; each is a plain elementwise JAX function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "resolve"]


def identity(x: Any) -> Any:
    return x


def relu(x: Any) -> Any:
    return jnp.maximum(x, 0.0)


def leaky_relu(x: Any, negative_slope: float = 0.01) -> Any:
    return jnp.where(x >= 0, x, negative_slope * x)


# The GELUs below are jax.nn.gelu's functions written with fewer fp32 operations: in a
# kernel epilogue every operation on every element costs GEMM time (about 0.3% each on
# an H200), and the outputs differ from jax.nn.gelu's only by fp32 rounding.
_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


def gelu(x: Any) -> Any:
    """The exact GELU, x * Phi(x) = x/2 * erfc(-x/sqrt(2)) (``jax.nn.gelu(x, approximate=False)``)."""
    return 0.5 * x * jax.lax.erfc(x * -_SQRT_HALF)


def gelu_tanh(x: Any) -> Any:
    """The tanh approximation of GELU (``jax.nn.gelu``'s default, and Flax's ``nn.gelu``),
    x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), as h + h * tanh(x * (a + b x^2))
    with h = x/2: five multiplies and adds instead of eight."""
    h = 0.5 * x
    return h + h * jnp.tanh(x * (_SQRT_2_OVER_PI + _SQRT_2_OVER_PI * _GELU_CUBIC * (x * x)))


def relu_squared(x: Any) -> Any:
    r = jnp.maximum(x, 0.0)
    return r * r


ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "identity": identity,
    "relu": relu,
    "leaky_relu": leaky_relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "softplus": jax.nn.softplus,
    "relu_squared": relu_squared,
}


def resolve(activation: str | Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The function for a name, a callable as is, ``None`` for the identity."""
    if activation is None:
        return identity
    if callable(activation):
        return activation
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)} "
            "or pass a callable made of elementwise JAX ops."
        ) from None
