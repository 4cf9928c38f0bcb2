"""The dtypes the kernels handle: their widths (for shared-memory and alignment arithmetic,
with no cutlass import) and their CuTe DSL types (for the kernels themselves)."""

from __future__ import annotations

__all__ = ["bits", "align_elems", "cutlass_dtype", "FP8", "INT8", "OUT_DTYPES", "OPERAND_DTYPES", "VALUE_DTYPES"]

# NumPy dtype name -> (bits, name of the cutlass numeric type)
_DTYPES = {
    "float32": (32, "Float32"),
    "bfloat16": (16, "BFloat16"),
    "float16": (16, "Float16"),
    "float8_e4m3fn": (8, "Float8E4M3FN"),
    "float8_e5m2": (8, "Float8E5M2"),
    "int8": (8, "Int8"),
    "uint8": (8, "Uint8"),
    "int32": (32, "Int32"),
    "bool": (8, "Boolean"),
}

FP8 = ("float8_e4m3fn", "float8_e5m2")
INT8 = ("int8", "uint8")
# What the shared epilogue stores: 8-bit float outputs round to nearest even and saturate to the
# finite range (cvt.rn.satfinite); integer ones saturate (from floats rounded toward zero)
OUT_DTYPES = ("bfloat16", "float16", "float32", *FP8, "int32", *INT8)
# the dtypes of epilogue operands it reads
OPERAND_DTYPES = ("bfloat16", "float16", "float32")
# dtypes the visitor evaluates in: 16-bit values are computed in fp32 and rounded per op
VALUE_DTYPES = ("float32", "bfloat16", "float16", "bool")


def bits(name: str) -> int:
    """Bits of one element of dtype ``name``."""
    return _DTYPES[name][0]


def align_elems(name: str) -> int:
    """Elements in 16 bytes: TMA needs every non-contiguous stride 16-byte aligned."""
    return 16 * 8 // bits(name)


def cutlass_dtype(name: str) -> type:
    """The cutlass numeric type for a NumPy dtype name."""
    import cutlass

    return getattr(cutlass, _DTYPES[name][1])
