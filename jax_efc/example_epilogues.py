"""The epilogues of CUTLASS's custom-epilogue example (Blackwell EFC), in one place for the
examples, the CLI and the benchmark.

Each is a plain ``jax.numpy`` function of the accumulator, its operands and keyword scalars,
usable both with ``jax_efc.gemm`` and as plain JAX on ``a @ b``. ``EXAMPLES`` describes, per
name, which operands each one takes (by role) and which scalars, so a driver such as
``jax-efc run`` can build its inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from . import activations

__all__ = ["alpha_beta", "activation", "multi_output", "complex_epilogue", "ExampleEpilogue", "EXAMPLES"]


def alpha_beta(acc: Any, c: Any, x: Any, *, alpha: Any, beta: Any, x_factor: Any) -> dict[str, Any]:
    """D = acc*alpha + C*beta + X*x_factor, and Y = acc (the CUTLASS example's main epilogue)."""
    return {"D": acc * alpha + c * beta + x * x_factor, "Y": acc}


def activation(acc: Any, c: Any, *, alpha: Any, beta: Any) -> dict[str, Any]:
    """D = gelu_tanh(acc*alpha + C*beta): a scaled GEMM with a source term and an activation."""
    return {"D": activations.gelu_tanh(acc * alpha + c * beta)}


def multi_output(acc: Any, c: Any, *, alpha: Any, beta: Any) -> dict[str, Any]:
    """D = relu(pre) and Y = pre, pre = acc*alpha + C*beta: the activation and the
    pre-activation a backward pass needs, both stored by one kernel."""
    pre = acc * alpha + c * beta
    return {"D": activations.relu(pre), "Y": pre}


def complex_epilogue(acc: Any, bias: Any, c: Any, x: Any, *, scale: Any) -> dict[str, Any]:
    """D = gelu((acc + bias)*scale + C + tanh(X)) (exact erf GELU): a row vector, two tiles,
    a scalar and two transcendental functions in one epilogue."""
    return {"D": activations.gelu((acc + bias) * scale + c + jnp.tanh(x))}


@dataclasses.dataclass(frozen=True)
class ExampleEpilogue:
    """An epilogue and what it takes and gives: operands as (name, role) with role "tile"
    (M, N) or "row" (N,), the names of its keyword scalars and of its outputs."""

    fn: Callable[..., Any]
    operands: tuple[tuple[str, str], ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]


EXAMPLES: dict[str, ExampleEpilogue] = {
    "alpha-beta": ExampleEpilogue(alpha_beta, (("c", "tile"), ("x", "tile")), ("alpha", "beta", "x_factor"),
                               ("D", "Y")),
    "activation": ExampleEpilogue(activation, (("c", "tile"),), ("alpha", "beta"), ("D",)),
    "multi-output": ExampleEpilogue(multi_output, (("c", "tile"),), ("alpha", "beta"), ("D", "Y")),
    "complex": ExampleEpilogue(complex_epilogue, (("bias", "row"), ("c", "tile"), ("x", "tile")), ("scale",),
                            ("D",)),
}
