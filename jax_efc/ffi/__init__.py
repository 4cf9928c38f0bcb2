"""jax_efc.ffi: the fused-GEMM kernels as XLA custom calls, through ``cutlass.jax.cutlass_call``.

The compiled CuTe module rides inside the custom call, so ``jax.export`` and CUDA graphs
work. Arrays are presented to the kernel without copies: every tensor is viewed as 3-D
(a leading unit batch is a free reshape) and ``TensorSpec(mode=...)`` reorders its modes into
the kernel's (M, K, L) / (N, K, L) / (M, N, L) view, whichever dimension is contiguous.

Importing this module is cheap: cutlass is imported only inside the functions that need it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_efc.config import GemmConfig
from jax_efc.epilogue import EpilogueIR
from jax_efc.kernels import DEFAULT_SM_COUNT, TIMELINE_EVENTS, TIMELINE_UNITS, assumed_max_clusters
from jax_efc.log import log_once

from . import kernel_cache

__all__ = ["device_arch", "planned_config", "unsupported_reason", "xla_faster_reason", "fused_gemm", "lower",
           "store_compiled"]

# compile key -> kernel object, so that re-lowering reuses it; the least recently used go first
_KERNELS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
KERNEL_CACHE_SIZE = 256


def device_arch() -> str | None:
    """``"sm_90a"``/``"sm_100a"`` from ``CUTE_DSL_ARCH`` if set, else from the first CUDA
    device's compute capability, else ``None``."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    try:
        import jax

        dev = jax.devices("cuda")[0]
        major, minor = str(dev.compute_capability).split(".")
    except Exception:  # no CUDA backend, or a device without a compute capability
        return None
    return f"sm_{major}{minor}a" if major in ("9", "10") else f"sm_{major}{minor}"


@functools.cache
def _sm_count() -> int:
    """SMs of the first CUDA device (it sizes the tile heuristic and the persistent grid)."""
    try:
        import jax

        return int(jax.devices("cuda")[0].core_count)
    except Exception:
        return DEFAULT_SM_COUNT


def _query_max_active_clusters(cluster_size: int, ordinal: int = 0) -> int:
    """Clusters of ``cluster_size`` one-CTA-per-SM blocks CUDA device ``ordinal`` runs at once,
    asked of the driver's occupancy calculator in the device's primary context (which JAX
    shares). Raises without a driver or a device."""
    from cuda.bindings import driver
    from cutlass.utils import HardwareInfo

    def check(result):  # cuda-bindings return (CUresult, *values)
        err, *value = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err}")
        return value[0] if value else None

    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(ordinal))
    check(driver.cuCtxPushCurrent(check(driver.cuDevicePrimaryCtxRetain(device))))
    try:
        return int(HardwareInfo().get_max_active_clusters(cluster_size))
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)


@functools.cache
def _measured_clusters(cluster_size: int, ordinal: int) -> int | None:
    try:
        return _query_max_active_clusters(cluster_size, ordinal)
    except Exception:  # no driver, or no such device
        return None


def _residency(cluster_size: int, devices: Sequence[int] | None) -> tuple[int, bool]:
    """The persistent grid's size in clusters, and whether all of it is known to be resident at
    once on the devices the call runs on: ``devices`` lists their ordinals; empty means
    unknown (an exported program may run on any GPU: a smaller one, a MIG slice); None means
    the process's first CUDA device or, with none (compiling on a CPU for a test), the GPU
    :func:`~jax_efc.kernels.assumed_max_clusters` describes.

    Measured, the grid is the smallest of the devices' answers. Unknown, or with MPS limiting
    the SMs a process may use, it is the assumed one, and not resident: a grid larger than the
    GPU then runs in two waves, which only costs time, but the schedule must not make CTAs
    wait on one another (stream-K), since a waiting CTA can hold the SM a waited-for one needs."""
    assumed = assumed_max_clusters(cluster_size, _sm_count())
    mps = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    if mps and mps not in ("100", "100.0"):
        return assumed, False
    if devices is None:
        measured = _measured_clusters(cluster_size, 0)
        return (assumed, True) if measured is None else (measured, True)
    answers = [_measured_clusters(cluster_size, d) for d in devices]
    if not answers or None in answers:
        return assumed, False
    return min(answers), True


def _max_active_clusters(cluster_size: int) -> int:
    """The persistent grid's size in clusters on the first CUDA device (see :func:`_residency`)."""
    return _residency(cluster_size, None)[0]


def _use_private_dsl_cache() -> None:
    """Point the DSL's on-disk cache (else a predictable path under /tmp) into jax_efc's
    per-user cache directory, made owner-only; a ``CUTE_DSL_CACHE_DIR`` the user set wins.
    Must run before cutlass is first imported: the DSL reads the variable then."""
    if "CUTE_DSL_CACHE_DIR" in os.environ:
        return
    from jax_efc.config import private_cache_dir

    try:
        os.environ["CUTE_DSL_CACHE_DIR"] = private_cache_dir("cute_dsl")
    except OSError as e:
        log_once(logging.WARNING, f"the CuTe DSL keeps its default cache directory: {e}")


@functools.cache
def _dsl_reason() -> str | None:
    _use_private_dsl_cache()
    try:
        import cutlass.jax as cjax
    except Exception as e:  # not installed, or broken
        return f"the CuTe DSL (nvidia-cutlass-dsl) is not importable ({type(e).__name__}: {e}); install it to use the kernels."
    if not cjax.is_available():
        return "cutlass.jax is not available with this JAX version; upgrade JAX or nvidia-cutlass-dsl."
    return None


def _dims(a, b, transpose_a: bool, transpose_b: bool) -> tuple[int, int, int, int | None]:
    """(M, N, K, L or None) from the canonical primitive shapes."""
    *la, a0, a1 = a.shape
    *lb, b0, b1 = b.shape
    m, k = (a1, a0) if transpose_a else (a0, a1)
    n = b0 if transpose_b else b1
    lead = la or lb
    return m, n, k, (lead[0] if lead else None)


def _problem(ir: EpilogueIR, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch):
    from jax_efc.kernels import KernelProblem, choose_config

    m, n, k, batch = _dims(a, b, transpose_a, transpose_b)
    problem = KernelProblem(
        ir=ir,
        ab_dtype=np.dtype(a.dtype).name,
        acc_dtype=np.dtype(acc_dtype).name,
        a_major="m" if transpose_a else "k",
        b_major="k" if transpose_b else "n",
        batched=batch is not None,
        a_batched=len(a.shape) == 3,
        b_batched=len(b.shape) == 3,
        operand_batched=tuple(len(x.shape) == 3 for x in operands),
        arch=arch,
        config=config if config is not None else GemmConfig(),
    )
    mnkl = (m, n, k, batch or 1)
    if config is None:
        problem = dataclasses.replace(problem, config=choose_config(problem, *mnkl, sm_count=_sm_count()))
    return problem, mnkl


def unsupported_reason(ir: EpilogueIR, a, b, operands: Sequence[Any], *, transpose_a: bool,
                       transpose_b: bool, acc_dtype: Any, config: GemmConfig | None,
                       arch: str | None) -> str | None:
    """``None`` when the kernel can run this call; otherwise one sentence naming the cause.

    ``a``, ``b`` and ``operands`` are avals (anything with ``shape``/``dtype``) in the
    primitive's canonical shapes, which its abstract evaluation has already checked.
    """
    return _checked_problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch)[0]


def planned_config(ir: EpilogueIR, a, b, operands: Sequence[Any], *, transpose_a: bool, transpose_b: bool,
                   acc_dtype: Any, config: GemmConfig | None, arch: str) -> GemmConfig:
    """The config the kernel runs this call with: ``config``, or the heuristic's choice;
    arguments as :func:`unsupported_reason`'s."""
    return _problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch)[0].config


def xla_faster_reason(ir: EpilogueIR, a, b, operands: Sequence[Any], *, transpose_a: bool,
                      transpose_b: bool, acc_dtype: Any, arch: str) -> str | None:
    """Why XLA's GEMM is the faster choice for a call the kernel can run (``None``: the
    kernel is); arguments as :func:`unsupported_reason`'s."""
    from jax_efc.kernels import xla_faster_reason as reason

    # the rule reads the shape and the batching, not the tile: no heuristic to run
    problem, (m, n, _, l) = _problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype,
                                     GemmConfig(), arch)
    return reason(problem, m, n, l, sm_count=_sm_count())


def _checked_problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch):
    """(reason or None, problem or None, (M, N, K, L) or None): the problem is built once for
    both the refusal check and the launch."""
    if arch is None:
        return "no CUDA device and CUTE_DSL_ARCH is unset; the kernels need an sm_90a GPU.", None, None
    reason = _dsl_reason()
    if reason:
        return reason, None, None
    from jax_efc.kernels import unsupported_reason as kernel_reason

    problem, mnkl = _problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype, config, arch)
    return kernel_reason(problem, mnkl), problem, mnkl


def _as3d(x):
    """View ``x`` as (L|1, d1, d2): free reshapes that add leading unit dimensions."""
    return x.reshape((1,) * (3 - x.ndim) + tuple(x.shape)) if x.ndim < 3 else x


def _kernel(problem, mnkl, timeline, devices):
    from jax_efc.kernels.schedule import plan_schedule

    cfg = problem.config
    clusters, resident = _residency(cfg.cluster_m * cfg.cluster_n, devices)
    schedule = plan_schedule(cfg if resident else dataclasses.replace(cfg, stream_k=False), *mnkl, clusters)
    key = (problem.compile_key, dataclasses.astuple(schedule)) + (("timeline",) if timeline else ())
    kernel = _KERNELS.get(key)
    if kernel is None:
        from jax_efc.kernels.sm90 import Sm90FusedGemm

        kernel = Sm90FusedGemm(problem, schedule, timeline)
    _KERNELS[key] = kernel
    _KERNELS.move_to_end(key)
    while len(_KERNELS) > KERNEL_CACHE_SIZE:
        _KERNELS.popitem(last=False)
    return key, kernel


# kernels compiled this process but not yet in the disk cache: entry key -> (compile key, input
# shapes). The DSL compiles a kernel when its call is lowered, after fused_gemm has returned.
_UNSTORED: dict[str, tuple] = {}


def store_compiled() -> None:
    """Put the kernels the DSL has compiled since the last call into the disk cache."""
    if not _UNSTORED:
        return
    from cutlass.jax import compile as dsl_compile
    from cutlass.jax.types import cutlass_to_jax_layout_order

    for disk_key, (key, shapes) in list(_UNSTORED.items()):
        for cache_key, result in list(dsl_compile._CUTLASS_COMPILE_CACHE.items()):
            if cache_key.compile_key == key and [tuple(x.shape) for x in result.spec.in_args] == shapes:
                spec = result.spec
                entry = kernel_cache.Entry(
                    module=bytes(result.module), fingerprint=bytes(result.fingerprint),
                    input_layouts=tuple(cutlass_to_jax_layout_order(t.layout) for t in spec.input_spec),
                    output_layouts=tuple(cutlass_to_jax_layout_order(t.layout) for t in spec.output_spec),
                    aliases=tuple(tuple(a) for a in spec.input_output_aliases))
                del _UNSTORED[disk_key]
                try:
                    kernel_cache.store(disk_key, entry)
                except OSError as e:  # the cache is a convenience: the kernel runs without it
                    log_once(logging.WARNING, f"the kernel cache cannot store kernels: {e}")
                break


def _stored_call(entry: kernel_cache.Entry, inputs: list, out_shapes: list) -> list:
    """The custom call ``cutlass_call`` would emit for the stored kernel, without the DSL."""
    import jax
    from cutlass.jax.ffi import get_cutlass_call_ffi_name, get_cutlass_call_ffi_version, register_ffi

    version = get_cutlass_call_ffi_version()
    register_ffi(version)
    call = jax.ffi.ffi_call(get_cutlass_call_ffi_name(True, version), result_shape_dtypes=out_shapes,
                            input_output_aliases=dict(entry.aliases), input_layouts=list(entry.input_layouts),
                            output_layouts=list(entry.output_layouts))
    return call(*inputs, module=entry.module, key=entry.fingerprint)


def lower(ctx, *args, **params) -> Any:
    """The kernel's lowering of a fused-GEMM call (``fused_gemm``'s keywords), its compiled
    module then stored in the disk cache. Where building the kernel fails, what the lowering
    had emitted so far (the DSL compiles while its call is lowered, into functions of their
    own) is removed before the exception propagates, so the caller can lower the call another
    way into a module that is still whole."""
    from jax.interpreters import mlir
    from jax._src.lib.mlir import ir

    module_ops = ctx.module_context.module.body.operations
    block_ops = ir.InsertionPoint.current.block.operations
    marks = len(module_ops), len(block_ops)
    try:
        lowered = mlir.lower_fun(functools.partial(fused_gemm, **params), multiple_results=True)(ctx, *args)
    except Exception:
        for ops, mark in ((block_ops, marks[1]), (module_ops, marks[0])):
            for i in reversed(range(mark, len(ops))):
                op = ops[i]
                if "sym_name" in op.attributes:
                    ctx.module_context.symbol_table.erase(op)
                else:
                    op.erase()
        raise
    store_compiled()
    return lowered


def fused_gemm(a, b, *operands, ir: EpilogueIR, transpose_a: bool, transpose_b: bool,
               acc_dtype: Any, config: GemmConfig | None, arch: str | None,
               devices: Sequence[int] | None = None, timeline: bool = False) -> list:
    """``ir``'s outputs of ``epilogue(op(a) @ op(b), *operands)``, one array per output in
    shape (M, N), or (L, M, N) when a or b is batched.

    Emits one ``cutlass_call`` custom call; call it under ``jit`` (or inside a lowering).
    Raise ``ValueError`` with the reason when :func:`unsupported_reason` refuses the call,
    ``TypeError`` when ``a`` and ``b`` differ in dtype. ``devices``, the ordinals of the CUDA
    devices the call will run on, size the persistent grid (see :func:`_residency`).
    ``timeline=True`` runs the kernel's diagnostic build and appends its SM-clock stamps to
    the outputs: int32 (CTAs, consumer groups, ``TIMELINE_UNITS``, ``TIMELINE_EVENTS``) of
    :mod:`jax_efc.kernels`, zero where no unit ran (read by :mod:`jax_efc.timeline`).
    """
    import jax
    import jax.numpy as jnp
    if np.dtype(a.dtype) != np.dtype(b.dtype):
        raise TypeError(f"a is {np.dtype(a.dtype).name} but b is {np.dtype(b.dtype).name}; the kernel "
                        "takes A and B of one dtype: cast one of them.")
    from cutlass.jax import TensorSpec, cutlass_call

    reason, problem, mnkl = _checked_problem(ir, a, b, operands, transpose_a, transpose_b, acc_dtype,
                                             config, arch)
    if reason:
        raise ValueError(f"jax_efc kernel cannot run this GEMM: {reason}")
    m, n, _, batch = mnkl
    key, kernel = _kernel(problem, mnkl, timeline, devices)

    # (L, r, c) row-major -> the kernel's (r|c, c|r, L) views: (1, 2, 0) keeps the rows
    # first, (2, 1, 0) swaps them.
    keep, swap = TensorSpec(mode=(1, 2, 0)), TensorSpec(mode=(2, 1, 0))
    inputs = [_as3d(a), _as3d(b), *(_as3d(x) for x in operands)]
    in_specs = [swap if transpose_a else keep, keep if transpose_b else swap, *([keep] * len(operands))]
    out_shapes = [jax.ShapeDtypeStruct((batch, m, n), o.dtype) for o in ir.outputs]
    out_specs = [keep] * len(out_shapes)
    aliases = {}
    slots = kernel.schedule.slots
    if slots:
        # stream-K: one flag per CTA, zeroed for every call (the kernel raises them, so they
        # are an input aliased to an output), and a workspace of one fp32 tile per CTA that
        # needs no initial value
        aliases = {len(inputs): len(out_shapes)}
        inputs.append(jnp.zeros((slots,), jnp.int32))
        in_specs.append(TensorSpec())
        cfg = problem.config
        out_shapes += [jax.ShapeDtypeStruct((slots,), jnp.int32),
                       jax.ShapeDtypeStruct((slots * cfg.tile_m * cfg.tile_n,), jnp.float32)]
        out_specs += [TensorSpec(), TensorSpec()]
    if timeline:
        # zeroed, so units that never ran read 0 (an input aliased to an output, as the flags)
        aliases[len(inputs)] = len(out_shapes)
        inputs.append(jnp.zeros((kernel.timeline_size(),), jnp.int32))
        in_specs.append(TensorSpec())
        out_shapes.append(jax.ShapeDtypeStruct((kernel.timeline_size(),), jnp.int32))
        out_specs.append(TensorSpec())
    stored = None
    if kernel_cache.enabled() and not timeline:
        disk_key = kernel_cache.entry_key(key, inputs, [s.mode for s in in_specs], out_shapes, aliases)
        stored = kernel_cache.load(disk_key)
        if stored is None:
            _UNSTORED[disk_key] = (key, [tuple(x.shape) for x in inputs])
    if stored is not None:
        results = _stored_call(stored, inputs, out_shapes)
    else:
        call = cutlass_call(
            kernel,
            output_shape_dtype=out_shapes,
            input_spec=in_specs,
            output_spec=out_specs,
            input_output_aliases=aliases,
            compile_key=key,
        )
        results = call(*inputs)
    batched = len(a.shape) == 3 or len(b.shape) == 3
    outs = [o if batched else o.reshape(m, n) for o in results[: len(ir.outputs)]]
    if not timeline:
        return outs
    return outs + [results[-1].reshape(-1, kernel.n_epi_groups, TIMELINE_UNITS, len(TIMELINE_EVENTS))]
