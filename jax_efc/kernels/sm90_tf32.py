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

__all__ = ["MmaTF32Op", "round_to_tf32", "tf32_tiled_mma"]

_TF32_K = 8  # K of one TF32 WGMMA
_UNIT = 4  # fp32 values in one 16-byte unit of shared memory, which the 128-byte swizzle keeps whole
_BATCH = 4  # units a thread rounds at a time (16 registers)


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


@cute.jit
def round_to_tf32(ring: cute.Tensor, stage, tid, threads: int) -> None:
    """Round the K-major fp32 k-tile in ``stage`` of a shared-memory ``ring`` ((rows, K, stages),
    swizzled) to TF32 in place, to nearest with ties away from zero (``cvt.rna``, as XLA's TF32
    GEMMs round; the WGMMA itself keeps the top 10 mantissa bits, truncating), thread ``tid`` of
    ``threads`` a share. Four consecutive values of a row stay together under the swizzle, so
    each thread rounds whole 16-byte units, consecutive threads consecutive units of a row. A
    batch of a thread's units is loaded before any is stored, so their loads overlap (its stores
    could alias them); batches of four, as eight spilled 12 bytes beside a ping-pong 128x192
    tile's 192 accumulators. The caller fences and synchronises before the WGMMAs read the
    k-tile."""
    units = cute.size(ring, mode=[1]) // _UNIT
    per_thread, left = divmod(cute.size(ring, mode=[0]) * units, threads)
    if cutlass.const_expr(left):  # (never: tiles are multiples of 64 rows)
        raise ValueError(f"{cute.size(ring, mode=[0])} rows of {units} units do not split over {threads} threads")
    batch = min(per_thread, _BATCH)
    vals = cute.make_rmem_tensor((_UNIT, batch), cutlass.Float32)
    bits = cute.recast_tensor(vals, cutlass.Int32)
    for first in cutlass.range_constexpr(0, per_thread, batch):
        count = min(batch, per_thread - first)  # (the last batch may be short: 6 units, 4 + 2)
        for j in cutlass.range_constexpr(count):
            cute.autovec_copy(_unit(ring, stage, units, tid + (first + j) * threads), vals[(None, j)])
        for i in cutlass.range_constexpr(_UNIT * count):
            bits[i] = cute.arch.cvt_f32_tf32(vals[i])
        for j in cutlass.range_constexpr(count):
            cute.autovec_copy(vals[(None, j)], _unit(ring, stage, units, tid + (first + j) * threads))


def _unit(ring: cute.Tensor, stage, units: int, e) -> cute.Tensor:
    """16-byte unit ``e`` of ``ring``'s k-tile in ``stage``: row ``e // units``, four values from
    ``4 * (e % units)`` on."""
    return cute.zipped_divide(ring[(e // units, None, stage)], (_UNIT,))[(None, e % units)]
