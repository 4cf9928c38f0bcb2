"""``FusedLinear``: ``flax.nnx.Linear`` with its activation or epilogue fused into the GEMM;
``FusedMLP``: two (gated: three) of them as one ``jax_efc.fused_mlp``.

    from jax_efc.flax.nnx import FusedLinear, FusedMLP
    layer = FusedLinear(1024, 4096, activation="gelu_tanh", rngs=nnx.Rngs(0))
    y = layer(x)                                                     # gelu_tanh(x @ W + b)
    mlp = FusedMLP(1024, 4096, activation="silu", gated=True, rngs=nnx.Rngs(0))

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

from ..mlp import fused_mlp
from .dense import check_activation, dense

__all__ = ["FusedLinear", "FusedMLP"]


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


class FusedMLP(nnx.Module):
    """``Linear -> activation -> Linear``, or with ``gated=True``
    ``(act(x @ W_gate) * (x @ W_up)) @ W_down`` (SwiGLU / GeGLU), as ``jax_efc.fused_mlp``.

    Layers ``up`` (and ``gate``), ``down``: ``FusedLinear``s, each with ``nnx.Linear``'s state,
    made in that order from ``rngs`` (so an MLP of ``nnx.Linear`` made in the same order gets
    the same values). ``out_features`` defaults to ``in_features``. ``embed_axis`` and
    ``hidden_axis`` name the model and hidden axes for sharding (the kernels' and biases'
    ``out_sharding``); None adds no metadata.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        *,
        activation: str | Callable[[Any], Any] = "gelu_tanh",
        gated: bool = False,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable[..., Any] = nnx.initializers.lecun_normal(),
        bias_init: Callable[..., Any] = nnx.initializers.zeros_init(),
        embed_axis: str | None = None,
        hidden_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        check_activation(activation)
        named = embed_axis is not None or hidden_axis is not None

        def linear(d_in: int, d_out: int, axes: tuple[str | None, str | None]) -> FusedLinear:
            meta = (dict(kernel_metadata={"out_sharding": axes}, bias_metadata={"out_sharding": axes[1:]})
                    if named else {})
            return FusedLinear(d_in, d_out, use_bias=use_bias, param_dtype=param_dtype,
                               kernel_init=kernel_init, bias_init=bias_init, rngs=rngs, **meta)

        self.up = linear(in_features, hidden_features, (embed_axis, hidden_axis))
        self.gate = linear(in_features, hidden_features, (embed_axis, hidden_axis)) if gated else nnx.data(None)
        self.down = linear(hidden_features, out_features or in_features, (hidden_axis, embed_axis))
        self.activation = activation
        self.dtype = dtype
        self.precision = precision

    def __call__(self, inputs: Any) -> Any:
        layers = [self.up, self.gate, self.down]
        params = [p for layer in layers for p in
                  ((None, None) if layer is None else
                   (layer.kernel[...], layer.bias[...] if layer.bias is not None else None))]
        inputs, up_k, up_b, gate_k, gate_b, down_k, down_b = dtypes.promote_dtype(
            (inputs, *params), dtype=self.dtype)
        return fused_mlp(inputs, up_k, up_b, down_k, down_b, activation=self.activation,
                         gate_kernel=gate_k, gate_bias=gate_b, precision=self.precision)
