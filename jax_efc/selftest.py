"""``jax-efc selftest``: the numerics of the fused GEMM on whatever machine runs it.

For users on hardware this project has not run on (another Hopper part, a Blackwell GPU):
each case is one ``efc.gemm`` call on random data with partial tiles at every edge, checked
against a float64 NumPy oracle of the same stored inputs, and reported with the backend that
ran it (``efc.backends``) and the largest error against its bound. On a GPU with a kernel the
cases run under ``JAX_EFC_STRICT=1``, so a case the kernel should run cannot quietly fall
back; where the kernel is not expected (no GPU, or an architecture without one) they run on
the reference and say so.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Case", "CASES", "run", "format_table"]


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: ``epilogue`` and its float64 ``oracle`` of (acc, *operands), inputs of
    ``dtype`` (M, K) x (K, N) (B stored (N, K) with ``transpose_b``), operands by shape
    ("row": (N,), "tile": (M, N)), the outputs stored transposed (``efc.gemm``'s
    ``transposed_outputs``), whether reductions keep their fixed order (``deterministic``), and
    the bound on the largest error relative to the largest magnitude of each output. ``gated``:
    a gated GEMM of that block, B (K, 2N) interleaved, the epilogue and oracle taking (gate, up,
    *operands). ``groups``: a grouped GEMM (``efc.grouped_gemm``) of these group sizes, B (G,
    K, N), its operands per group ("group": (G, N), each row's group's row, 0 past the groups);
    ``weight_gradient``: instead its weights' gradient (G, K, N) for the output gradient given as
    the one tile operand, the oracle applied to each group's rows of A, transposed, times the
    gradient's."""

    name: str
    dtype: str
    mnk: tuple[int, int, int]
    epilogue: Callable[..., Any]
    oracle: Callable[..., Any]
    operands: tuple[str, ...] = ()
    transpose_b: bool = False
    batch: int | None = None
    out_dtypes: Any = None
    tol: float = 2e-2
    config: Any = None
    transposed: Any = None
    deterministic: bool = True
    gated: int = 0
    groups: tuple[int, ...] = ()
    weight_gradient: bool = False


def _cases() -> tuple[Case, ...]:
    from jax_efc.config import GemmConfig

    bias_gelu = (lambda acc, b: jax.nn.gelu(acc + b), lambda acc, b: _gelu_tanh(acc + b))
    alpha_beta = (lambda acc, c: {"D": 2 * acc + c, "Y": acc}, lambda acc, c: {"D": 2 * acc + c, "Y": acc})
    shape = (1000, 1032, 520)  # partial tiles on every edge
    cases = [
        Case("bf16 gemm", "bfloat16", shape, lambda acc: acc, lambda acc: acc),
        Case("fp16 gemm, B (N, K)", "float16", shape, lambda acc: acc, lambda acc: acc, transpose_b=True),
        Case("bf16 bias+gelu_tanh", "bfloat16", shape, *bias_gelu, operands=("row",)),
        Case("bf16 alpha-beta, two outputs", "bfloat16", shape, *alpha_beta, operands=("tile",),
             out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32}),
        Case("bf16 batched bias+gelu_tanh", "bfloat16", (264, 520, 136), *bias_gelu, operands=("row",), batch=3),
        Case("bf16 ping-pong 128x128", "bfloat16", shape, *bias_gelu, operands=("row",),
             config=GemmConfig(128, 128, 1, 2, pingpong=True)),
        Case("bf16 cooperative 128x256", "bfloat16", shape, *bias_gelu, operands=("row",),
             config=GemmConfig(128, 256, 2, 1)),
        Case("bf16 stream-K", "bfloat16", (2296, 2824, 1288), lambda acc: acc, lambda acc: acc,
             config=GemmConfig(128, 192, 2, 1, pingpong=True, raster="n")),
        Case("fp8 e4m3 bias+gelu_tanh", "float8_e4m3fn", shape, *bias_gelu, operands=("row",), transpose_b=True,
             out_dtypes=jnp.bfloat16),
        Case("int8 gemm (exact)", "int8", shape, lambda acc: acc, lambda acc: acc, transpose_b=True, tol=0.0),
        Case("bf16 column sums", "bfloat16", shape,
             lambda acc, b: (acc + b, jnp.sum(acc + b, axis=0)), lambda acc, b: (acc + b, (acc + b).sum(0)),
             operands=("row",)),
        Case("bf16 column sums and row maxes by atomics", "bfloat16", shape,
             lambda acc, b: (acc + b, jnp.sum(acc + b, axis=0), jnp.max(acc + b, axis=1)),
             lambda acc, b: (acc + b, (acc + b).sum(0), (acc + b).max(1)), operands=("row",), deterministic=False),
        Case("bf16 alpha-beta, D transposed", "bfloat16", shape, alpha_beta[0],
             lambda acc, c: {"D": (2 * acc + c).T, "Y": acc}, operands=("tile",), transposed="D"),
        Case("bf16 gated SwiGLU (blocks of 64)", "bfloat16", (1000, 1024, 520),
             lambda g, u, b: jax.nn.silu(g + b) * u, lambda g, u, b: (g + b) / (1 + np.exp(-(g + b))) * u,
             operands=("row",), gated=64),
        Case("bf16 grouped bias+silu (an empty group, rows past the groups)", "bfloat16", (1000, 520, 264),
             lambda acc, b: jax.nn.silu(acc + b), lambda acc, b: (acc + b) / (1 + np.exp(-(acc + b))),
             operands=("group",), groups=(300, 0, 77, 412, 1)),
        Case("bf16 grouped weight gradient (an empty group, rows past the groups)", "bfloat16", (1000, 264, 520),
             lambda acc: acc, lambda acc: acc, operands=("tile",), groups=(300, 0, 77, 412, 1), weight_gradient=True),
    ]
    return tuple(cases)


CASES = _cases()


def _inputs(case: Case, rng: np.random.Generator) -> tuple[list[Any], list[np.ndarray]]:
    """The call's arrays and their float64 values as stored."""
    m, n, k = case.mnk
    lead = () if case.batch is None else (case.batch,)
    dtype = jnp.dtype(case.dtype)
    cols = 2 * n if case.gated else n  # a gated GEMM's B holds gate and up columns
    b_lead = (len(case.groups),) if case.groups else lead
    if jnp.issubdtype(dtype, jnp.integer):
        a = rng.integers(-8, 8, lead + (m, k))
        b = rng.integers(-8, 8, b_lead + ((cols, k) if case.transpose_b else (k, cols)))
    else:
        a = rng.standard_normal(lead + (m, k)) / math.sqrt(k)
        b = rng.standard_normal(b_lead + ((cols, k) if case.transpose_b else (k, cols)))
    shapes = {"row": (n,), "tile": lead + (m, n), "group": (len(case.groups), n)}
    ops = [rng.standard_normal(shapes[role]) for role in case.operands]
    arrays = [jnp.asarray(a, dtype), jnp.asarray(b, dtype)] + [jnp.asarray(x, jnp.bfloat16) for x in ops]
    return arrays, [np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in arrays]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [tree[k] for k in sorted(tree)]
    return list(tree) if isinstance(tree, (tuple, list)) else [tree]


def run_case(case: Case, strict: bool, seed: int = 0) -> dict[str, Any]:
    """One case's row: name, backend, worst error, bound, and PASS or FAIL (with why)."""
    import jax_efc as efc

    saved = os.environ.get("JAX_EFC_STRICT")
    if strict:
        os.environ["JAX_EFC_STRICT"] = "1"
    try:
        arrays, f64 = _inputs(case, np.random.default_rng(seed))

        def call(a, b, *ops):
            if case.weight_gradient:  # (the product is linear in the weights: b is any point)
                product = lambda w: efc.grouped_gemm(a, w, jnp.asarray(case.groups, jnp.int32))  # noqa: E731
                return case.epilogue(jax.vjp(product, b)[1](ops[0])[0])
            if case.groups:
                return efc.grouped_gemm(a, b, jnp.asarray(case.groups, jnp.int32), case.epilogue,
                                        group_operands=ops, out_dtypes=case.out_dtypes, config=case.config)
            return efc.gemm(a, b, case.epilogue, *ops, transpose_b=case.transpose_b, out_dtypes=case.out_dtypes,
                            config=case.config, transposed_outputs=case.transposed,
                            deterministic=case.deterministic, gated=case.gated or None)

        backend = "; ".join(sorted(set(efc.backends(call, *arrays))))
        got = _leaves(jax.jit(call)(*arrays))
        a, b, *ops = f64
        ends = np.cumsum(case.groups)  # (grouped cases) each group's end row
        if case.weight_gradient:  # each group's rows of a, transposed, times the gradient's
            acc, ops = np.stack([a[end - size:end].T @ ops[0][end - size:end]
                                 for end, size in zip(ends, case.groups)]), []
        elif case.groups:  # each group's rows times its matrix; the rows past the groups 0, as their operands
            acc = np.zeros((a.shape[0], b.shape[-1]))
            for g, (end, size) in enumerate(zip(ends, case.groups)):
                acc[end - size:end] = a[end - size:end] @ b[g]
            group = np.searchsorted(ends, np.arange(a.shape[0]), side="right")
            ops = [np.concatenate([x, np.zeros_like(x[:1])])[group] for x in ops]
        else:
            acc = np.matmul(a, np.swapaxes(b, -1, -2) if case.transpose_b else b)
        if case.gated:  # (M, 2N) in (gate, up) block pairs -> the gate's and the up projection's
            pairs = acc.reshape(*acc.shape[:-1], -1, 2, case.gated)
            accs = [pairs[..., i, :].reshape(*acc.shape[:-1], -1) for i in (0, 1)]
        else:
            accs = [acc]
        want = _leaves(case.oracle(*accs, *ops))
        worst = 0.0
        for g, w in zip(got, want):
            g = np.asarray(jnp.asarray(g).astype(jnp.float32), np.float64)
            if g.shape != np.shape(w) or not np.isfinite(g).all():
                return dict(case=case.name, backend=backend, error=math.inf, bound=case.tol, result="FAIL",
                            why=f"shape {g.shape} (want {np.shape(w)}) or non-finite values")
            worst = max(worst, float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
        ok = worst <= case.tol
        return dict(case=case.name, backend=backend, error=worst, bound=case.tol, result="PASS" if ok else "FAIL",
                    why="" if ok else "error above the bound")
    except Exception as e:  # noqa: BLE001 - a case that cannot run is a failure to report, not a crash
        return dict(case=case.name, backend="-", error=math.inf, bound=case.tol, result="FAIL",
                    why=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    finally:
        if saved is None:
            os.environ.pop("JAX_EFC_STRICT", None)
        else:
            os.environ["JAX_EFC_STRICT"] = saved


def run(cases: tuple[Case, ...] = CASES, strict: bool | None = None) -> list[dict[str, Any]]:
    """Every case's row. ``strict`` (default: on a GPU whose architecture has a kernel that runs
    without further opt-in) runs them under ``JAX_EFC_STRICT=1``."""
    from jax_efc import device
    from jax_efc.kernels import policy

    if strict is None:
        pol = policy(device.arch()) if jax.default_backend() == "gpu" else None
        strict = pol is not None and pol.runs_by_default()
    return [run_case(case, strict) for case in cases]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table, then a count of passes."""
    width = max(len(r["case"]) for r in rows)
    lines = [f"{'case':<{width}}  result  {'max error':>10}  {'bound':>8}  backend"]
    for r in rows:
        lines.append(f"{r['case']:<{width}}  {r['result']:<6}  {r['error']:>10.3g}  {r['bound']:>8.3g}  {r['backend']}"
                     + (f"  ({r['why']})" if r["why"] else ""))
    passed = sum(r["result"] == "PASS" for r in rows)
    lines.append(f"{passed} of {len(rows)} passed")
    return "\n".join(lines)
