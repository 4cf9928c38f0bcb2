"""Hopper's TF32 warpgroup MMA (``wgmma ... .f32.tf32.tf32``), which the CuTe DSL's Python layer
does not offer (its ``warpgroup`` module has 16-bit, 8-bit float and 8-bit integer ops only)
although the dialect beneath it accepts TF32 operands.

TF32 WGMMA reads fp32 values from shared memory and uses their sign, exponent and top 10
mantissa bits; it takes K = 8 per instruction and both operands K-major only (the dialect
refuses MN-major TF32 operands). So the A/B ring holds plain fp32 k-tiles, 32 deep (128 bytes
a row, one 128-byte swizzle atom, as for every other input type).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.cute.nvgpu.warpgroup.mma import MmaOp, MmaTraits

__all__ = ["MmaTF32Op", "tf32_tiled_mma"]

_TF32_K = 8  # K of one TF32 WGMMA


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """An m64nNk8 TF32 WGMMA with fp32 accumulators, A and B K-major in shared memory."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, instruction_shape: tuple[int, int]) -> None:
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (*instruction_shape, _TF32_K),
                         OperandSource.SMEM, OperandMajorMode.K, OperandMajorMode.K)

    def _make_trait(self, *, loc=None, ip=None, **kwargs) -> MmaTF32Trait:
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type, self.a_src._to_ir())
        return MmaTF32Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


class MmaTF32Trait(MmaTraits):
    pass


def tf32_tiled_mma(atom_layout_mnk: tuple[int, int, int], tiler_mn: tuple[int, int]) -> cute.TiledMma:
    """The TF32 counterpart of ``hopper_helpers.make_trivial_tiled_mma`` (K-major A and B)."""
    return cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op(tiler_mn)), atom_layout_mnk)
