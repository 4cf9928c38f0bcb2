"""``jax.checkpoint`` policies that know jax_efc's GEMM.

JAX's dot policies (``jax.checkpoint_policies.dots_saveable`` and the like) recognise
``dot_general`` by identity, so under them a fused GEMM counts as ordinary work: its output
and saved accumulator are dropped and the GEMM runs again in the backward pass. These are the
same policies with the fused GEMM counted as a dot; pass them wherever JAX's are taken
(``jax.checkpoint(f, policy=...)``, ``nn.remat``, ``nnx.remat``).
"""

from __future__ import annotations

from typing import Any

import jax

from .primitive import fused_gemm_p

__all__ = ["fused_gemms_saveable", "dots_saveable", "checkpoint_dots", "dots_with_no_batch_dims_saveable"]


def fused_gemms_saveable(prim: Any, *avals: Any, **params: Any) -> bool:
    """Save every fused GEMM's outputs; combine with another policy through
    ``jax.checkpoint_policies.save_from_both_policies``."""
    return prim is fused_gemm_p


def _unbatched_fused_gemm(prim: Any, *avals: Any, **params: Any) -> bool:
    """A fused GEMM without a batch dimension L (neither operand 3-D), as
    ``dots_with_no_batch_dims_saveable`` saves only dots without batch dimensions."""
    return prim is fused_gemm_p and len(avals[0].shape) == 2 and len(avals[1].shape) == 2


dots_saveable = checkpoint_dots = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, fused_gemms_saveable)
dots_with_no_batch_dims_saveable = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _unbatched_fused_gemm)
