"""Blackwell's 8-bit integer UMMA with A and B of different signedness (int8 x uint8), which the
CuTe DSL's Python layer refuses (its ``MmaI8Op`` takes one type for both) although the MMA's
instruction descriptor carries each operand's signedness and the DSL's own atom builder takes them
apart (``tcgen05.mma ... kind::i8``, int32 accumulators in tensor memory)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05
from cutlass.cute.nvgpu.tcgen05.mma import MmaI8Op, MmaOp

__all__ = ["mixed_int8_tiled_mma"]

_I8_K = 32  # K of one 8-bit integer UMMA


class MmaMixedI8Op(MmaI8Op):
    """An 8-bit integer UMMA whose A and B may differ in signedness, both from shared memory."""

    def __init__(self, a_dtype: type, b_dtype: type, shape_mn: tuple[int, int], cta_group: tcgen05.CtaGroup,
                 a_major, b_major) -> None:
        MmaOp.__init__(self, a_dtype, b_dtype, cutlass.Int32, (*shape_mn, _I8_K), cta_group,
                       tcgen05.OperandSource.SMEM, a_major, b_major)
        if not {a_dtype, b_dtype} <= {cutlass.Int8, cutlass.Uint8}:
            raise TypeError(f"an 8-bit integer UMMA takes Int8 or Uint8 operands, not {a_dtype} and {b_dtype}")


def mixed_int8_tiled_mma(a_dtype: type, b_dtype: type, a_major, b_major, cta_group: tcgen05.CtaGroup,
                         shape_mn: tuple[int, int]) -> cute.TiledMma:
    """The mixed-signedness counterpart of ``blackwell_helpers.make_trivial_tiled_mma`` for
    8-bit integers."""
    return cute.make_tiled_mma(cute.make_mma_atom(MmaMixedI8Op(a_dtype, b_dtype, shape_mn, cta_group, a_major,
                                                               b_major)))
