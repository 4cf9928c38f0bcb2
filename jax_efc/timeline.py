"""Where a fused GEMM's SM cycles go, read from the kernel's timeline build.

    python benchmarks/timeline.py [--shape M,N,K[,L]] [--epilogues gemm bias+gelu_tanh ...]
                                  [--configs auto 128,128,1,2,pingpong=1,epi_n=16 ...] [--by-position]

The timeline build (``jax_efc.ffi.fused_gemm(..., timeline=True)``) has the first thread of
every consumer group stamp the SM clock at each unit's ``TIMELINE_EVENTS``
(:mod:`jax_efc.kernels`). Per CTA, in SM cycles (so clock changes under the power cap do not
blur them):

- ``span``: its first mainloop start to its last epilogue end;
- ``tile``: WGMMA cycles per tile, from the later of the tile's mainloop start and the
  previous tile's completion to its own completion, over all but the CTA's first and last;
- ``gaps``: cycles between one tile's WGMMAs completing and the next tile's mainloop starting;
- ``epilogue``: one epilogue's length; ``last``: the CTA's last epilogue, which nothing hides.

The table shows the mean over the CTAs (and the longest span, which sets the kernel's time).
``--by-position`` adds the tile and epilogue cycles at each position of a CTA's walk (first
unit, second, ...), over the CTAs that ran the most common number of units: costs that come
and go with the phase of the kernel (all CTAs start together) show there and not in a mean.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .bench import (EPILOGUES, Problem, bench_problem, config_label, fixed_width, parse_config,
                    parse_shape, random_inputs)
from .kernels import TIMELINE_EVENTS
from .plan import plan_call
from .primitive import fused_gemm_eqns, fused_gemm_p

__all__ = ["Summary", "summarize", "Positions", "by_position", "timeline_call", "record", "main"]

_NO_UNITS = "no CTA stamped a unit: these are not the stamps of a timeline build that ran."
_REACHED, _MAINLOOP, _COMPLETE, _EPILOGUE, _END = (
    TIMELINE_EVENTS.index(e) for e in ("reached", "mainloop", "complete", "epilogue", "end"))


@dataclasses.dataclass(frozen=True)
class Summary:
    """Means over the CTAs that ran units, in SM cycles (see the module's docstring)."""

    units: float
    span: float
    span_max: float
    tile: float
    gaps: float
    epilogue: float
    last: float


def _cta_units(cta: np.ndarray) -> np.ndarray:
    """A CTA's (units, events) stamps in unit order, as cycles since its first stamp.
    ``cta``: (groups, units, events) int32; consumer group g ran units g, g + groups, ..."""
    groups, per_group, n_events = cta.shape
    ordered = cta.transpose(1, 0, 2).reshape(groups * per_group, n_events)
    ran = ordered[ordered[:, _REACHED] != 0].astype(np.int64)
    if not len(ran):
        return ran
    # the 32-bit clock wraps: differences are taken modulo 2^32, as signed values (a kernel
    # spans far fewer cycles; another group may stamp before the first unit's "reached")
    return (ran - ran[0, _REACHED] + 2**31) % 2**32 - 2**31


def _tile_cycles(e: np.ndarray) -> np.ndarray:
    """WGMMA cycles of each of a CTA's units (``_cta_units``'s rows): from the later of its
    mainloop start and the previous unit's completion to its own completion."""
    busy_from = np.maximum(e[:, _MAINLOOP], np.r_[0, e[:-1, _COMPLETE]])
    return e[:, _COMPLETE] - busy_from


def summarize(stamps: np.ndarray) -> Summary:
    """The summary of a timeline build's stamps, (CTAs, groups, units, events) int32."""
    rows = []
    for cta in np.asarray(stamps):
        e = _cta_units(cta)
        if not len(e):
            continue
        tile = _tile_cycles(e)
        rows.append((len(e), e[-1, _END] - e[0, _MAINLOOP], tile[1:-1].mean() if len(e) > 2 else tile.mean(),
                     np.maximum(0, e[1:, _MAINLOOP] - e[:-1, _COMPLETE]).sum(),
                     (e[:, _END] - e[:, _EPILOGUE]).mean(), e[-1, _END] - e[-1, _COMPLETE]))
    if not rows:
        raise ValueError(_NO_UNITS)
    r = np.array(rows, dtype=np.float64)
    return Summary(units=r[:, 0].mean(), span=r[:, 1].mean(), span_max=r[:, 1].max(), tile=r[:, 2].mean(),
                   gaps=r[:, 3].mean(), epilogue=r[:, 4].mean(), last=r[:, 5].mean())


@dataclasses.dataclass(frozen=True)
class Positions:
    """Means per position in the walk over the ``ctas`` CTAs that ran ``units`` units, the
    most common count (the larger on a tie), in SM cycles."""

    units: int
    ctas: int
    tile: np.ndarray  # WGMMA cycles of the tile at each position
    epilogue: np.ndarray  # that tile's epilogue


def by_position(stamps: np.ndarray) -> Positions:
    """Tile and epilogue cycles by position in the CTAs' walks, from a timeline build's stamps
    (CTAs, groups, units, events) int32."""
    walks: dict[int, list[np.ndarray]] = {}
    for cta in np.asarray(stamps):
        e = _cta_units(cta)
        if len(e):
            walks.setdefault(len(e), []).append(np.stack([_tile_cycles(e), e[:, _END] - e[:, _EPILOGUE]]))
    if not walks:
        raise ValueError(_NO_UNITS)
    units = max(walks, key=lambda n: (len(walks[n]), n))
    tile, epilogue = np.mean(walks[units], axis=0)
    return Positions(units=units, ctas=len(walks[units]), tile=tile, epilogue=epilogue)


def timeline_call(problem: Problem) -> tuple[Callable[..., Any], list[jax.ShapeDtypeStruct]]:
    """A jitted function that runs the timeline build of ``problem``'s kernel (``jax_efc``'s
    side of a benchmark problem) and returns its stamps, and the shapes of its arguments (the
    fused GEMM's operands, as the op hands them to the kernel)."""
    from . import ffi

    eqns = fused_gemm_eqns(jax.make_jaxpr(problem.ours)(*problem.specs))
    if len(eqns) != 1 or eqns[0].primitive is not fused_gemm_p:
        raise ValueError(f"{problem.epilogue} runs {len(eqns)} fused GEMMs; a timeline needs one dense one.")
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqns[0].invars]
    plan = plan_call(specs, eqns[0].params)
    fn = jax.jit(lambda *a: ffi.fused_gemm(*a, plan=plan, timeline=True)[-1])
    return fn, specs


def record(problem: Problem, calls: int = 3, seed: int = 0) -> np.ndarray:
    """The stamps of ``problem``'s kernel run ``calls`` times on random inputs (the last's)."""
    fn, specs = timeline_call(problem)
    args = random_inputs(specs, jax.random.PRNGKey(seed))
    for _ in range(calls):
        stamps = fn(*args)
    return np.asarray(stamps)


def _table(rows: Sequence[tuple[str, str, Summary]]) -> str:
    head = ("epilogue", "config", "units", "span", "span max", "tile", "gaps", "epilogue", "last")
    return fixed_width(head, [(e, c, f"{s.units:.1f}", *(f"{v:.0f}" for v in (s.span, s.span_max, s.tile,
                                                                             s.gaps, s.epilogue, s.last)))
                              for e, c, s in rows])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/timeline.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=parse_shape, default=(8192, 4096, 4096, 1), metavar="M,N,K[,L]")
    p.add_argument("--epilogues", nargs="+", default=["gemm", "bias+gelu_tanh"], choices=EPILOGUES)
    p.add_argument("--configs", nargs="+", type=parse_config, default=[None], metavar="CONFIG",
                   help="'auto' (the heuristic's) or tile_m,tile_n[,cluster_m,cluster_n][,field=value...]")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--by-position", action="store_true",
                   help="also print the tile and epilogue cycles at each position of the CTAs' walks")
    args = p.parse_args(argv)
    runs = [(e, config_label(c), record(bench_problem(e, args.shape, args.dtype, c)))
            for e in args.epilogues for c in args.configs]
    print(_table([(e, c, summarize(stamps)) for e, c, stamps in runs]), flush=True)
    if args.by_position:
        for e, c, stamps in runs:
            pos = by_position(stamps)
            print(f"\n{e} {c}: {pos.ctas} CTAs of {pos.units} units, k cycles by position")
            print("  tile     " + " ".join(f"{v / 1e3:5.1f}" for v in pos.tile))
            print("  epilogue " + " ".join(f"{v / 1e3:5.1f}" for v in pos.epilogue), flush=True)
