"""The gated layout: gate and up weights interleaved along N, so that one GEMM computes both.

A gated weight ``w`` of shape (K, 2N) holds column blocks of width ``block`` taken in turn
from the gate and the up matrix: ``[gate block 0 | up block 0 | gate block 1 | up block 1 |
...]``, block j being columns ``j * block`` to ``(j + 1) * block`` of each. Biases (2N,), the
GEMM's accumulator (..., M, 2N) and gradients interleave the same way along their last axis.
A kernel's column tile then holds whole (gate, up) pairs, which its epilogue combines in
registers.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["DEFAULT_BLOCK", "check_block", "interleave_gated", "split_gated"]

# 64 columns: a 128-column kernel tile holds one pair, a 256-column tile two, and 64 is a
# multiple of every epilogue subtile's width
DEFAULT_BLOCK = 64


def check_block(block: Any, name: str = "block") -> int:
    """``block`` validated: a positive multiple of 8 (a 16-byte row of 16-bit values)."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"{name}={block!r}: the gated layout's block width must be a positive multiple "
                         f"of 8 (default {DEFAULT_BLOCK}).")
    return block


def interleave_gated(gate: Any, up: Any, block: int = DEFAULT_BLOCK) -> Any:
    """The gated layout of ``gate`` and ``up`` (same shape, (..., N), N a multiple of ``block``):
    their blocks of ``block`` columns alternated along the last axis, (..., 2N).

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> w = efc.interleave_gated(jnp.zeros((4, 16)), jnp.ones((4, 16)), block=8)
    >>> w.shape, w[0, :9].tolist()
    ((4, 32), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    """
    block = check_block(block)
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    if gate.shape != up.shape or gate.ndim < 1:
        raise ValueError(f"gate has shape {gate.shape} and up {up.shape}: they must have one shape, with at "
                         "least one axis.")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate is {gate.dtype} but up is {up.dtype}; cast one of them.")
    n = gate.shape[-1]
    if n % block:
        raise ValueError(f"gate and up have {n} columns, not a multiple of block={block}.")
    lead = gate.shape[:-1]
    pairs = jnp.stack([gate.reshape(*lead, n // block, block), up.reshape(*lead, n // block, block)], axis=-2)
    return pairs.reshape(*lead, 2 * n)


def split_gated(w: Any, block: int = DEFAULT_BLOCK) -> tuple[Any, Any]:
    """``(gate, up)`` from the gated layout ``w`` (..., 2N): the inverse of
    :func:`interleave_gated`.

    >>> import jax.numpy as jnp, jax_efc as efc
    >>> g, u = efc.split_gated(efc.interleave_gated(jnp.zeros(16), jnp.ones(16), block=8), block=8)
    >>> g.shape, float(u.sum())
    ((16,), 16.0)
    """
    block = check_block(block)
    w = jnp.asarray(w)
    if w.ndim < 1 or w.shape[-1] % (2 * block):
        raise ValueError(f"w has shape {w.shape}; its last axis must be a multiple of 2 * block = {2 * block} "
                         "(whole gate and up blocks).")
    lead, n = w.shape[:-1], w.shape[-1] // 2
    pairs = w.reshape(*lead, n // block, 2, block)
    return pairs[..., 0, :].reshape(*lead, n), pairs[..., 1, :].reshape(*lead, n)
