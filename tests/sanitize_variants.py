"""Runs each kernel variant once on a partial-tile shape and checks it against a float64 NumPy
oracle (no XLA GEMM runs beside it); run under compute-sanitizer by ``test_gpu_safety.py``. Prints
"N variants ok" at the end."""

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


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def main(indices: list[int]) -> int:
    """Runs ``VARIANTS[i]`` for each ``i`` of ``indices`` (all when empty)."""
    rng = np.random.default_rng(0)
    chosen = [VARIANTS[i] for i in indices] if indices else VARIANTS
    for cfg, (m, n, k), kind in chosen:
        a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        if kind == "bias":
            ops, fn, outs = [jnp.asarray(rng.standard_normal(n), jnp.bfloat16)], _MLP, None
        else:
            ops = [jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16) for _ in range(2)]
            fn, outs = _ALPHA_BETA, {"D": jnp.bfloat16, "Y": jnp.float32}
        got = jax.jit(lambda a, b, *o: efc.gemm(a, b, fn, *o, out_dtypes=outs, config=cfg))(a, b, *ops)
        # the float64 NumPy oracle: no XLA GEMM runs beside the kernel under the sanitizer
        acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        host = [np.asarray(x, np.float64) for x in ops]
        want = [_gelu_tanh(acc + host[0])] if kind == "bias" else [acc * 2.0 + host[0] * 0.5 + host[1], acc]
        for g, w in zip(jax.tree.leaves(got), want):
            err = np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(w)
            if not err < 1e-2:
                print(f"{cfg} {m}x{n}x{k} {kind}: relative error {err:.3g}")
                return 1
    stream_k = [k for k in ffi._KERNELS.values() if k.schedule.stream_k is not None]
    if not stream_k and chosen[-1] is VARIANTS[-1]:
        print("the stream-K variant did not plan stream-K")
        return 1
    print(f"{len(chosen)} variants ok")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(i) for i in sys.argv[1:]]))
