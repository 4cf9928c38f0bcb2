"""Blackwell (sm_100a): the limits of the kernel in ``sm100.py`` and its tile heuristic. No
cutlass import (see :mod:`jax_efc.kernels.policy`).

No Blackwell GPU has run this kernel: it compiles, and its instructions, registers and spills
are checked (``tests/test_kernel_compile_sm100.py``), so every kernel is checked on first use
(``jax_efc.self_check``); ``JAX_EFC_SM100=0`` turns the kernel off altogether. The
heuristic's constants follow from the hardware's sizes (shared and tensor memory, SMs), not
from timings on a B200; ``docs/performance.md`` has the speed model behind them.
"""

from __future__ import annotations

import dataclasses
import os

from jax_efc.config import GemmConfig
from jax_efc.kernels.dtypes import FP8, INT8, bits
from jax_efc.kernels.policy import ArchPolicy
from jax_efc.kernels.problem import (SMEM_ALIGN, KernelProblem, cta_tile, epilogue_smem_bytes, epilogue_tile,
                                     tile_operand_indices)
from jax_efc.kernels.sm90_policy import Sm90Policy

__all__ = ["POLICY", "Sm100Policy", "DEFAULT_SM_COUNT", "EPI_THREADS", "ACC_STAGES", "epilogue_blocks",
           "pipeline_stages", "tmem_columns"]

# SMs of a B200: what the heuristic and the persistent grid assume when compiling without a GPU
DEFAULT_SM_COUNT = 148

# float32 inputs run as TF32 (tcgen05 kind::tf32), where the call's precision allows it (the plan)
_AB_DTYPES = ("bfloat16", "float16", "float32", *FP8, *INT8)
# A tcgen05 MMA covers 64 or 128 rows issued by one CTA, or 128 or 256 rows issued for a pair of
# CTAs (each holding half of them); N from 32 to 256 in steps of 32, which every input type and
# major takes (an 8-bit MN-major B in a 2-CTA MMA needs multiples of 32) and the default 32-wide
# epilogue subtiles divide
_TILE_M_1CTA = (64, 128)
_TILE_M_2CTA = (128, 256)
_TILE_N = tuple(range(32, 257, 32))
# Blackwell clusters hold up to 16 CTAs (more than 8 are "non-portable", which the DSL's
# launch allows); powers of two along each side, so the multicast masks split evenly
_CLUSTER_SIDES = (1, 2, 4, 8, 16)
_MAX_CLUSTER = 16
# shared memory a CTA may opt into on SM100 (227 KiB of the SM's 228), and the A/B ring's depth
# cap, Hopper's (GemmConfig.stages takes 2 to 8): only tiles of at most 128x128 per CTA reach it
_SMEM_BYTES = 232448
_MAX_STAGES = 8
# tensor memory: 512 columns of 32 bits by 128 lanes per SM. Each accumulator buffer takes
# tile_n columns (a 32-bit accumulator a column per lane: 128 rows, or a 2-CTA tile's 128 rows
# in each CTA; tmem_columns); two buffers let tile i's epilogue read one while tile i+1's MMAs
# fill the other
TMEM_COLUMNS = 512
ACC_STAGES = 2
# the epilogue warps: four, one per TMEM lane quarter (warp w may read lanes 32(w%4)..+31), so
# together they reach all 128 lanes
EPI_THREADS = 128
# a TMA copy's rows are whole multiples of 16 bytes: the least a column block of a split subtile
# (epilogue_blocks) may hold of each stored output and TILE operand
_TMA_ROW_BYTES = 16
# the heuristic takes a tile shape once its tiles fill this share of one round of the SMs
_ONE_WAVE = 0.9
# 2-CTA 256x256 tiles read half the shared memory per multiply-add that 256x128 ones do (the
# speed model in docs/performance.md: 50% of the SM's 128 B/cycle against 75%), which the
# heuristic reckons worth at most this much worse a fill of the SM pairs' rounds (a modelled
# trade, not a measured one: 4096^3 fills 86% of 4 rounds in 256x256 tiles, 99% of 7 in 256x128)
_FILL_SLACK = 0.05
# ...and keeps at least this many A/B stages: a 16-bit k-tile of a 128x256 CTA tile takes the MMA
# about 512 SM cycles (2*128*256*64 flops at 8192 dense bf16 flops a cycle), so 4 stages keep 3
# k-tiles, about 1.5k cycles, ahead of it: about a load's latency from HBM (~1 us at ~1.4 GHz)
_MIN_STAGES = 4
# tiles the autotuner tries besides the heuristic's (tile_m, tile_n, use_2cta, cluster_m,
# cluster_n), and how many configs it times at most
_TUNED_TILES = ((256, 256, True, 2, 1), (256, 128, True, 2, 1), (128, 256, False, 2, 1),
                (128, 256, True, 2, 1), (128, 128, False, 2, 1), (256, 256, True, 4, 1),
                (128, 256, False, 1, 1))
_AUTOTUNE_CANDIDATES = 6


def epilogue_blocks(config: GemmConfig) -> int:
    """Column blocks an epilogue subtile spans: two with a 2-CTA 128-row MMA, which leaves each
    CTA's 64 rows in tensor memory as the first half of the columns in lanes 0-63 and the second
    half in lanes 64-127 (``sm100.py``); else one."""
    return 2 if config.use_2cta and config.tile_m == 128 else 1


def tmem_columns(problem: KernelProblem) -> int:
    """Tensor-memory columns the kernel allocates for its ``ACC_STAGES`` accumulator buffers: a
    CTA's 128-row accumulator takes ``tile_n`` columns (one lane a row), a 64-row one half as many
    (its rows fill the lanes twice over); allocations are powers of two, at least 32."""
    rows, cols = cta_tile(problem.config)
    need = ACC_STAGES * cols * rows // 128
    return max(32, 1 << (need - 1).bit_length())


def pipeline_stages(problem: KernelProblem) -> int:
    """A/B shared-memory pipeline depth of ``problem``'s kernel: ``config.stages`` or as many
    as fit next to the epilogue buffers (two per output and per TILE operand). A 2-CTA MMA
    splits its B tile between the pair: each CTA stages tile_m / 2 rows of A and tile_n / 2
    columns of B a k-tile."""
    cfg = problem.config
    rows, cols = cta_tile(cfg)
    b_cols = cols // 2 if cfg.use_2cta else cols
    ab_bytes = (rows * bits(problem.ab_dtype) + b_cols * bits(problem.b_dtype)) * problem.tile_k // 8
    epi_bytes = epilogue_smem_bytes(problem, EPI_THREADS)
    # every buffer is a whole number of 1 KiB blocks; the mbarriers (A/B ring, accumulators,
    # TILE operands) and the TMEM address take well under the 2 KiB kept back
    fit = (_SMEM_BYTES - epi_bytes - 2 * SMEM_ALIGN) // ab_bytes
    return min(cfg.stages or _MAX_STAGES, fit)


def _tiles(m: int, n: int, l: int, tm: int, tn: int) -> int:
    """MMA tiles of tm x tn in an M x N x L result."""
    return -(-m // tm) * -(-n // tn) * l


def _switched_off() -> bool:
    return os.environ.get("JAX_EFC_SM100", "1").strip() == "0"


class Sm100Policy(ArchPolicy):
    """Blackwell's kernel (:class:`~jax_efc.kernels.sm100.Sm100FusedGemm`): tcgen05 MMAs into
    tensor memory, 1-CTA and 2-CTA tiles, 16-bit, 8-bit and TF32 inputs."""

    arch = "sm_100a"
    kernel = "jax_efc.kernels.sm100:Sm100FusedGemm"
    default_sm_count = DEFAULT_SM_COUNT
    ab_dtypes = _AB_DTYPES
    acc_dtypes = ("float32", "float16", "int32")
    # compiled, never run: every kernel is checked on first use
    unverified_ab_dtypes = _AB_DTYPES
    # consumed row reductions: compiled and spill-free (the walks' operand coordinates opaque,
    # sm100.py), never run
    row_stats_kernel = True
    row_tile_ns = _TILE_N
    # GEMMs XLA's GEMM runs faster: Hopper's measured limits, not yet measured on Blackwell, where
    # the same causes hold (a B-bound GEMM streams B through the SMs its tiles occupy; too few
    # tiles leave SMs idle)
    xla_rows = Sm90Policy.xla_rows
    xla_fill = Sm90Policy.xla_fill

    def runs_by_default(self) -> bool:
        return not _switched_off() and super().runs_by_default()

    def unsupported_reason(self, problem: KernelProblem,
                           mnkl: tuple[int, int, int, int] | None = None) -> str | None:
        if _switched_off():
            return "JAX_EFC_SM100=0 turns the sm_100a kernel off, so XLA runs the call; unset it to run the kernel."
        return super().unsupported_reason(problem, mnkl)

    def accumulator_reason(self, problem: KernelProblem) -> str | None:
        a = problem.ab_dtype
        if problem.acc_dtype == "float16" and a != "float16":
            return f"float16 accumulation takes float16 inputs, not {a}; use float32."
        if (problem.acc_dtype == "int32") != (a in INT8):
            return f"{a} inputs accumulate in {'int32' if a in INT8 else 'float32'}."
        # (8-bit float partial sums need no promotion: tcgen05 kind::f8f6f4 accumulates them in
        # fp32 tensor memory, and CUTLASS's SM100 FP8 GEMMs add none; `promote` changes nothing)
        return None

    def splits_k(self, problem: KernelProblem) -> bool:
        # Stream-K is not built for this kernel: every tile is computed whole by one CTA (pair)
        return False

    def config_reason(self, config: GemmConfig) -> str | None:
        if config.pingpong:
            return ("pingpong=True is Hopper's schedule; on SM100 the epilogue warps always overlap the "
                    "next tile's MMAs through two tensor-memory accumulators (use pingpong=False).")
        rows, _ = cta_tile(config)
        if config.use_2cta:
            if config.tile_m not in _TILE_M_2CTA:
                return (f"tile_m={config.tile_m} with use_2cta=True is not supported on SM100; a 2-CTA "
                        f"tcgen05 MMA covers {' or '.join(map(str, _TILE_M_2CTA))} rows here.")
        elif config.tile_m not in _TILE_M_1CTA:
            hint = " (or use_2cta=True in clusters with an even cluster_m)" if config.tile_m == 256 else ""
            return (f"tile_m={config.tile_m} is not supported on SM100; a 1-CTA tcgen05 MMA covers "
                    f"{' or '.join(map(str, _TILE_M_1CTA))} rows{hint}.")
        if config.tile_n not in _TILE_N:
            return f"tile_n={config.tile_n} is not supported on SM100; use a multiple of 32 from 32 to 256."
        for name in ("cluster_m", "cluster_n"):
            v = getattr(config, name)
            if v not in _CLUSTER_SIDES:
                return f"{name}={v} must be a power of two up to 16 on SM100."
        if config.cluster_m * config.cluster_n > _MAX_CLUSTER:
            return (f"cluster {config.cluster_m}x{config.cluster_n} has more than {_MAX_CLUSTER} CTAs, "
                    "the most an SM100 cluster holds.")
        if config.epi_m not in (0, rows):
            return (f"epi_m={config.epi_m}: on SM100 each epilogue subtile spans the CTA tile's {rows} rows "
                    "(each of the four epilogue warps reads its quarter of the tensor-memory lanes); use "
                    "epi_m=0.")
        return None

    def resources_reason(self, problem: KernelProblem) -> str | None:
        cfg = problem.config
        if tmem_columns(problem) > TMEM_COLUMNS:
            return (f"tile_n={cfg.tile_n}: {ACC_STAGES} accumulator buffers need {tmem_columns(problem)} "
                    f"tensor-memory columns, more than the {TMEM_COLUMNS} an SM has.")
        transposed = [o.name for o in problem.ir.outputs if o.transposed]
        if epilogue_blocks(cfg) > 1 and transposed:
            return (f"output {transposed[0]!r} is stored transposed, which a 2-CTA 128-row tile (its subtiles "
                    "split in two column blocks) does not do; use tile_m=256 or a 1-CTA tile.")
        run = cfg.epi_n // epilogue_blocks(cfg)
        staged = [o.dtype for o in problem.ir.outputs if not o.reduce] + \
            [problem.ir.operands[i].dtype for i in tile_operand_indices(problem.ir)]
        narrow = [d for d in staged if run * bits(d) // 8 < _TMA_ROW_BYTES]
        if narrow:
            return (f"epi_n={cfg.epi_n} with a 2-CTA 128-row tile: each subtile is two column blocks of {run} "
                    f"{narrow[0]} values, fewer than the {_TMA_ROW_BYTES} bytes a TMA copy's row takes; use "
                    f"epi_n={2 * _TMA_ROW_BYTES * 8 // bits(narrow[0])} or more.")
        if pipeline_stages(problem) >= 2:
            return None
        epi_m, epi_n = epilogue_tile(cfg)
        return (f"tile {cfg.tile_m}x{cfg.tile_n} with {epi_m}x{epi_n} epilogue subtiles, "
                f"{sum(not o.reduce for o in problem.ir.outputs)} outputs and "
                f"{len(tile_operand_indices(problem.ir))} tile operands leaves too little shared memory "
                "for 2 A/B pipeline stages; use a smaller tile or epi_n=16.")

    def choose_config(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                      sm_count: int = DEFAULT_SM_COUNT) -> GemmConfig:
        """A tile and cluster shape for an M x N x K x L GEMM on a GPU with ``sm_count`` SMs.

        - 2-CTA 256x256 tiles in 2x1 clusters where they fill one round of the SM pairs
          (``_ONE_WAVE``) and the pairs' rounds about as well as 256x128 tiles (``_FILL_SLACK``):
          each CTA holds a 128x256 accumulator (256 TMEM columns, two buffers fill all 512) and
          stages only half of B, 32 KiB a 16-bit k-tile against 48 KiB for a 1-CTA 128x256
          tile: the most multiply-adds per byte of shared memory read, and 6 stages beside one
          16-bit output.
        - Else, with more than 128 rows, 2-CTA 256x128 tiles in 2x1 clusters: their CTA tiles
          are 128x128, so they fill the SMs as 1-CTA 128x128 tiles do, while each CTA stages
          half of B (24 KiB a k-tile against 32 KiB).
        - At most 128 rows: 1-CTA 128x256 tiles where they fill a round of the SMs; else, with
          more than 64 rows and 128 columns, 2-CTA 128x256 tiles in 2x1 clusters: as many CTA
          tiles (64x256) as 1-CTA 128x128 ones, staging 24 KiB a 16-bit k-tile against 32 KiB
          (a 2-CTA 128-row MMA fills all 128 TMEM lanes of each SM, PTX's data-path layout B,
          where a 1-CTA 64-row one fills half); else 128x128 (64x128 for at most 64 rows).
        Each keeps ``_MIN_STAGES`` A/B stages, in 16-wide epilogue subtiles where 32-wide ones
        leave fewer. Problems with two rounds of tiles or more walk bands of 8 clusters (L2 reuse).
        """
        def tiles(tm: int, tn: int) -> int:
            return _tiles(m, n, l, tm, tn)

        def shaped(tm: int, tn: int, use_2cta: bool, slots: int) -> GemmConfig:
            """The tile in 2x1 clusters (a 2-CTA pair) or alone, walked in bands where it has two
            rounds of the ``slots`` that run at once; with the widest subtile that keeps
            ``_MIN_STAGES`` (else 16-wide ones)."""
            cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=2 if use_2cta else 1, use_2cta=use_2cta,
                             swizzle=8 if tiles(tm, tn) >= 2 * slots else 1)
            if pipeline_stages(dataclasses.replace(problem, config=cfg)) >= _MIN_STAGES:
                return cfg
            return dataclasses.replace(cfg, epi_n=16)

        def fill(tm: int, tn: int, slots: int) -> float:
            """Useful share of the work when tm x tn tiles run in rounds of ``slots``: the edge
            tiles' padding and the last round's idle slots count as waste."""
            return m * n * l / (tm * tn * slots * -(-tiles(tm, tn) // slots))

        pairs = sm_count // 2
        if (n > 128 and tiles(256, 256) >= _ONE_WAVE * pairs
                and fill(256, 256, pairs) >= fill(256, 128, pairs) - _FILL_SLACK):
            return shaped(256, 256, True, pairs)
        if m > 128:
            return shaped(256, 128, True, pairs)
        if n > 128 and tiles(128, 256) >= _ONE_WAVE * sm_count:
            return shaped(128, 256, False, sm_count)
        if m > 64 and n > 128:
            pair = shaped(128, 256, True, pairs)
            # (its split subtiles refuse transposed outputs and narrow 8-bit column blocks)
            if self.unsupported_reason(dataclasses.replace(problem, config=pair), (m, n, k, l)) is None:
                return pair
        return shaped(64 if m <= 64 else 128, 128, False, sm_count)

    def candidate_configs(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                          sm_count: int = DEFAULT_SM_COUNT) -> list[GemmConfig]:
        """The heuristic's config, then the other tiles of ``_TUNED_TILES`` the kernel can run, at
        most ``_AUTOTUNE_CANDIDATES``."""
        best = self.choose_config(problem, m, n, k, l, sm_count)
        found = [best]
        for tm, tn, use_2cta, cm, cn in _TUNED_TILES:
            cfg = dataclasses.replace(best, tile_m=tm, tile_n=tn, use_2cta=use_2cta, cluster_m=cm, cluster_n=cn)
            if cfg not in found and self.unsupported_reason(dataclasses.replace(problem, config=cfg),
                                                            (m, n, k, l)) is None:
                found.append(cfg)
        return found[:_AUTOTUNE_CANDIDATES]


POLICY = Sm100Policy()


def _for(arch: str) -> Sm100Policy:
    """The same kernel and limits built for ``arch``: the B300's sm_103a (the same tensor-core
    instructions, shared and tensor memory as the B200's), or the 10.x family target sm_100f (one
    build for both, for an export that must run on either)."""
    return type(f"Sm100Policy_{arch}", (Sm100Policy,), {"arch": arch})()


POLICY_SM103 = _for("sm_103a")
POLICY_FAMILY = _for("sm_100f")
