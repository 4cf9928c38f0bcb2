"""Argument checks shared by the public ops: each names the argument and what it may be, and
returns the argument in the form the ops keep (hashable, canonical)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import GemmConfig

__all__ = ["array", "flag", "dtype", "INPUT_DTYPES", "inputs", "mixes_8bit", "default_out_dtype", "allowed_acc_dtypes", "acc_dtype", "out_dtypes", "check_x64", "check_config", "precision",
           "is_8bit_float", "fast_accumulation", "kernel_precision_reason", "reference_precision"]


def array(name: str, x: Any) -> Any:
    if isinstance(x, (str, bytes, dict, type(None))) or callable(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}.")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__} ({e}).") from None


def flag(name: str, value: Any) -> bool:
    """A Python bool that decides the kernel at trace time: a traced value cannot."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a Python bool (it is fixed when the call is traced), got "
                    f"{type(value).__name__}.")


def dtype(name: str, value: Any, floating: bool = False) -> np.dtype:
    if isinstance(value, jax.Array) or (isinstance(value, np.ndarray) and value.ndim):
        raise TypeError(f"{name} must be a dtype, got an array; pass its .dtype.")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be a dtype (e.g. jnp.float32), got {value!r}.") from None
    if floating and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dtype.name}.")
    if not (dtype.kind in "biu" or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{name} must be a real numeric dtype, got {dtype.name}.")
    return dtype


# A and B dtypes; the 8-bit floats accumulate in float32 (their scales are epilogue scalars or
# row/column operands), the 8-bit integers in int32, exactly
INPUT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64,
                                           jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8, jnp.uint8))


def inputs(op: str, a_name: str, a: Any, b_name: str, b: Any) -> None:
    """Check the two GEMM inputs of ``op``: each of ``INPUT_DTYPES``, and one dtype for both
    (or the two 8-bit float formats)."""
    for name, x in ((a_name, a), (b_name, b)):
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; {op} takes "
                            f"{', '.join(d.name for d in INPUT_DTYPES[:-1])} or {INPUT_DTYPES[-1].name}.")
    if a.dtype != b.dtype and not mixes_8bit(a.dtype, b.dtype):
        raise TypeError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}; cast one so both have the same dtype "
                        "(only the two 8-bit float formats mix, and int8 with uint8).")


def default_out_dtype(ab_dtype: Any, acc_dtype: Any) -> np.dtype:
    """Outputs take the inputs' dtype unless ``out_dtypes`` says otherwise; integer inputs'
    their (exact) int32 accumulator's, as ``jnp.matmul(..., preferred_element_type=jnp.int32)``."""
    return np.dtype(acc_dtype) if jnp.issubdtype(ab_dtype, jnp.integer) else np.dtype(ab_dtype)


def mixes_8bit(a_dtype, b_dtype) -> bool:
    """Whether A and B are two 8-bit types GEMMs take together: the two float formats (e4m3 x
    e5m2), or int8 and uint8."""
    kinds = {jnp.issubdtype(d, jnp.floating) for d in (a_dtype, b_dtype)}
    return len(kinds) == 1 and all(np.dtype(d).itemsize == 1 for d in (a_dtype, b_dtype))


def allowed_acc_dtypes(ab_dtype: Any) -> list[str]:
    """What a GEMM of ``ab_dtype`` inputs may accumulate in: float32 (16- and 32-bit inputs),
    float64 (any), float16 for float16 inputs. Nothing narrower than the inputs, and nothing that
    is not a float: GEMMs do not accumulate floats in integers."""
    ab_dtype = np.dtype(ab_dtype)
    if jnp.issubdtype(ab_dtype, jnp.integer):
        return ["int32"]  # exact: 8-bit products summed over K < 2^17 fit
    allowed = ["float32", "float64"] if ab_dtype.itemsize <= 4 else ["float64"]
    return ["float16", *allowed] if ab_dtype == np.dtype(jnp.float16) else allowed


def acc_dtype(value: Any, ab_dtype: np.dtype) -> np.dtype:
    """The accumulator dtype: float32 by default (float64 for float64 inputs), else one of
    :func:`allowed_acc_dtypes`."""
    if value is None:  # (8-bit floats promote to nothing implicitly: float32 explicitly)
        if jnp.issubdtype(ab_dtype, jnp.integer):
            return np.dtype(jnp.int32)
        return np.dtype(jnp.float32) if ab_dtype.itemsize == 1 else np.dtype(jnp.promote_types(ab_dtype, jnp.float32))
    acc = dtype("acc_dtype", value)
    allowed = allowed_acc_dtypes(ab_dtype)
    if acc.name not in allowed:
        raise TypeError(f"acc_dtype={acc.name} cannot accumulate {ab_dtype.name} inputs; allowed: "
                        f"{', '.join(allowed)}.")
    return acc


def out_dtypes(out_dtypes: Any) -> Any:
    """``out_dtypes`` in a hashable form, each entry checked."""
    if out_dtypes is None:
        return None
    if isinstance(out_dtypes, dict):
        return ("dict", tuple((str(k), dtype(f"out_dtypes[{k!r}]", v).name) for k, v in out_dtypes.items()))
    if isinstance(out_dtypes, (tuple, list)):
        return ("tuple", tuple(dtype(f"out_dtypes[{i}]", v).name for i, v in enumerate(out_dtypes)))
    return dtype("out_dtypes", out_dtypes).name


def check_x64(*dtypes: Any) -> None:
    if jax.config.jax_enable_x64:
        return
    wide = sorted({np.dtype(d).name for d in dtypes if np.dtype(d).itemsize == 8})
    if wide:
        raise TypeError(f"{', '.join(wide)} needs 64-bit types, which are off: enable them with "
                        "jax.config.update('jax_enable_x64', True), or use 32-bit dtypes.")


def check_config(config: Any) -> None:
    if config is None or isinstance(config, GemmConfig) or config == "autotune":
        return
    if isinstance(config, str):
        raise ValueError(f"config={config!r}: the only config named by a string is 'autotune'.")
    raise TypeError(f"config must be a jax_efc.GemmConfig, 'autotune' or None, got {type(config).__name__}.")


def precision(precision: Any) -> Any:
    """``precision`` as ``lax.dot_general`` takes it (None, a ``lax.Precision``, a pair of them,
    or a ``lax.DotAlgorithmPreset``), names converted; anything else is a ``TypeError``."""
    def one(p):
        if p is None or isinstance(p, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
            return p
        if isinstance(p, str):
            for kind in (jax.lax.Precision, jax.lax.DotAlgorithmPreset):
                try:
                    return kind[p] if kind is jax.lax.DotAlgorithmPreset else kind(p)
                except (ValueError, KeyError):
                    pass
        raise TypeError(f"precision must be None, a jax.lax.Precision, its name, a pair of them, or a "
                        f"jax.lax.DotAlgorithmPreset; got {precision!r}.")

    if precision is None:
        # the default a dot takes where none is given (jax.default_matmul_precision), resolved
        # here so that the call's parameters, and every plan and cache keyed on them, hold it
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        pair = tuple(one(p) for p in precision)
        if any(isinstance(p, jax.lax.DotAlgorithmPreset) for p in pair):
            raise TypeError(f"a jax.lax.DotAlgorithmPreset is one precision for the whole dot, not one of a "
                            f"pair; got {precision!r}.")
        return pair
    return one(precision)


# JAX's names for an FP8 dot that skips promoting partial sums into fp32 (fast accumulation)
_FAST_ACCUM = ("ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY_FAST_ACCUM")
# presets that leave the kernel's arithmetic as it is: the default, and FP8 in and fp32 accumulation
_KERNEL_PRESETS = ("DEFAULT", "ANY_F8_ANY_F8_F32", "ANY_F8_ANY_F8_ANY", *_FAST_ACCUM)


def is_8bit_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 1


def fast_accumulation(precision: Any) -> bool:
    """Whether ``precision`` (as :func:`precision` returns it) asks an FP8 GEMM for fast
    accumulation: the tensor cores' own, which over a long K keeps fewer bits than fp32."""
    return isinstance(precision, jax.lax.DotAlgorithmPreset) and precision.name in _FAST_ACCUM


def most_precise(precision: Any) -> bool:
    """Whether ``precision`` (as :func:`precision` returns it) asks an FP8 GEMM for XLA's most
    precise arithmetic: ``HIGHEST`` (for either operand), or fp32 accumulation by name."""
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name == "ANY_F8_ANY_F8_F32"
    pair = precision if isinstance(precision, tuple) else (precision,)
    return jax.lax.Precision.HIGHEST in pair


# float32 inputs multiply as TF32 in the kernel: what JAX gives the levels DEFAULT and HIGH on
# NVIDIA GPUs ("tensorfloat32" is HIGH), and the preset that names it
_TF32_LEVELS = (None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH)
_TF32_PRESETS = ("DEFAULT", "TF32_TF32_F32")


def kernel_precision_reason(precision: Any, a_dtype: Any) -> str | None:
    """Why the kernel does not run a dot of ``a_dtype`` inputs at ``precision``: a preset that asks
    for arithmetic other than the kernel's, or float32 inputs at a precision above TF32
    (``None``: it runs)."""
    if np.dtype(a_dtype) == np.float32:
        if isinstance(precision, jax.lax.DotAlgorithmPreset):
            tf32 = precision.name in _TF32_PRESETS
        else:
            tf32 = all(p in _TF32_LEVELS for p in (precision if isinstance(precision, tuple) else (precision,)))
        if not tf32:
            return (f"float32 inputs at precision={getattr(precision, 'name', precision)}: the kernel multiplies "
                    "float32 as TF32 (10-bit mantissas, what JAX gives precision DEFAULT and HIGH on NVIDIA "
                    "GPUs) and has no 3xTF32 mode, so XLA runs the more precise dot asked for.")
        return None
    if isinstance(precision, jax.lax.DotAlgorithmPreset) and precision.name not in _KERNEL_PRESETS:
        return f"precision={precision.name} asks for an algorithm the kernel does not implement."
    return None


def reference_precision(precision: Any, a_dtype: Any) -> Any:
    """``precision`` for XLA's dot in the reference. 8-bit float inputs promote partial sums
    into fp32 unless fast accumulation is asked for, as the kernel does: they get the precision
    XLA's GPU dot maps to each (``HIGHEST``: promoted; ``DEFAULT``: fast accumulation), which
    every backend takes. Other inputs ignore the FP8 presets."""
    if is_8bit_float(a_dtype):
        return jax.lax.Precision.DEFAULT if fast_accumulation(precision) else jax.lax.Precision.HIGHEST
    if isinstance(precision, jax.lax.DotAlgorithmPreset) and precision.name in _KERNEL_PRESETS:
        return None
    return precision
