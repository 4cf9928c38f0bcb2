"""Flax layers built on jax_efc's fused GEMMs.

``jax_efc.flax.FusedDense`` (``jax_efc.flax.linen.FusedDense``) is a drop-in for ``flax.linen.Dense`` and
``jax_efc.flax.nnx.FusedLinear`` one for ``flax.nnx.Linear``: same attributes, same parameter
names, shapes and initializers (checkpoints load unchanged), plus an ``activation`` or a
general ``epilogue`` fused into the GEMM; each submodule's ``FusedMLP`` runs
``jax_efc.fused_mlp`` on such layers' parameters; ``fp8=`` runs them on ``jax_efc.fp8_dense``
(delayed scaling's state kept as Flax's FP8 ops keep it). The submodules need Flax
(``pip install 'jax_efc[flax]'``); ``jax_efc.flax.dense`` holds the computation they share.
"""

from .linen import FusedDense, FusedMLP

__all__ = ["FusedDense", "FusedMLP"]
