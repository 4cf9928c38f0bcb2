"""FP8 inference of a dense layer, y = gelu(dequant(x8 @ w8) + b), with the dequantisation in
the epilogue: per-tensor scales as dynamic scalars, or per-token (row) and per-channel
(column) scales as vector operands. No new API: the scales are epilogue operands.

Quantises x and w to e4m3 (B stored (N, K), the layout the 8-bit WGMMA reads), runs both
scalings with partial sums promoted into fp32 (the default) and once with fast accumulation,
checks each against float64 math of the same 8-bit values, and says which backend ran (the
kernel on Hopper, the XLA reference elsewhere).

    python examples/fp8_scaled.py [--mnk 4096,4096,4096]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_efc as efc

E4M3 = jnp.float8_e4m3fn
TOP = float(jnp.finfo(E4M3).max)


def quantize(v, axis=None):
    """``v`` scaled into e4m3's range (per tensor, or per slice along ``axis``) and its scale."""
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=axis is not None)
    scale = (amax / TOP).astype(jnp.float32)
    return (v / scale).astype(E4M3), scale


def per_tensor(acc, bias, *, sx, sw):
    return jax.nn.gelu(acc * (sx * sw) + bias)


def per_row_and_column(acc, sx, sw, bias):
    return jax.nn.gelu(acc * sx * sw + bias)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnk", default="4096,4096,4096", help="M,N,K")
    args = p.parse_args()
    m, n, k = (int(v) for v in args.mnk.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32)
    w = jax.random.normal(keys[1], (n, k), jnp.float32) / np.sqrt(k)  # stored (N, K)
    b = jax.random.normal(keys[2], (n,), jnp.bfloat16)
    f64 = lambda t: np.asarray(jnp.asarray(t, jnp.float32), np.float64)  # noqa: E731

    def check(name, fn, y, xq, sx, wq, sw):
        want = f64(xq) @ f64(wq).T * f64(sx) * f64(sw).reshape(1, -1) + f64(b)
        want = 0.5 * want * (1 + np.tanh(np.sqrt(2 / np.pi) * (want + 0.044715 * want**3)))
        err = np.linalg.norm(f64(y) - want) / np.linalg.norm(want)
        assert err < 2e-2, (name, err)
        print(f"{name:34s} rel. error {err:.1e}  backend: {', '.join(efc.backends(fn, *operands[name]))}")

    xq, sx = quantize(x)
    wq, sw = quantize(w)
    fast = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
    tensor = jax.jit(lambda xq, wq, b, sx, sw: efc.gemm(xq, wq, per_tensor, b, transpose_b=True, sx=sx, sw=sw,
                                                        out_dtypes=jnp.bfloat16))
    tensor_fast = jax.jit(lambda xq, wq, b, sx, sw: efc.gemm(xq, wq, per_tensor, b, transpose_b=True, sx=sx, sw=sw,
                                                             out_dtypes=jnp.bfloat16, precision=fast))
    xr, sxr = quantize(x, axis=1)  # one scale per token: (M, 1)
    wr, swr = quantize(w, axis=1)  # one scale per output channel: (N, 1), passed as a row (N,)
    rows = jax.jit(lambda xq, wq, sx, sw, b: efc.gemm(xq, wq, per_row_and_column, sx, sw, b, transpose_b=True,
                                                      out_dtypes=jnp.bfloat16))
    operands = {"per-tensor scales": (xq, wq, b, sx, sw), "per-tensor scales, fast accumulation": (xq, wq, b, sx, sw),
                "per-token and per-channel scales": (xr, wr, sxr, swr[:, 0], b)}
    check("per-tensor scales", tensor, tensor(*operands["per-tensor scales"]), xq, sx, wq, sw)
    check("per-tensor scales, fast accumulation", tensor_fast,
          tensor_fast(*operands["per-tensor scales, fast accumulation"]), xq, sx, wq, sw)
    check("per-token and per-channel scales", rows, rows(*operands["per-token and per-channel scales"]),
          xr, sxr, wr, swr[:, 0])


if __name__ == "__main__":
    main()
