"""``FusedLinear``: ``flax.nnx.Linear`` with its activation or epilogue fused into the GEMM;
``FusedMLP``: two (gated: three) of them as one ``jax_efc.fused_mlp``.

    from jax_efc.flax.nnx import FusedLinear, FusedMLP
    layer = FusedLinear(1024, 4096, activation="gelu_tanh", rngs=nnx.Rngs(0))
    y = layer(x)                                                     # gelu_tanh(x @ W + b)
    mlp = FusedMLP(1024, 4096, activation="silu", gated=True, rngs=nnx.Rngs(0))
    layer = FusedLinear(1024, 4096, fp8="delayed", rngs=nnx.Rngs(0))  # FP8 GEMMs, delayed scaling

Same constructor, parameters (``kernel`` (in, out), ``bias`` (out,)), initializers and rng
use as ``nnx.Linear``, so the same ``Rngs`` gives the same values and its state loads unchanged.

Flax's nnx has no FP8 layers of its own; delayed scaling keeps its state in
:class:`OverwriteWithGradient` variables, the nnx type of linen's ``_overwrite_with_gradient``
collection (registered under that name, so ``nnx.bridge`` maps one onto the other): the
training step differentiates with respect to them too and replaces them by their gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.nnx.nn import dtypes

from ..fp8 import Fp8Meta
from .dense import check_activation, check_fp8, check_gated_block, dense, mlp

__all__ = ["FusedLinear", "FusedMLP", "OverwriteWithGradient"]


class OverwriteWithGradient(nnx.Variable):
    """State that the training step replaces by its gradient instead of passing it to the
    optimizer: FP8 scales and amax histories, whose gradient ``jax_efc.fp8_dense`` makes their
    next value (linen's ``_overwrite_with_gradient`` collection)."""


try:  # the linen collection's nnx type, unless one was made for it first (nnx.bridge makes one)
    nnx.register_variable_name(OVERWRITE_WITH_GRADIENT, OverwriteWithGradient)
except ValueError:
    pass


class _Fp8State(nnx.Module):
    """One layer's delayed-scaling state: ``Fp8Meta``'s fields, named, shaped and initialized as
    Flax's FP8 ops keep them, as ``OverwriteWithGradient`` variables."""

    def __init__(self, amax_history_length: int):
        for field, value in zip(Fp8Meta._fields, Fp8Meta.init(amax_history_length)):
            setattr(self, field, OverwriteWithGradient(value))

    def meta(self) -> Fp8Meta:
        return Fp8Meta(*(getattr(self, field)[...] for field in Fp8Meta._fields))


class FusedLinear(nnx.Module):
    """A dense layer over the last axis, ``activation(x @ kernel + bias)`` in one kernel.

    Arguments are those of ``nnx.Linear`` (``in_features, out_features, use_bias, dtype,
    param_dtype, precision, kernel_init, bias_init, rngs``, and ``kernel_metadata`` /
    ``bias_metadata``, e.g. ``{"out_sharding": ("embed", "mlp")}``, set on the ``nnx.Param``)
    plus ``activation`` (a name from ``jax_efc.ACTIVATIONS`` or a callable) or, instead,
    ``epilogue``: ``epilogue(z, *extra)`` of ``z = x @ kernel + bias`` and the extra operands
    given at call time, ``layer(x, *extra)`` (see ``jax_efc.flax.linen.FusedDense``).

    ``fp8``: None (no FP8), ``"current"`` or ``"delayed"``, as ``FusedDense``'s (``precision``
    is the FP8 GEMMs', as ``fp8_dense`` takes it); delayed scaling keeps ``Fp8Meta``'s fields (histories of
    ``amax_history_length`` steps) as ``OverwriteWithGradient`` variables under ``fp8_meta``.
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
        fp8: str | None = None,
        amax_history_length: int = 1024,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        check_activation(activation)
        check_fp8(fp8, amax_history_length, epilogue)
        # rng draws in nnx.Linear's order (kernel, then bias): the same Rngs, the same values
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                **kernel_metadata)
        self.bias = nnx.data(None)
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
        self.fp8_meta = _Fp8State(amax_history_length) if fp8 == "delayed" else nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.activation = activation
        self.epilogue = epilogue
        self.fp8 = fp8

    def meta(self) -> Fp8Meta | None:
        """The delayed-scaling state as an ``Fp8Meta``, None without it."""
        return None if self.fp8_meta is None else self.fp8_meta.meta()

    def __call__(self, inputs: Any, *extra: Any) -> Any:
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = dtypes.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
        return dense(inputs, kernel, bias, extra, activation=self.activation, epilogue=self.epilogue,
                     precision=self.precision, fp8=self.fp8, meta=self.meta())


class FusedMLP(nnx.Module):
    """``Linear -> activation -> Linear``, or with ``gated=True``
    ``(act(x @ W_gate) * (x @ W_up)) @ W_down`` (SwiGLU / GeGLU), as ``jax_efc.fused_mlp``.

    Layers ``up`` (and ``gate``), ``down``: ``FusedLinear``s, each with ``nnx.Linear``'s state,
    made in that order from ``rngs`` (so an MLP of ``nnx.Linear`` made in the same order gets
    the same values). ``out_features`` defaults to ``in_features``. ``embed_axis`` and
    ``hidden_axis`` name the model and hidden axes for sharding (the kernels' and biases'
    ``out_sharding``); None adds no metadata. ``fp8`` and ``amax_history_length`` are
    ``FusedLinear``'s, for each layer (each its own state): ``jax_efc.fp8_mlp``, or gated,
    ``fp8_dense`` layers with XLA computing the product between the FP8 GEMMs.

    ``gated_block=B`` (gated, not FP8) makes gate and up one layer ``gate_up``, its kernel
    (in, 2 * hidden) and bias interleaved in blocks of ``B`` columns (``jax_efc.interleave_gated``):
    one gated GEMM computes both.
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
        fp8: str | None = None,
        amax_history_length: int = 1024,
        gated_block: int | None = None,
        rngs: nnx.Rngs,
    ):
        check_activation(activation)
        check_fp8(fp8, amax_history_length)
        check_gated_block(gated_block, gated, fp8)
        named = embed_axis is not None or hidden_axis is not None

        def linear(d_in: int, d_out: int, axes: tuple[str | None, str | None]) -> FusedLinear:
            meta = (dict(kernel_metadata={"out_sharding": axes}, bias_metadata={"out_sharding": axes[1:]})
                    if named else {})
            return FusedLinear(d_in, d_out, use_bias=use_bias, param_dtype=param_dtype, kernel_init=kernel_init,
                               bias_init=bias_init, fp8=fp8, amax_history_length=amax_history_length,
                               rngs=rngs, **meta)

        self.gated_block = gated_block
        if gated_block:
            self.gate_up = linear(in_features, 2 * hidden_features, (embed_axis, hidden_axis))
        else:
            self.up = linear(in_features, hidden_features, (embed_axis, hidden_axis))
            self.gate = linear(in_features, hidden_features, (embed_axis, hidden_axis)) if gated else nnx.data(None)
        self.down = linear(hidden_features, out_features or in_features, (hidden_axis, embed_axis))
        self.activation = activation
        self.dtype = dtype
        self.precision = precision
        self.fp8 = fp8

    def __call__(self, inputs: Any) -> Any:
        if self.gated_block:
            x, w, b, w_down, b_down = dtypes.promote_dtype(
                (inputs, *_params(self.gate_up), *_params(self.down)), dtype=self.dtype)
            return mlp(x, w, b, None, None, w_down, b_down, activation=self.activation, precision=self.precision,
                       gated=self.gated_block)
        layers = [self.up, self.gate, self.down]
        params = [p for layer in layers for p in
                  ((None, None) if layer is None else
                   (layer.kernel[...], layer.bias[...] if layer.bias is not None else None))]
        metas = tuple(None if layer is None else layer.meta() for layer in layers)
        return mlp(*dtypes.promote_dtype((inputs, *params), dtype=self.dtype), activation=self.activation,
                   precision=self.precision, fp8=self.fp8, metas=metas)


def _params(layer: FusedLinear) -> tuple[Any, Any]:
    """A layer's kernel and bias (None without one)."""
    return layer.kernel[...], layer.bias[...] if layer.bias is not None else None
