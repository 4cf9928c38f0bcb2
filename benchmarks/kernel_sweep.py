"""Kernel-config sweep: jax_efc kernels vs their XLA baselines, side by side in one process.

    python benchmarks/kernel_sweep.py [--out DIR] [--quick]

For each (case, config) the kernel is checked against the baseline (relative Frobenius
error), then timed in interleaved rounds (ours, baseline, ours, ...) to cancel clock
drift; the median round is reported. Prints a table at the end; writes the log to
DIR/kernel_sweep.log when --out is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_EFC_STRICT", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_efc as efc  # noqa: E402
from jax_efc.config import GemmConfig  # noqa: E402

LOG: list[str] = []


LOG_PATH: list[str] = []


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)
    if LOG_PATH:  # written as we go, so a run cut short still leaves its figures
        with open(LOG_PATH[0], "a") as f:
            f.write(line + "\n")


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def gelu_erf(x):
    return jax.nn.gelu(x, approximate=False)


EPILOGUES = {
    # name -> (fn(acc, *ops), operand kinds, out dtypes)
    "plain": (None, [], None),
    "bias_gelu_tanh": (lambda acc, b: gelu_tanh(acc + b), ["row"], None),
    "bias_gelu_erf": (lambda acc, b: gelu_erf(acc + b), ["row"], None),
    "bias_silu": (lambda acc, b: jax.nn.silu(acc + b), ["row"], None),
    "alpha_beta": (lambda acc, c, x: {"D": acc * 2.0 + c * 1.0 + x * 3.0, "Y": acc}, ["tile", "tile"],
                   {"D": jnp.bfloat16, "Y": jnp.bfloat16}),
}


def time_pair(f_ours, f_base, args, rounds, calls):
    ts_o, ts_b = [], []
    for _ in range(rounds):
        for f, ts in ((f_ours, ts_o), (f_base, ts_b)):
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            for _ in range(calls):
                r = f(*args)
            jax.block_until_ready(r)
            ts.append((time.perf_counter() - t0) / calls)
    return float(np.median(ts_o)), float(np.median(ts_b))


def rel_err(got, want):
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.isfinite(g).all():
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def run_case(epi, m, n, k, configs, rounds=7, results=None):
    fn, kinds, outs = EPILOGUES[epi]
    key = jax.random.PRNGKey(m + n + k)
    ks = jax.random.split(key, 2 + len(kinds))
    a = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(ks[1], (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    ops = [jax.random.normal(kk, (m, n) if kind == "tile" else (n,), jnp.float32).astype(jnp.bfloat16)
           for kk, kind in zip(ks[2:], kinds)]

    if fn is None:
        base = jax.jit(lambda a, b: a @ b)
    else:
        def base_fn(a, b, *ops):
            acc = jnp.dot(a, b, preferred_element_type=jnp.float32)
            r = fn(acc, *[o.astype(jnp.float32) for o in ops])
            if isinstance(r, dict):
                return {kk: v.astype(outs[kk]) for kk, v in r.items()}
            return r.astype(jnp.bfloat16)
        base = jax.jit(base_fn)
    want = jax.block_until_ready(base(a, b, *ops))
    flops = 2.0 * m * n * k
    calls = max(3, int(0.04 / max(flops / 700e12, 1e-6)))
    for cfg in configs:
        label = "auto" if cfg is None else cfg_label(cfg)
        try:
            if fn is None:
                ours = jax.jit(lambda a, b, cfg=cfg: efc.gemm(a, b, config=cfg))
            else:
                ours = jax.jit(lambda a, b, *ops, cfg=cfg: efc.gemm(a, b, fn, *ops, out_dtypes=outs, config=cfg))
            got = jax.block_until_ready(ours(a, b, *ops))
            if isinstance(got, dict):
                err = max(rel_err(got[kk], want[kk]) for kk in got)
            else:
                err = rel_err(got, want)
            t_o, t_b = time_pair(ours, base, (a, b, *ops), rounds, calls)
        except Exception as e:  # report and go on
            log(f"FAIL {epi} {m}x{n}x{k} {label}: {type(e).__name__}: {str(e)[:300]}")
            continue
        row = (epi, f"{m}x{n}x{k}", label, t_o * 1e3, t_b * 1e3, flops / t_o / 1e12, t_b / t_o, err)
        log("%-15s %-17s %-28s ours %.3f ms  base %.3f ms  %.0f TF/s  ratio %.3f  err %.2e" % row)
        if results is not None:
            results.append(row)


def cfg_label(c: GemmConfig) -> str:
    s = f"{c.tile_m}x{c.tile_n} c{c.cluster_m}x{c.cluster_n} {c.raster}{c.swizzle}"
    if c.epi_n != 32:
        s += f" e{c.epi_n}"
    return s


def G(tm=128, tn=256, cm=2, cn=1, raster="m", sw=8, epi_n=32):
    return GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, raster=raster, swizzle=sw, epi_n=epi_n)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--plan", default="sweep")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        LOG_PATH.append(os.path.join(args.out, "kernel_sweep.log"))
    log("device:", jax.devices()[0].device_kind)
    res: list = []
    t0 = time.time()
    if args.plan == "sweep":
        plan = [
            ("plain", 8192, 8192, 8192, [None, G(cm=1), G(epi_n=64), G(cm=1, epi_n=64)]),
            ("plain", 8192, 4096, 14336, [None, G(epi_n=64)]),
            ("plain", 8192, 14336, 4096, [None, G(epi_n=64), G(cm=1, epi_n=64)]),
            ("plain", 8192, 4096, 4096, [None, G(epi_n=64)]),
            ("bias_gelu_tanh", 8192, 14336, 4096, [None, G(epi_n=64)]),
            ("bias_silu", 8192, 14336, 4096, [None, G(epi_n=64)]),
            ("bias_gelu_erf", 8192, 14336, 4096, [None, G(epi_n=64)]),
            ("alpha_beta", 8192, 8192, 8192, [None, G(cm=1)]),
            ("alpha_beta", 8192, 4096, 4096, [None, G(tn=128)]),
            ("plain", 16384, 28672, 8192, [None, G(epi_n=64)]),
        ]
    else:  # final: the heuristic on the standard set
        plan = [("plain", 8192, 8192, 8192, [None])]
        for mm in (4096, 8192, 16384):
            for kk, nn in ((4096, 14336), (14336, 4096), (4096, 4096), (8192, 28672)):
                plan.append(("plain", mm, nn, kk, [None]))
        for epi in ("bias_gelu_tanh", "bias_silu", "bias_gelu_erf"):
            plan.append((epi, 8192, 14336, 4096, [None]))
            plan.append((epi, 8192, 4096, 14336, [None]))
        plan.append(("alpha_beta", 8192, 8192, 8192, [None]))
        plan.append(("alpha_beta", 8192, 4096, 4096, [None]))
    for epi, m, n, k, cfgs in plan:
        run_case(epi, m, n, k, cfgs, results=res)
        log(f"  [{time.time() - t0:.0f}s]")
    log("\n=== summary (ratio = baseline / ours; > 1 is faster) ===")
    log("%-15s %-17s %-28s %9s %9s %7s %7s %9s" % ("epilogue", "MxNxK", "config", "ours ms", "base ms", "TF/s", "ratio", "err"))
    for r in res:
        log("%-15s %-17s %-28s %9.3f %9.3f %7.0f %7.3f %9.2e" % r)
    for epi in EPILOGUES:
        rs = [r[6] for r in res if r[0] == epi and r[2] == "auto"]
        if rs:
            log(f"geomean ratio {epi} (auto): {float(np.exp(np.mean(np.log(rs)))):.3f} over {len(rs)}")


if __name__ == "__main__":
    sys.exit(main())
