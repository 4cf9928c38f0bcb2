"""A measurement (:class:`Result`) and how it is reported: tables and plots."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from .problems import Problem, Shape

NO_TRITON_FLAG = "--xla_gpu_enable_triton_gemm=false"


@dataclasses.dataclass(frozen=True)
class Result:
    """Times are seconds per call (median round); errors are relative Frobenius errors
    against the float32 reference, the worst over the outputs (None when not checked)."""

    epilogue: str
    shape: Shape
    dtype: str
    config: str
    backend: str
    ours_s: float
    baseline_s: float
    tflops: float
    ratio: float  # baseline time / our time: > 1 means we are faster
    peak_fraction: float
    gbytes: float  # least bytes any implementation must move (inputs read, outputs written)
    err: float | None
    baseline_err: float | None
    # with a ClockSampler: median SM clock (MHz) and board power (W) while each side ran
    ours_mhz: float | None = None
    baseline_mhz: float | None = None
    ours_watts: float | None = None
    baseline_watts: float | None = None
    # with ``bound``: our plain GEMM of the same A and B, timed in the same rounds; baseline_s /
    # plain_s bounds the ratio any fusion of this epilogue can reach
    plain_s: float | None = None
    calls_per_jit: int = 1
    # with both: the clock and power while the plain GEMM ran (at the power cap a kernel's
    # clock depends on its work, so a fused epilogue can cost clock as well as cycles)
    plain_mhz: float | None = None
    plain_watts: float | None = None
    # with ``bound``: the same GEMMs as XLA's dots; baseline_s / baseline_plain_s bounds the
    # ratio a fusion could reach with GEMMs at XLA's speed
    baseline_plain_s: float | None = None

    @property
    def bound(self) -> float | None:
        return None if self.plain_s is None else self.baseline_s / self.plain_s

    @property
    def baseline_bound(self) -> float | None:
        return None if self.baseline_plain_s is None else self.baseline_s / self.baseline_plain_s

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        """A result as ``dataclasses.asdict`` wrote it to the ``--json`` file."""
        return cls(**{**d, "shape": tuple(d["shape"])})


def label(p: Problem) -> str:
    return f"{shape_str(p.shape)} {p.epilogue}" + ("" if p.config == "auto" else f" {p.config}")


def shape_str(shape: Shape) -> str:
    m, n, k, l = shape
    return f"{m}x{n}x{k}" + (f"x{l}" if l > 1 else "")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _optional(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: Sequence[Result], title: str = "") -> str:
    """A fixed-width table of results (shape is M x N x K [x L]); with sampled clocks, also
    each side's median SM clock and board power (and the plain GEMM's, with ``bound``)."""
    head = ("shape", "dtype", "epilogue", "config", "backend", "ours ms", "base ms", "TFLOP/s", "ratio",
            "%peak", "GB", "err", "base err")
    rows = [(shape_str(r.shape), r.dtype, r.epilogue, r.config, _clip(r.backend, 40), f"{r.ours_s * 1e3:.3f}",
             f"{r.baseline_s * 1e3:.3f}", f"{r.tflops:.4g}", f"{r.ratio:.2f}",
             f"{100 * r.peak_fraction:.3g}", f"{r.gbytes:.2f}", _optional(r.err, ".1e"), _optional(r.baseline_err, ".1e"))
            for r in results]
    if any(r.plain_s is not None for r in results):
        head += ("plain ms", "bound", "base plain ms", "base bound")
        rows = [row + (_optional(None if r.plain_s is None else r.plain_s * 1e3, ".3f"), _optional(r.bound, ".2f"),
                       _optional(None if r.baseline_plain_s is None else r.baseline_plain_s * 1e3, ".3f"),
                       _optional(r.baseline_bound, ".2f"))
                for row, r in zip(rows, results)]
    if any(r.ours_mhz is not None for r in results):
        head += ("ours MHz", "base MHz", "ours W", "base W")
        rows = [row + tuple(_optional(v, ".0f") for v in (r.ours_mhz, r.baseline_mhz, r.ours_watts, r.baseline_watts))
                for row, r in zip(rows, results)]
    if any(r.plain_mhz is not None for r in results):
        head += ("plain MHz", "plain W")
        rows = [row + (_optional(r.plain_mhz, ".0f"), _optional(r.plain_watts, ".0f"))
                for row, r in zip(rows, results)]
    return fixed_width(head, rows, title)


def fixed_width(head: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    """Left-aligned columns as wide as their widest cell, the head ruled off from the rows."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [title] if title else []
    lines += ["  ".join(f"{x:<{w}}" for x, w in zip(row, widths)) for row in (head, *rows)]
    lines.insert(len(lines) - len(rows), "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def baseline_title() -> str:
    """Which XLA configuration the baseline in this process runs with."""
    flags = os.environ.get("XLA_FLAGS", "")
    which = f"XLA with {NO_TRITON_FLAG}" if NO_TRITON_FLAG in flags else "XLA default flags"
    return f"jax_efc vs plain JAX under jit (baseline: {which}) on {jax.devices()[0].device_kind}"


def plot(report: dict[str, Any], path: str) -> None:
    """Bars of baseline time / our time per case, one series per baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("XLA default", report["results"])]
    if report["no_triton"]:
        series.append(("XLA, Triton GEMM off", report["no_triton"]))
    labels = ["x".join(map(str, r["shape"][:3])) + f"\n{r['epilogue']}" for r in report["results"]]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 4))
    for i, (name, results) in enumerate(series):
        bars = ax.bar([j + i * width for j in range(len(results))], [r["ratio"] for r in results], width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=90, fontsize=7)
    ax.set_ylabel("baseline time / jax_efc time")
    ax.set_title(f"jax_efc vs XLA on {report['device']}")
    ax.set_ylim(0, 1.15 * max(r["ratio"] for _, results in series for r in results))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
