"""``FusedLinear``: ``flax.nnx.Linear`` with its activation or epilogue fused into the GEMM.

    from jax_efc.flax.nnx import FusedLinear
    layer = FusedLinear(1024, 4096, activation="gelu_tanh", rngs=nnx.Rngs(0))
    y = layer(x)                                                     # gelu_tanh(x @ W + b)

Same constructor, parameters (``kernel`` (in, out), ``bias`` (out,)), initializers and rng
use as ``nnx.Linear``, so the same ``Rngs`` gives the same values and its state loads unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from .dense import check_activation, dense

__all__ = ["FusedLinear"]


class FusedLinear(nnx.Module):
    """A dense layer over the last axis, ``activation(x @ kernel + bias)`` in one kernel.

    Arguments are those of ``nnx.Linear`` (``in_features, out_features, use_bias, dtype,
    param_dtype, precision, kernel_init, bias_init, rngs``, and ``kernel_metadata`` /
    ``bias_metadata``, e.g. ``{"out_sharding": ("embed", "mlp")}``, set on the ``nnx.Param``)
    plus ``activation`` (a name from ``jax_efc.ACTIVATIONS`` or a callable) or, instead,
    ``epilogue``: ``epilogue(z, *extra)`` of ``z = x @ kernel + bias`` and the extra operands
    given at call time, ``layer(x, *extra)`` (see ``jax_efc.flax.linen.FusedDense``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable[..., Any] = nnx.initializers.lecun_normal(),
        bias_init: Callable[..., Any] = nnx.initializers.zeros_init(),
        activation: str | Callable[[Any], Any] | None = None,
        epilogue: Callable[..., Any] | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        check_activation(activation)
        # rng draws in nnx.Linear's order (kernel, then bias): the same Rngs, the same values
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                **kernel_metadata)
        self.bias = nnx.data(None)
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.activation = activation
        self.epilogue = epilogue

    def __call__(self, inputs: Any, *extra: Any) -> Any:
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = dtypes.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
        return dense(inputs, kernel, bias, extra, activation=self.activation,
                     epilogue=self.epilogue, precision=self.precision)
