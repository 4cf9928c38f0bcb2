"""Collective matmuls for tensor parallelism inside ``jax.shard_map``: each layer's
communication split into ring steps that overlap its GEMMs, as XLA's collective-matmul option
and JAX's Pallas ``collective_matmul_mgpu`` do, with each step a fused GEMM.

- :func:`all_gather_dense`, the column-parallel layer: the activations' all-gather over the
  mesh axis runs as ``P - 1`` neighbour exchanges (``lax.ppermute``), each shard of rows
  multiplied (bias and activation fused) while the next one travels;
- :func:`dense_reduce_scatter`, the row-parallel layer: the partial products' reduce-scatter
  runs as a ring in which each device adds its partial of the block in flight in the epilogue
  of that block's GEMM (float32), and the last step adds the bias and applies the activation.

Both differentiate through JAX (the exchanges transpose to exchanges the other way round).
What they gain is communication hidden behind GEMMs; where the GEMMs are short, the exchanges'
latency is not (measure against ``all_gather`` + ``fused_dense``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from . import activations, arguments
from .config import GemmConfig
from .ops import fused_dense, gemm

__all__ = ["all_gather_dense", "dense_reduce_scatter"]


def _ring(axis_name: str) -> tuple[int, Any, list[tuple[int, int]]]:
    """(devices along ``axis_name``, this device's index, the permutation sending each device's
    block to the next)."""
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be the name of a mesh axis (a str), got {axis_name!r}.")
    try:
        devices = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis here: call inside jax.shard_map over a mesh "
                         "that has it.") from None
    return devices, lax.axis_index(axis_name), [(i, (i + 1) % devices) for i in range(devices)]


def all_gather_dense(x: Any, kernel: Any, bias: Any = None, *, axis_name: str,
                     activation: str | Callable[[Any], Any] | None = None, precision: Any = None,
                     config: GemmConfig | str | None = None) -> Any:
    """``activation(all_gather(x) @ kernel + bias)`` inside ``shard_map``, the gather overlapped.

    ``x`` is this device's (m, K) rows of the activations, sharded over ``axis_name``;
    ``kernel`` (K, n) and ``bias`` (n,) this device's columns of a column-parallel layer. Returns
    (P m, n): every device's rows, in the order of the devices along the axis. Step s multiplies
    the rows of device ``i - s`` while they pass on to device ``i + 1``.
    """
    x, kernel = arguments.array("x", x), arguments.array("kernel", kernel)
    if x.ndim != 2 or kernel.ndim != 2:
        raise ValueError(f"x must be (m, K) and kernel (K, n); got {x.shape} and {kernel.shape}.")
    devices, me, ring = _ring(axis_name)
    m = x.shape[0]
    out = None
    rows = x
    for step in range(devices):
        arriving = lax.ppermute(rows, axis_name, ring) if step < devices - 1 else None
        y = fused_dense(rows, kernel, bias, activation=activation, precision=precision, config=config)
        if out is None:
            out = jnp.zeros((devices * m, y.shape[1]), y.dtype)
        out = lax.dynamic_update_slice_in_dim(out, y, (me - step) % devices * m, axis=0)
        rows = arriving
    return out


def dense_reduce_scatter(x: Any, kernel: Any, bias: Any = None, *, axis_name: str,
                         activation: str | Callable[[Any], Any] | None = None, precision: Any = None,
                         config: GemmConfig | str | None = None) -> Any:
    """``activation(reduce_scatter(x @ kernel) + bias)`` inside ``shard_map``, the reduction
    overlapped: a row-parallel layer.

    ``x`` is (P m, k) with this device's share k of the contraction (its columns of the
    activations), ``kernel`` (k, N) its rows of the weight, ``bias`` (N,) replicated. Returns
    (m, N): this device's block of rows of the summed product. At step s a device computes its
    partial of the block that ends at device ``i + P - 1 - s``, adds the partials that arrived
    with it in the GEMM's epilogue (in float32) and passes the sum on; at the last step the
    block is its own, and the epilogue adds the bias and applies the activation.
    """
    x, kernel = arguments.array("x", x), arguments.array("kernel", kernel)
    if x.ndim != 2 or kernel.ndim != 2:
        raise ValueError(f"x must be (P m, k) and kernel (k, N); got {x.shape} and {kernel.shape}.")
    devices, me, ring = _ring(axis_name)
    if x.shape[0] % devices:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of the {devices} devices along {axis_name!r}.")
    m = x.shape[0] // devices
    act = activations.resolve(activation)

    def last(acc, *ops):
        z = acc + ops[0] if devices > 1 else acc
        return act(z + ops[-1]) if bias is not None else act(z)

    total = None
    for step in range(devices):
        rows = lax.dynamic_slice_in_dim(x, (me + devices - 1 - step) % devices * m, m, axis=0)
        arrived = () if total is None else (lax.ppermute(total, axis_name, ring),)
        if step < devices - 1:
            total = gemm(rows, kernel, (lambda acc, c: acc + c) if arrived else None, *arrived,
                         out_dtypes=jnp.float32, precision=precision, config=config)
        else:
            total = gemm(rows, kernel, last, *arrived, *(() if bias is None else (bias,)), out_dtypes=x.dtype,
                         precision=precision, config=config)
    return total
