"""Built-in activations by name; each is a plain elementwise JAX function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "resolve", "is_builtin"]


def identity(x: Any) -> Any:
    return x


def relu(x: Any) -> Any:
    return jnp.maximum(x, 0.0)


def leaky_relu(x: Any, negative_slope: float = 0.01) -> Any:
    return jnp.where(x >= 0, x, negative_slope * x)


def gelu(x: Any) -> Any:
    """The exact GELU, x * Phi(x), with erf (``jax.nn.gelu(x, approximate=False)``)."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: Any) -> Any:
    """The tanh approximation of GELU (``jax.nn.gelu``'s default, and Flax's ``nn.gelu``)."""
    return jax.nn.gelu(x, approximate=True)


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


def is_builtin(fn: Any) -> bool:
    """Whether ``fn`` is one of the built-in activations (pure: it reads no Python state)."""
    return any(fn is f for f in ACTIVATIONS.values())


def resolve(activation: str | Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The function for a name, a callable as is, ``None`` for the identity."""
    if activation is None:
        return identity
    if callable(activation):
        return activation
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a name, a callable or None, got {type(activation).__name__}.")
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)} "
            "or pass a callable made of elementwise JAX ops."
        ) from None
