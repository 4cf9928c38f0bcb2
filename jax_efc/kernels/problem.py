"""What a kernel is compiled for (:class:`KernelProblem`), and the layout constants every
architecture's kernel shares with the arithmetic that sizes it. No cutlass import: the plan
reads these before anything is compiled."""

from __future__ import annotations

import dataclasses

from jax_efc.config import GemmConfig
from jax_efc.epilogue import EpilogueIR, Role, masked_stores
from jax_efc.kernels.dtypes import bits

__all__ = ["KernelProblem", "tile_k", "EPI_STAGES", "SMEM_ALIGN", "TIMELINE_EVENTS", "TIMELINE_UNITS",
           "REDUCTION_IDENTITY", "cta_tile", "epilogue_tile", "epilogue_smem_bytes", "tile_operand_indices",
           "reduction_positions", "reduction_smem_floats", "WARP", "round_up"]

# A pipeline stage's k-tile is 128 bytes of a K-major row, exactly one 128-byte swizzle atom:
# 64 16-bit values (four 16-deep MMA steps), 128 8-bit ones (four 32-deep steps).
_K_TILE_BYTES = 128
# Two smem buffers per output (TMA stores) and per TILE operand (TMA loads, prefetched two
# subtiles ahead; a tile's first two are issued before its mainloop when cooperative, at
# the start of its epilogue with ping-pong, where the other consumer may hold the buffers).
EPI_STAGES = 2
# Each smem buffer is 1 KiB aligned (the 128-byte swizzle repeats every 1 KiB).
SMEM_ALIGN = 1024
# A timeline build (a diagnostic, ``jax_efc.timeline``) stamps the SM clock per consumer
# group and unit at these events, in order: the consumer reaches its mainloop (ping-pong:
# before waiting for the other consumer's), starts it, has issued its MMAs, has them
# complete, starts its epilogue, ends it; for at most TIMELINE_UNITS units a group.
TIMELINE_EVENTS = ("reached", "mainloop", "issued", "complete", "epilogue", "end")
TIMELINE_UNITS = 256
WARP = 32  # threads of a warp
# what a reduction of each kind starts from
REDUCTION_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


@dataclasses.dataclass(frozen=True)
class KernelProblem:
    """The compile-time description of one fused GEMM kernel.

    ``ab_dtype`` is A's dtype, ``b_dtype`` B's (A's unless given: only two 8-bit float
    formats differ). ``a_major`` is ``"k"`` (A stored (M, K) row-major) or ``"m"`` (stored (K, M));
    ``b_major`` is ``"n"`` (B stored (K, N)) or ``"k"`` (stored (N, K)). ``batched`` says
    whether the GEMM has a leading batch L; ``a_batched``/``b_batched``/``operand_batched``
    say which tensors carry it (the others are shared across the batch). ``promote``: every
    ``promote`` k-tiles the mainloop adds the WGMMAs' partial sums into separate fp32 accumulators
    (8-bit float inputs, whose tensor-core accumulation keeps fewer bits than fp32 over a long K; 0:
    never); promoting less often than each k-tile, the two warpgroups of a cooperative tile
    promote at alternate k-tiles, so that one drains its WGMMAs while the other's run. float32
    inputs are multiplied as TF32 (the plan sends them here only where the call's precision
    allows it). ``groups``: a grouped (ragged) GEMM of that many groups (0: not one), whose A
    rows are split into groups by sizes the kernel reads at run time, B batched by group
    (:mod:`~jax_efc.kernels.grouped_walk`); its batched operands are indexed by group.
    ``ragged_k``: the groups split the contraction instead (a grouped GEMM's weight gradient): A
    stored (T, M) and B (T, N), their rows in groups, and the output (G, M, N), each group's
    product of its own rows (:class:`~jax_efc.kernels.grouped_walk.ContractionWalk`).
    """

    ir: EpilogueIR
    ab_dtype: str
    acc_dtype: str
    a_major: str
    b_major: str
    batched: bool
    a_batched: bool
    b_batched: bool
    operand_batched: tuple[bool, ...]
    arch: str
    config: GemmConfig
    b_dtype: str = ""
    promote: int = 0
    groups: int = 0
    ragged_k: bool = False

    def __post_init__(self) -> None:
        if not self.b_dtype:
            object.__setattr__(self, "b_dtype", self.ab_dtype)

    @property
    def aliased(self) -> tuple[tuple[int, int], ...]:
        """(tile output index, operand index) of each output written over its operand (the
        custom call aliases the two, and the kernel stores into the operand's tensor): those the
        epilogue marks ``inplace`` whose operand has the output's shape (a batch as the outputs
        do, and not stored transposed)."""
        stored = [o for o in self.ir.outputs if not o.reduce]
        return tuple((i, o.inplace) for i, o in enumerate(stored)
                     if o.inplace is not None and self.operand_batched[o.inplace] == self.batched
                     and not o.transposed)

    @property
    def masked(self) -> tuple[int, ...]:
        """Tile output indices of the aliased outputs stored only where their mask holds
        (``Output.mask``): the kernel stores them from registers with a predicate per value."""
        stored = [o for o in self.ir.outputs if not o.reduce]
        return tuple(i for i, _ in self.aliased if stored[i].mask is not None)

    @property
    def program(self) -> EpilogueIR:
        """The program the kernel evaluates: a masked output it stores over its operand
        computes only the new value its mask selects (:func:`~jax_efc.epilogue.masked_stores`)."""
        stored = [k for k, o in enumerate(self.ir.outputs) if not o.reduce]
        return masked_stores(self.ir, [stored[i] for i, _ in self.aliased])

    @property
    def row_stats(self) -> bool:
        """Whether the program consumes reductions (each over N) inside the tile: the kernel
        finishes them over the tile's rows before it evaluates what uses them."""
        return bool(self.ir.reductions)

    @property
    def tile_k(self) -> int:
        return tile_k(self.ab_dtype)

    @property
    def compile_key(self) -> tuple:
        """Everything that changes the generated code, as a hashable, process-stable key."""
        return (
            "jax_efc.fused_gemm.v6",
            self.ir.fingerprint,
            self.ab_dtype,
            self.b_dtype,
            self.acc_dtype,
            self.a_major,
            self.b_major,
            self.batched,
            self.a_batched,
            self.b_batched,
            self.operand_batched,
            self.arch,
            self.promote,
            dataclasses.astuple(self.config),
        ) + ((("groups", self.groups, self.ragged_k),) if self.groups else ())


def tile_k(ab_dtype: str) -> int:
    """Depth of one pipeline stage's k-tile for A/B of ``ab_dtype``."""
    return _K_TILE_BYTES * 8 // bits(ab_dtype)


def cta_tile(config: GemmConfig) -> tuple[int, int]:
    """(rows, columns) of the output tile one CTA computes and stores: the config's tile, or half
    its rows where a 2-CTA MMA (``use_2cta``) splits them between a pair of CTAs."""
    return (config.tile_m // 2 if config.use_2cta else config.tile_m), config.tile_n


def epilogue_tile(config: GemmConfig) -> tuple[int, int]:
    """(rows, columns) of one epilogue subtile: ``epi_m`` (0: the CTA tile's height) by ``epi_n``."""
    return config.epi_m or cta_tile(config)[0], config.epi_n


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def epilogue_smem_bytes(problem: KernelProblem, threads: int) -> int:
    """Shared memory the epilogue's buffers take when ``threads`` threads run each tile's
    epilogue: ``EPI_STAGES`` subtiles per stored output and per TILE operand, and each reducing
    output's and each reduction the program consumes (over N) its buffer where warps meet, every
    buffer a whole number of 1 KiB blocks."""
    epi_m, epi_n = epilogue_tile(problem.config)
    dtypes = [o.dtype for o in problem.ir.outputs if not o.reduce] + \
        [problem.ir.operands[i].dtype for i in tile_operand_indices(problem.ir)]
    total = sum(round_up(epi_m * epi_n * bits(d) // 8 * EPI_STAGES, SMEM_ALIGN) for d in dtypes)
    if problem.groups:  # the grouped walk's table: two int32 per group and two more entries
        total += round_up(8 * (problem.groups + 2), SMEM_ALIGN)
    total += sum(round_up(4 * reduction_smem_floats(o.over, (epi_m, epi_n), threads), SMEM_ALIGN)
                 for o in problem.ir.outputs if o.reduce)
    return total + sum(round_up(4 * reduction_smem_floats(("n",), (epi_m, epi_n), threads), SMEM_ALIGN)
                       for _ in problem.ir.reductions)


def tile_operand_indices(ir: EpilogueIR) -> tuple[int, ...]:
    """Operands of role TILE that some output uses: the kernel TMA-loads those into smem."""
    return tuple(i for i, inp in enumerate(ir.operands) if inp.role is Role.TILE and ir.uses(i + ir.n_acc))


def reduction_positions(over: tuple[str, ...], epi_tile: tuple[int, int]) -> int:
    """Values a subtile's reduction ``over`` these axes keeps apart: its columns over M, its
    rows over N, one over both."""
    epi_m, epi_n = epi_tile
    return {("m",): epi_n, ("n",): epi_m}.get(tuple(over), 1)


def reduction_smem_floats(over: tuple[str, ...], epi_tile: tuple[int, int], threads: int) -> int:
    """fp32 values of shared memory a reducing output's buffer takes (``kernels/reduction.py``):
    one partial per position and warp."""
    return reduction_positions(over, epi_tile) * (threads // WARP)
