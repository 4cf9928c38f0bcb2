"""The checking process of first-use checks (``jax_efc.self_check``): ``python -m jax_efc.checking
JOB`` builds the kernel a call's plan runs, with its config, for a small problem whose tiles cross
every edge, runs it in both schedules on random inputs, compares every output with XLA's
reference on the CPU, and writes the verdict where the plan reads it."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["check_shapes", "compare", "check_call", "check_group_sizes", "check_grouped_call",
           "check_contraction_call"]


def check_shapes(config: Any, tile_k: int, batched: bool, gated: int = 0) -> tuple[int, int, int, int]:
    """(M, N, K, L) of the problems a kernel of ``config`` is checked on: along M and N one tile
    more than twice the cluster (a count the cluster does not divide) with the last one partial,
    K of eleven and a half k-tiles (the ring wraps, the last k-tile is partial), two batches where
    the call has a batch. Each a multiple of 16 (every input's TMA alignment). A gated GEMM's N
    (the product's) is one (gate, up) pair of ``gated``-column blocks past twice the cluster's
    tiles: the last tile partial where a tile holds several pairs."""
    def edge(tile: int, cluster: int) -> int:
        return 2 * cluster * tile + tile // 2 + 16

    n = 2 * config.cluster_n * config.tile_n + 2 * gated if gated else edge(config.tile_n, config.cluster_n)
    return edge(config.tile_m, config.cluster_m), n, 11 * tile_k + tile_k // 2, 2 if batched else 1


def check_group_sizes(groups: int, tile_m: int) -> list[int]:
    """The group sizes a grouped kernel of ``groups`` groups and ``tile_m``-row tiles is checked
    with, in turn: a tile and a half plus 16 rows (its last tile partial, reaching into the next
    group), none, half a tile, two whole tiles. The check adds half a tile of rows past the
    groups."""
    pattern = (tile_m + tile_m // 2 + 16, 0, tile_m // 2, 2 * tile_m)
    return [pattern[g % len(pattern)] for g in range(groups)]


def _tolerance(out_dtype: str, ab_dtype: str, fast: bool) -> float:
    """How far from XLA's reference (computed on the CPU, fp32 accumulation) an output may lie,
    as a share of the reference's largest magnitude: twice the output's rounding step, plus what
    the MMA's own arithmetic differs by (TF32 and 8-bit products, fp16 or fast accumulation).
    Misplaced, missing or doubled values lie much farther off."""
    step = {"float32": 2.0 ** -20, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -3,
            "float8_e5m2": 2.0 ** -2}.get(out_dtype, 0.0)
    mma = 1e-2 if fast or ab_dtype == "float32" else 2e-3
    return 2 * step + mma


def compare(got: Sequence[Any], want: Sequence[Any], names: Sequence[str], tolerances: Sequence[float]) -> str | None:
    """Why the kernel's outputs ``got`` are not the reference's ``want`` (``None``: they are):
    NaN in different places, or a value farther off than its tolerance (integers: by more than
    one, a rounding step)."""
    for name, g, w, tol in zip(names, got, want, tolerances):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return f"output {name!r} has shape {g.shape}, not {w.shape}"
        if not np.array_equal(np.isnan(g), np.isnan(w)):
            return f"output {name!r} has NaN where the reference has none, or the other way round"
        finite = ~np.isnan(w)
        err = np.abs(g[finite] - w[finite]).max(initial=0.0)
        bound = max(1.0, tol * np.abs(w[finite]).max(initial=0.0))
        if err > bound:
            return f"output {name!r} is off by {err:.3g} where the reference's largest is {np.abs(w[finite]).max():.3g}"
    return None


def _random(spec: Any, key: Any) -> Any:
    """Random inputs of ``spec``: normal floats, small integers of the dtype's sign."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(spec.dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        low = 0 if jnp.issubdtype(dtype, jnp.unsignedinteger) else -8
        return jax.random.randint(key, spec.shape, low, 9, jnp.int32).astype(dtype)
    return jax.random.normal(key, spec.shape, jnp.float32).astype(dtype)


def check_call(specs: Sequence[tuple], params: dict[str, Any]) -> tuple[bool, str]:
    """Check the kernel of the call with input ``specs`` ((shape, dtype) each, canonical shapes)
    and ``params`` (its ``config`` the one the call's plan runs) on this GPU, on the problem of
    :func:`check_shapes` in both schedules; returns (passed, what failed)."""
    import jax

    from jax_efc import arguments, device, ffi
    from jax_efc.epilogue import canonical_shape
    from jax_efc.kernels.problem import tile_k
    from jax_efc.plan import plan_kernel
    from jax_efc.reference import fused_gemm_reference

    a, b, *operands = (jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs)
    kw = dict(transpose_a=params["transpose_a"], transpose_b=params["transpose_b"], acc_dtype=params["acc_dtype"],
              arch=device.arch(), precision=params["precision"])
    ir = params["ir"]
    ab_dtype = np.dtype(a.dtype).name
    m, n, k, l = check_shapes(params["config"], tile_k(ab_dtype), 3 in (len(a.shape), len(b.shape)), ir.gated)
    out_n = n // 2 if ir.gated else n
    fast = arguments.fast_accumulation(params["precision"])
    tolerances = [_tolerance(o.dtype, ab_dtype, fast) for o in ir.outputs]
    names = [o.name for o in ir.outputs]

    def shaped(x: Any, dims: tuple) -> Any:
        return jax.ShapeDtypeStruct(((l,) if len(x.shape) == 3 else ()) + dims, x.dtype)

    check_a = shaped(a, (k, m) if params["transpose_a"] else (m, k))
    check_b = shaped(b, (n, k) if params["transpose_b"] else (k, n))
    check_ops = [jax.ShapeDtypeStruct(canonical_shape(role.role, l if len(x.shape) == 3 else None, m, out_n), x.dtype)
                 for role, x in zip(ir.operands, operands)]
    keys = jax.random.split(jax.random.key(0), 2 + len(check_ops))
    inputs = [_random(s, kk) for s, kk in zip([check_a, check_b, *check_ops], keys)]
    # the reference on the CPU: XLA's dot with fp32 (int32) accumulation, not the GPU's (float32
    # inputs in full fp32, which the CPU's dot computes whatever the precision says)
    cpu = jax.devices("cpu")[0]
    precision = None if ab_dtype == "float32" else params["precision"]
    reference = jax.jit(lambda *x: fused_gemm_reference(*x, ir=ir, transpose_a=params["transpose_a"],
                                                         transpose_b=params["transpose_b"],
                                                         acc_dtype=params["acc_dtype"], precision=precision))
    want = reference(*(jax.device_put(x, cpu) for x in inputs))
    for stream_k in (True, False):
        config = dataclasses.replace(params["config"], stream_k=stream_k)
        check = plan_kernel(ir, check_a, check_b, check_ops, config=config, **kw)
        if check.backend != "kernel":
            return False, f"the check's {m}x{n}x{k} problem cannot run the kernel: {check.reason}"
        if stream_k and check.schedule.stream_k is None:
            continue  # this kernel never splits k-iterations: the whole-tile run covers it
        got = jax.jit(lambda *x, plan=check: ffi.fused_gemm(*x, plan=plan))(*inputs)
        why = compare(got, want, names, tolerances)
        if why:
            schedule = "stream-K" if stream_k else "whole tiles"
            return False, f"{why} on a {m}x{n}x{k} (batch {l}) problem in {schedule}"
    return True, ""


def check_grouped_call(specs: Sequence[tuple], params: dict[str, Any]) -> tuple[bool, str]:
    """:func:`check_call` for a grouped GEMM (``grouped_gemm_p``'s inputs and parameters): its
    kernel, with the call's group count and config, on the groups of :func:`check_group_sizes`,
    N and K as :func:`check_shapes` makes them; per-group operands zero past the groups."""
    import jax
    import jax.numpy as jnp

    from jax_efc import arguments, device, ffi
    from jax_efc.epilogue import canonical_shape
    from jax_efc.grouped_primitive import grouped_gemm_reference
    from jax_efc.kernels.problem import tile_k
    from jax_efc.plan import plan_kernel

    lhs, rhs, _, *operands = (jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs)
    ir, config, transpose_b = params["ir"], params["config"], params["transpose_b"]
    groups, ab_dtype = rhs.shape[0], np.dtype(lhs.dtype).name
    sizes = check_group_sizes(groups, config.tile_m)
    t = sum(sizes) + config.tile_m // 2
    _, n, k, _ = check_shapes(config, tile_k(ab_dtype), False)
    check_lhs = jax.ShapeDtypeStruct((t, k), lhs.dtype)
    check_rhs = jax.ShapeDtypeStruct((groups, n, k) if transpose_b else (groups, k, n), rhs.dtype)
    check_ops = [jax.ShapeDtypeStruct((groups + 1, 1, n) if len(x.shape) == 3 else canonical_shape(role.role, None, t, n),
                                      x.dtype) for role, x in zip(ir.operands, operands)]
    keys = jax.random.split(jax.random.key(0), 2 + len(check_ops))
    inputs = [_random(s, kk) for s, kk in zip([check_lhs, check_rhs, *check_ops], keys)]
    inputs[2:] = [x.at[-1].set(0) if len(x.shape) == 3 else x for x in inputs[2:]]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cpu = jax.devices("cpu")[0]
    reference = jax.jit(lambda lhs, rhs, sizes, *ops: grouped_gemm_reference(
        lhs, rhs, sizes, *ops, ir=ir, transpose_b=transpose_b, acc_dtype=params["acc_dtype"],
        precision=params["precision"], config=config))
    want = reference(*(jax.device_put(x, cpu) for x in (inputs[0], inputs[1], group_sizes, *inputs[2:])))
    check = plan_kernel(ir, check_lhs, check_rhs, check_ops, config=config, transpose_a=False, transpose_b=transpose_b,
                        acc_dtype=params["acc_dtype"], arch=device.arch(), precision=params["precision"],
                        groups=groups)
    if check.backend != "kernel":
        return False, f"the check's {t}x{n}x{k} problem of {groups} groups cannot run the kernel: {check.reason}"
    got = jax.jit(lambda lhs, rhs, sizes, *ops: ffi.fused_gemm(lhs, rhs, *ops, plan=check, group_sizes=sizes))(
        inputs[0], inputs[1], group_sizes, *inputs[2:])
    fast = arguments.fast_accumulation(params["precision"])
    why = compare(got, want, [o.name for o in ir.outputs], [_tolerance(o.dtype, ab_dtype, fast) for o in ir.outputs])
    return (False, f"{why} on {groups} groups of sizes {sizes} ({t}x{n}x{k})") if why else (True, "")


def check_contraction_call(specs: Sequence[tuple], params: dict[str, Any]) -> tuple[bool, str]:
    """:func:`check_call` for a grouped weight gradient (``grouped_contraction_p``'s inputs and
    parameters): its kernel, with the call's group count and config, on the groups of
    :func:`check_group_sizes` in k-tiles (a last k-tile cut at its group's end, an empty group,
    one shorter than a k-tile, whole k-tiles), M and N as :func:`check_shapes` makes them, and
    NaN in the rows past the groups (which no group's product may read)."""
    import jax
    import jax.numpy as jnp

    from jax_efc import device, ffi
    from jax_efc.grouped_primitive import grouped_contraction_reference
    from jax_efc.kernels.problem import tile_k
    from jax_efc.plan import plan_kernel

    a, b, sizes_spec = (jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs)
    ir, config = params["ir"], params["config"]
    groups, ab_dtype = sizes_spec.shape[0], np.dtype(a.dtype).name
    depth = tile_k(ab_dtype)
    sizes = check_group_sizes(groups, depth)
    t = sum(sizes) + depth // 2
    m, n, _, _ = check_shapes(config, depth, False)
    check_a, check_b = jax.ShapeDtypeStruct((t, m), a.dtype), jax.ShapeDtypeStruct((t, n), b.dtype)
    keys = jax.random.split(jax.random.key(0), 2)
    inputs = [_random(s, kk).at[sum(sizes):].set(jnp.nan) for s, kk in zip((check_a, check_b), keys)]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cpu = jax.devices("cpu")[0]
    reference = jax.jit(lambda a, b, sizes: grouped_contraction_reference(
        a, b, sizes, ir=ir, acc_dtype=params["acc_dtype"], precision=params["precision"], config=config))
    want = reference(*(jax.device_put(x, cpu) for x in (*inputs, group_sizes)))
    check = plan_kernel(ir, check_a, check_b, [], config=config, transpose_a=True, transpose_b=False,
                        acc_dtype=params["acc_dtype"], arch=device.arch(), precision=params["precision"],
                        groups=groups, ragged_k=True)
    if check.backend != "kernel":
        return False, f"the check's {m}x{n}x{t} problem of {groups} groups cannot run the kernel: {check.reason}"
    got = jax.jit(lambda a, b, sizes: ffi.fused_gemm(a, b, plan=check, group_sizes=sizes))(*inputs, group_sizes)
    why = compare(got, want, [o.name for o in ir.outputs], [_tolerance(o.dtype, ab_dtype, False) for o in ir.outputs])
    return (False, f"{why} on {groups} groups of sizes {sizes} ({m}x{n}x{t})") if why else (True, "")


def main(argv: Sequence[str]) -> None:
    """The checking process: check the job's call and keep the verdict under the key the parent
    passed (``JAX_EFC_SELF_CHECK_KEY``)."""
    import os

    from jax_efc import device, self_check
    from jax_efc.config import write_record

    specs, params = device.read_job(argv[0])
    # a grouped call's group count (0 for a dense call), and whether its groups split the contraction
    grouped, ragged_k = params.pop("groups"), params.pop("ragged_k")
    check = check_contraction_call if ragged_k else check_grouped_call if grouped else check_call
    passed, detail = check(specs, params)
    write_record(self_check.folder(), os.environ["JAX_EFC_SELF_CHECK_KEY"], {"passed": passed, "detail": detail})


if __name__ == "__main__":
    main(sys.argv[1:])
