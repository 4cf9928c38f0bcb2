"""Runs each kernel variant once on a partial-tile shape and checks it against the reference;
run under compute-sanitizer by ``test_gpu_safety.py``. Prints "N variants ok" at the end."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc
from jax_efc import ffi

os.environ["JAX_EFC_STRICT"] = "1"

_MLP = lambda acc, bias: jax.nn.gelu(acc + bias)  # noqa: E731
_ALPHA_BETA = lambda acc, c, x: {"D": acc * 2.0 + c * 0.5 + x, "Y": acc}  # noqa: E731

# (config, (M, N, K), epilogue); the shapes leave partial tiles along M and N
VARIANTS = [
    (efc.GemmConfig(128, 128), (300, 264, 200), "bias"),
    (efc.GemmConfig(128, 256, 2, 1), (520, 392, 136), "alpha_beta"),
    (efc.GemmConfig(128, 128, 1, 2, pingpong=True, swizzle=8), (1000, 776, 264), "alpha_beta"),
    (efc.GemmConfig(192, 128, 1, 2, pingpong=True, epi_m=64, epi_n=16), (700, 520, 128), "bias"),
    (efc.GemmConfig(128, 128, 2, 2), (600, 600, 72), "bias"),
    # stream-K: 24 tiles on a grid of 132 splits every tile's k-iterations over all CTAs
    (efc.GemmConfig(128, 128), (600, 600, 4096), "alpha_beta"),
]


def main() -> int:
    rng = np.random.default_rng(0)
    for cfg, (m, n, k), kind in VARIANTS:
        a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        if kind == "bias":
            ops, fn, outs = [jnp.asarray(rng.standard_normal(n), jnp.bfloat16)], _MLP, None
        else:
            ops = [jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16) for _ in range(2)]
            fn, outs = _ALPHA_BETA, {"D": jnp.bfloat16, "Y": jnp.float32}
        got = jax.jit(lambda a, b, *o: efc.gemm(a, b, fn, *o, out_dtypes=outs, config=cfg))(a, b, *ops)
        os.environ.update(JAX_EFC_DISABLE="1", JAX_EFC_STRICT="0")  # the reference, for comparison
        want = jax.jit(lambda a, b, *o: efc.gemm(a, b, fn, *o, out_dtypes=outs))(a, b, *ops)
        os.environ.update(JAX_EFC_DISABLE="0", JAX_EFC_STRICT="1")
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            if not err < 1e-2:
                print(f"{cfg} {m}x{n}x{k} {kind}: relative error {err:.3g}")
                return 1
    stream_k = [k for k in ffi._KERNELS.values() if k.schedule.stream_k is not None]
    if not stream_k:
        print("no variant planned stream-K")
        return 1
    print(f"{len(VARIANTS)} variants ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
