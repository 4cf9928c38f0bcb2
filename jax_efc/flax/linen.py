"""``FusedDense``: ``flax.linen.Dense`` with its activation or epilogue fused into the GEMM.

    from jax_efc.flax.linen import FusedDense
    y = FusedDense(4096, activation="gelu_tanh")(x)                  # gelu_tanh(x @ W + b)
    y = FusedDense(4096, epilogue=lambda z, r: jax.nn.silu(z) + r)(x, residual)
    y = FusedDense(4096, activation="gelu_tanh", fp8="delayed")(x)     # FP8 GEMMs, delayed scaling

Same attributes, parameter names (``kernel`` (in, features), ``bias`` (features,)), dtypes,
initializers and auto-names (an unnamed one is ``Dense_0``, as an ``nn.Dense`` would be) as
``nn.Dense``, so an ``nn.Dense`` model's checkpoint loads unchanged; with ``fp8="delayed"``, the
FP8 state is kept where ``nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)`` keeps it, so that
model's checkpoint loads unchanged too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from ..fp8 import Fp8Meta
from .dense import check_activation, check_fp8, check_gated_block, dense, mlp

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
    - ``fp8``: None (no FP8), ``"current"`` or ``"delayed"``: ``jax_efc.fp8_dense`` (FP8 GEMMs
      with ``activation``; ``precision`` is theirs, as ``fp8_dense`` takes it) scaling each tensor by its amax this
      step, or by amax histories of ``amax_history_length`` steps kept, as Flax's
      ``Fp8DirectDotGeneralOp`` keeps them, in the ``_overwrite_with_gradient`` collection
      under ``Fp8DirectDotGeneralOp_0``: the training step replaces them by their gradient.
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
    fp8: str | None = None
    amax_history_length: int = 1024

    def __post_init__(self) -> None:
        check_activation(self.activation)
        check_fp8(self.fp8, self.amax_history_length, self.epilogue)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: Any, *extra: Any) -> Any:
        kernel, bias = _dense_params(self, jnp.shape(inputs)[-1])
        meta = _fp8_meta(self)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return dense(inputs, kernel, bias, extra, activation=self.activation, epilogue=self.epilogue,
                     precision=self.precision, fp8=self.fp8, meta=meta)


# Flax names an unnamed submodule after its class's __name__ (``Dense_0``), and so do its
# transforms (``nn.remat(nn.Dense)`` is ``CheckpointDense``): under the name "Dense", an unnamed
# FusedDense takes the name an nn.Dense would, so a plain model's checkpoint loads unchanged.
FusedDense.__name__ = "Dense"


def _dense_params(module: nn.Module, in_features: int) -> tuple[Any, Any]:
    """``nn.Dense``'s parameters, ``kernel`` (in_features, features) and ``bias`` (features,)
    or None, declared in ``module``'s scope."""
    kernel = module.param("kernel", _partitioned(module.kernel_init, module.kernel_axes),
                          (in_features, module.features), module.param_dtype)
    bias = None
    if module.use_bias:
        bias = module.param("bias", _partitioned(module.bias_init, module.bias_axes),
                            (module.features,), module.param_dtype)
    return kernel, bias


def _history_start(length: int, field: str) -> Any:
    """The initial value of one of ``Fp8Meta``'s fields."""
    return getattr(Fp8Meta.init(length), field)


class _Fp8State(nn.Module):
    """One layer's delayed-scaling state: ``Fp8Meta``'s fields, named, shaped and initialized
    as Flax's FP8 ops keep them, in the ``_overwrite_with_gradient`` collection."""

    amax_history_length: int

    @nn.compact
    def __call__(self) -> Fp8Meta:
        return Fp8Meta(*(self.variable(OVERWRITE_WITH_GRADIENT, field, _history_start,
                                       self.amax_history_length, field).value
                         for field in Fp8Meta._fields))


def _fp8_meta(module: nn.Module) -> Fp8Meta | None:
    """With ``module.fp8 == "delayed"``, the meta declared in ``module``'s scope under the name
    ``nn.Dense`` gives its (unnamed) ``dot_general_cls`` instance, else None."""
    if module.fp8 != "delayed":
        return None
    return _Fp8State(module.amax_history_length, name="Fp8DirectDotGeneralOp_0")()


class _DenseParams(nn.Module):
    """The parameters (and FP8 state) of one of ``FusedMLP``'s layers, under the layer's name,
    as ``nn.Dense`` keeps them."""

    features: int
    use_bias: bool
    param_dtype: Any
    kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()
    bias_init: Callable[..., Any] = nn.initializers.zeros_init()
    kernel_axes: Axes | None = None
    bias_axes: Axes | None = None
    fp8: str | None = None
    amax_history_length: int = 1024

    @nn.compact
    def __call__(self, in_features: int) -> tuple[Any, Any, Fp8Meta | None]:
        return (*_dense_params(self, in_features), _fp8_meta(self))


class FusedMLP(nn.Module):
    """``Dense -> activation -> Dense``, or with ``gated=True`` the gated form
    ``(act(x @ W_gate) * (x @ W_up)) @ W_down`` (SwiGLU / GeGLU), as ``jax_efc.fused_mlp``: the
    activation and the gate product fused into the first GEMM, and in the backward the
    activation's derivative into the down projection's data-gradient GEMM.

    Parameters: ``up`` (and ``gate`` when gated), ``down``, each with ``nn.Dense``'s
    ``kernel`` and ``bias``. ``out_features`` defaults to the input's last dimension.
    ``hidden_axis`` names the hidden axis for sharding (with ``embed_axis`` for the model
    axis); None adds no metadata.

    ``fp8`` and ``amax_history_length`` are ``FusedDense``'s: each projection keeps its own state
    (under ``up``, ``gate``, ``down``) and the MLP runs ``jax_efc.fp8_mlp``; the gated form runs
    each projection as a ``jax_efc.fp8_dense`` and XLA computes the product between the FP8 GEMMs
    (it is not fused into the first GEMM).

    ``gated_block=B`` (gated, not FP8) keeps gate and up as one layer ``gate_up`` instead, its
    kernel (in, 2 * hidden) and bias interleaved in blocks of ``B`` columns
    (``jax_efc.interleave_gated`` converts a checkpoint of ``gate`` and ``up``): one gated GEMM
    computes both.
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
    fp8: str | None = None
    amax_history_length: int = 1024
    gated_block: int | None = None

    def __post_init__(self) -> None:
        check_activation(self.activation)
        check_fp8(self.fp8, self.amax_history_length)
        check_gated_block(self.gated_block, self.gated, self.fp8)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: Any) -> Any:
        named = self.embed_axis is not None or self.hidden_axis is not None
        into = dict(kernel_axes=(self.embed_axis, self.hidden_axis), bias_axes=(self.hidden_axis,)) if named else {}
        out_of = dict(kernel_axes=(self.hidden_axis, self.embed_axis), bias_axes=(self.embed_axis,)) if named else {}
        d_in, d_out = jnp.shape(inputs)[-1], self.out_features or jnp.shape(inputs)[-1]

        def layer(name: str, in_features: int, features: int, axes: dict[str, Axes]) -> tuple[Any, Any, Any]:
            return _DenseParams(features, self.use_bias, self.param_dtype, fp8=self.fp8,
                                amax_history_length=self.amax_history_length, name=name, **axes)(in_features)

        if self.gated_block:
            gate_up = layer("gate_up", d_in, 2 * self.hidden_features, into)
            down = layer("down", self.hidden_features, d_out, out_of)
            x, w, b, w_down, b_down = promote_dtype(inputs, *gate_up[:2], *down[:2], dtype=self.dtype)
            return mlp(x, w, b, None, None, w_down, b_down, activation=self.activation, precision=self.precision,
                       gated=self.gated_block)
        up = layer("up", d_in, self.hidden_features, into)
        gate = layer("gate", d_in, self.hidden_features, into) if self.gated else (None, None, None)
        down = layer("down", self.hidden_features, d_out, out_of)
        params = promote_dtype(inputs, *up[:2], *gate[:2], *down[:2], dtype=self.dtype)
        return mlp(*params, activation=self.activation, precision=self.precision, fp8=self.fp8,
                   metas=(up[2], gate[2], down[2]))
