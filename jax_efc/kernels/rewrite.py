"""Rewrites the kernels apply to an epilogue program before evaluating it.

In a kernel epilogue every fp32 operation on every element costs GEMM time, about 0.3% of a
K = 4096 GEMM each on an H200: the epilogue runs while the other consumer's WGMMAs do, and
its fp32 arithmetic slows them (the hardware approximations of tanh and exp2 do not), whereas
XLA's elementwise code is memory-bound and keeps the user's form. So the kernels replace
known functions by equivalent forms with fewer operations. Each rewrite is a pair of plain
JAX functions of one value: the template, traced into the IR exactly as a user's call of it
traces (so the match follows the installed JAX's definition), and the replacement.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_efc.epilogue import EpilogueIR, Instr, exact, renumbered
from jax_efc.tracing import trace_epilogue

__all__ = ["rewrite"]

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


def _gelu_tanh(x: Any) -> Any:
    """x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) as h + h * tanh(x * (a + b x^2)),
    h = x/2: five fp32 instructions besides the tanh instead of seven (both adds fuse into
    FMAs), as accurate in fp32."""
    h = 0.5 * x
    return h + h * jnp.tanh(x * (_SQRT_2_OVER_PI + _SQRT_2_OVER_PI * _GELU_CUBIC * (x * x)))


# (template, replacement)
_REWRITES: tuple[tuple[Callable[[Any], Any], Callable[[Any], Any]], ...] = (
    (functools.partial(jax.nn.gelu, approximate=True), _gelu_tanh),
)


@functools.cache
def _programs() -> tuple[tuple[EpilogueIR, EpilogueIR], ...]:
    def trace(fn):
        ir, *_ = trace_epilogue(fn, (8, 8), [], [], {}, {}, jnp.float32, jnp.float32)
        return ir

    return tuple((trace(t), trace(r)) for t, r in _REWRITES)


def _match(template: EpilogueIR, ir: EpilogueIR, value: int) -> int | None:
    """The value of ``ir`` that ``template``'s argument binds to when ``template``'s result
    matches ``value`` instruction for instruction, else ``None``."""
    bound: dict[int, int] = {}

    def same(t: int, u: int) -> bool:
        if t < len(template.inputs):
            return bound.setdefault(t, u) == u
        if u < len(ir.inputs):
            return False
        ti, ui = template.instrs[t - len(template.inputs)], ir.instrs[u - len(ir.inputs)]
        return ((ti.op, ti.dtype, exact(ti.attr), len(ti.args)) == (ui.op, ui.dtype, exact(ui.attr), len(ui.args))
                and all(same(a, b) for a, b in zip(ti.args, ui.args)))

    return bound.get(0) if same(template.outputs[0].value, value) else None


def rewrite(ir: EpilogueIR) -> EpilogueIR:
    """``ir`` with every match of a known template replaced, and what no output uses dropped."""
    n_in = len(ir.inputs)
    instrs: list[Instr] = []
    new_id = {i: i for i in range(n_in)}  # value in ir -> value in the result

    def emit(instr: Instr, ids: dict[int, int]) -> int:
        instrs.append(dataclasses.replace(instr, args=tuple(ids[a] for a in instr.args)))
        return n_in + len(instrs) - 1

    for j, ins in enumerate(ir.instrs):
        for template, replacement in _programs():
            x = _match(template, ir, n_in + j)
            if x is not None:
                ids = {0: new_id[x]}
                for k, r in enumerate(replacement.instrs):
                    ids[1 + k] = emit(r, ids)
                new_id[n_in + j] = ids[replacement.outputs[0].value]
                break
        else:
            new_id[n_in + j] = emit(ins, new_id)
    return _renumbered(ir, instrs, new_id).pruned()


def _renumbered(ir: EpilogueIR, instrs: list[Instr], new_id: dict[int, int]) -> EpilogueIR:
    """``ir`` with ``instrs`` (already renumbered) and its outputs moved by ``new_id``."""
    return dataclasses.replace(ir, instrs=tuple(instrs), outputs=tuple(renumbered(o, new_id) for o in ir.outputs))
