"""``FusedDense``: ``flax.linen.Dense`` with its activation or epilogue fused into the GEMM.

    from jax_efc.flax.linen import FusedDense
    y = FusedDense(4096, activation="gelu_tanh")(x)                  # gelu_tanh(x @ W + b)
    y = FusedDense(4096, epilogue=lambda z, r: jax.nn.silu(z) + r)(x, residual)

Same attributes, parameter names (``kernel`` (in, features), ``bias`` (features,)), dtypes
and initializers as ``nn.Dense``, so an ``nn.Dense`` checkpoint loads unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from .. import activations
from .dense import check_activation, dense

__all__ = ["FusedDense", "FusedMLP"]

Axes = tuple[str | None, ...]


def _partitioned(init: Callable[..., Any], axes: Axes | None) -> Callable[..., Any]:
    return init if axes is None else nn.with_logical_partitioning(init, axes)


class FusedDense(nn.Module):
    """A dense layer over the last axis, ``activation(x @ kernel + bias)`` in one kernel.

    Attributes are those of ``flax.linen.Dense`` (``features, use_bias, dtype, param_dtype,
    precision, kernel_init, bias_init``) plus:

    - ``activation``: a name from ``jax_efc.ACTIVATIONS`` or a callable of elementwise JAX ops.
    - ``epilogue``: instead of an activation, any epilogue ``epilogue(z, *extra)`` of
      ``z = x @ kernel + bias`` (``x @ kernel`` without a bias) and the extra operands given
      at call time, ``module(x, *extra)``; each is shaped like the output (..., features), a
      column (..., 1), a row (features,) or a scalar. E.g. a residual:
      ``FusedDense(d, epilogue=lambda z, r: gelu(z) + r)(x, r)``. Use a function defined once
      (not a new lambda per call) so its trace is reused.
    - ``kernel_axes`` / ``bias_axes``: logical axis names for ``nn.with_logical_partitioning``
      (e.g. ``("embed", "mlp")`` and ``("mlp",)``); None adds no metadata.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()
    bias_init: Callable[..., Any] = nn.initializers.zeros_init()
    activation: str | Callable[[Any], Any] | None = None
    epilogue: Callable[..., Any] | None = None
    kernel_axes: Axes | None = None
    bias_axes: Axes | None = None

    def __post_init__(self) -> None:
        check_activation(self.activation)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: Any, *extra: Any) -> Any:
        kernel = self.param("kernel", _partitioned(self.kernel_init, self.kernel_axes),
                            (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", _partitioned(self.bias_init, self.bias_axes),
                              (self.features,), self.param_dtype)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return dense(inputs, kernel, bias, extra, activation=self.activation,
                     epilogue=self.epilogue, precision=self.precision)


@functools.lru_cache(maxsize=None)
def _gated(activation: str | Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    act = activations.resolve(activation)

    def gate(z, up):
        return act(z) * up

    return gate


class FusedMLP(nn.Module):
    """``Dense -> activation -> Dense``, or with ``gated=True`` the gated form
    ``(act(x @ W_gate) * (x @ W_up)) @ W_down`` (SwiGLU / GeGLU), the activation and the gate
    product fused into the GEMMs.

    Submodules: ``up`` (and ``gate`` when gated), ``down``, each a ``FusedDense``.
    ``out_features`` defaults to the input's last dimension. ``hidden_axes`` names the hidden
    axis for sharding (with ``embed_axis`` for the model axis); None adds no metadata.
    """

    hidden_features: int
    out_features: int | None = None
    activation: str | Callable[[Any], Any] = "gelu_tanh"
    gated: bool = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    embed_axis: str | None = None
    hidden_axis: str | None = None

    @nn.compact
    def __call__(self, inputs: Any) -> Any:
        named = self.embed_axis is not None or self.hidden_axis is not None
        into = dict(kernel_axes=(self.embed_axis, self.hidden_axis), bias_axes=(self.hidden_axis,)) if named else {}
        out_of = dict(kernel_axes=(self.hidden_axis, self.embed_axis), bias_axes=(self.embed_axis,)) if named else {}
        common = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                      precision=self.precision)
        if self.gated:
            up = FusedDense(self.hidden_features, name="up", **common, **into)(inputs)
            h = FusedDense(self.hidden_features, epilogue=_gated(self.activation), name="gate",
                           **common, **into)(inputs, up)
        else:
            h = FusedDense(self.hidden_features, activation=self.activation, name="up",
                           **common, **into)(inputs)
        out = self.out_features or jnp.shape(inputs)[-1]
        return FusedDense(out, name="down", **common, **out_of)(h)
