"""Hopper (sm_90a): the limits of the kernel in ``sm90.py`` and the H200 tile heuristic. No
cutlass import (see :mod:`jax_efc.kernels.policy`)."""

from __future__ import annotations

import dataclasses
import functools

from jax_efc.config import GemmConfig
from jax_efc.kernels.dtypes import FP8, INT8, bits
from jax_efc.kernels.policy import ArchPolicy, unverified_allowed
from jax_efc.kernels.problem import (SMEM_ALIGN, KernelProblem, epilogue_smem_bytes, epilogue_tile,
                                     tile_operand_indices)

__all__ = ["POLICY", "Sm90Policy", "DEFAULT_SM_COUNT", "mma_warpgroups", "pipeline_stages"]

# SMs of an H100/H200 SXM: what the heuristic and the persistent grid assume when compiling
# without a GPU (with one, the device's own count is used)
DEFAULT_SM_COUNT = 132

# float32 inputs multiply as TF32 (kernels/sm90_tf32.py), where JAX's precision rules allow it
_AB_DTYPES = ("bfloat16", "float16", *FP8, *INT8, "float32")
_TILE_M = (64, 128, 192, 256)
_TILE_N = (64, 128, 192, 256)
# SM90 clusters: up to 8 CTAs are portable (schedulable on every SM90 part), but the
# multicast benefit flattens past 2; we allow at most 4 CTAs, 1, 2 or 4 along each side (the
# compile tests build 1x1, 2x1, 1x2 and 2x2).
_MAX_CLUSTER = 4
# shared-memory budget (bytes per CTA on SM90, opt-in)
_SMEM_BYTES = 232448
_MAX_STAGES = 8
# a consumer warpgroup (128 threads) covers at most two 64-row WGMMA blocks of a cooperative
# tile, or a whole ping-pong tile; up to 192 fp32 accumulators per thread (192x128 or 128x192
# ping-pong tiles) leave the epilogue's temporaries room in the 232-register budget (ptxas:
# no spills for bias+gelu_tanh or bias+silu, 24 bytes for the erf GELU's longer chain); 256
# would not
_WG = 128
_ACC_PER_THREAD = 192
# a tile count that fills this fraction of the SMs counts as one full wave
_ONE_WAVE = 0.9
# a promoting 128x192 tile may pad N this much more than a 128x128 one (see _promoting_config)
_PROMOTING_PAD_SLACK = 0.04
# fills of two tile shapes closer than this count as equal
_FILL_TIE = 1e-6
# a larger ping-pong tile is taken where it fills the SMs' rounds at most this much worse than
# the tile it replaces
_FILL_SLACK = 0.01
# ring stages a cooperative 128x256 tile keeps at least: its epilogue buffers may cost no more
_WIDE_TILE_STAGES = 3
# ring stages a ping-pong tile keeps at least (a 128x128 tile of 8192x4096x4096 took 32.9k SM
# cycles with 6, 33.2k with 5 and 37.0k with 4; see the epilogue subtiles in choose_config)
_PINGPONG_STAGES = 5
# GEMMs that XLA's GEMM runs faster than the kernel: short ones (decode steps, small batches)
# and those with too few tiles to fill the SMs. With M rows per B a GEMM does about M flops per
# byte of B it reads, under the H200's ridge of about 200 (989 TFLOP/s over 4.8 TB/s) when M is
# small: its time is the time to stream B. XLA's GEMMs for it split K over the SMs. The kernel
# streams B only through the SMs its tiles occupy, and spends 64-row WGMMAs on fewer rows.
# Measured on H200 (16 calls inside one jit, each on its own x and weights, so B streams from
# HBM: `bench --calls-per-jit 16`; ratio to XLA's time, bias+gelu_tanh / alpha-beta at N x K =
# 4096x4096, 14336x4096 and 4096x14336), the kernel's 128x128 tiles against the reference
# lowering (one dot with fp32 output, then the epilogue in XLA):
# - M = 8 and 64: the kernel 0.36-0.88 at all six shapes, the reference 0.95-1.04;
# - M = 128 and 256, where 128x128 tiles fill at most half the SMs (N = 4096): the kernel
#   0.47-0.86, the reference 0.84-1.03;
# - M = 128 and 256 at N = 14336 (112 and 224 tiles on 132 SMs): the kernel 1.00-1.04, the
#   reference 0.85-0.96;
# - M = 512: the kernel 0.97-1.08.
# More rows in fewer tiles lose too (plain GEMM / bias+gelu_tanh, the kernel's 128x128 tiles
# with the k-iterations split over all SMs where that is faster): 0.69 / 0.67 at
# 1024x512x8192 (32 tiles), 0.63 / 0.62 at 768x1024x14336 (48), 0.78 / 0.74 at 1024x1024x8192
# (64), 0.75 / 0.72 at 512x2048x4096 (64), 0.96 / 0.95 at 1024x1536x4096 (96, whole tiles).
# Split in clusters that multicast A or B (2x1, 1x2, 2x2) or in 128x256 tiles, bias+gelu_tanh
# reached at best 0.88 (1x2 at 1024x1024x8192), 0.84 at 128x4096x14336 and 0.73 at 1024x512x8192.
_XLA_ALWAYS_ROWS = 64  # at most this many rows per B: XLA's GEMM, however many tiles
_XLA_FILL = 0.75  # more: XLA's GEMM when 128x128 tiles fill less of the SMs than this
# K from which plain GEMMs and light epilogues take cooperative 128x256 tiles when those
# fill the SMs as well as ping-pong ones (192 k-tiles); a plain GEMM with A stored (K, M), as
# a weight gradient reads it, from 8192 (see _tile_choice)
_LONG_K = 12288
_LONG_K_M_MAJOR_A = 8192
# a plain GEMM with A stored (K, M) under that K takes a 192-wide ping-pong tile where it fills
# the SMs' rounds at most this much worse than 128x128 (see _tile_choice)
_FILL_SLACK_M_MAJOR_A = 0.03
# a gated GEMM takes 192x128 ping-pong tiles where they fill the SMs' rounds at most this much
# worse than 128x128 (see _tile_choice)
_GATED_FILL_SLACK = 0.04


def mma_warpgroups(config: GemmConfig) -> int:
    """Consumer warpgroups that share one tile's WGMMAs and epilogue: a ping-pong consumer
    covers its whole tile, cooperative ones 64 rows each up to two (a 256-row tile gives each
    two 64-row blocks)."""
    return 1 if config.pingpong else min(config.tile_m // 64, 2)



def pipeline_stages(problem: KernelProblem) -> int:
    """A/B shared-memory pipeline depth of ``problem``'s kernel: ``config.stages`` or as many
    as fit next to the epilogue buffers (two per output and per TILE operand; the ping-pong
    consumers take turns with one set)."""
    cfg = problem.config
    ab_bytes = (cfg.tile_m * bits(problem.ab_dtype) + cfg.tile_n * bits(problem.b_dtype)) * problem.tile_k // 8
    epi_bytes = epilogue_smem_bytes(problem, _WG * mma_warpgroups(cfg))
    # every buffer is a whole number of 1 KiB blocks; the mbarrier arrays (pipeline and
    # TILE-operand barriers, well under 1 KiB) cost at most the padding to the next block each
    fit = (_SMEM_BYTES - epi_bytes - 2 * SMEM_ALIGN) // ab_bytes
    return min(cfg.stages or _MAX_STAGES, fit)


def stages_in(problem: KernelProblem, config: GemmConfig) -> int:
    """:func:`pipeline_stages` of ``problem`` run in ``config``: what the heuristic weighs."""
    return pipeline_stages(dataclasses.replace(problem, config=config))


# (tile_m, tile_n, pingpong, cluster_m, cluster_n) an autotuner tries besides the heuristic's
# choice (each tile with the cluster the heuristic pairs it with), and how many configs it times
# at most (each one more kernel to compile at first use)
_TUNED_TILES = ((192, 128, True, 1, 2), (128, 192, True, 2, 1), (128, 128, True, 1, 2), (128, 256, False, 2, 1),
                (256, 128, False, 1, 2), (128, 128, False, 2, 1))
_AUTOTUNE_CANDIDATES = 6


def _tiles(m: int, n: int, l: int, tm: int, tn: int) -> int:
    """Output tiles of tm x tn in an M x N x L result."""
    return -(-m // tm) * -(-n // tn) * l



class Sm90Policy(ArchPolicy):
    """Hopper's kernel (:class:`~jax_efc.kernels.sm90.Sm90FusedGemm`): 16-bit, 8-bit and TF32 inputs,
    warp-specialized cooperative and ping-pong schedules."""

    arch = "sm_90a"
    kernel = "jax_efc.kernels.sm90:Sm90FusedGemm"
    default_sm_count = DEFAULT_SM_COUNT
    ab_dtypes = _AB_DTYPES
    # fp16 accumulation (fp16 inputs only) halves the accumulators' registers
    acc_dtypes = ("float32", "float16", "int32")
    xla_rows = _XLA_ALWAYS_ROWS
    xla_fill = _XLA_FILL
    # ran against the float64 oracle (tests/test_gpu_reductions.py: every reduction kind over
    # partial tiles, clusters, both schedules, stream-K, a batch, NaN, poisoned partials), the
    # register fold on an H200
    verified_reductions = True
    # ran over donated operands on an H100 (tests/test_inplace.py), both schedules
    verified_inplace = True
    # ran against the float64 oracle on an H100: masked in-place stores (tests/test_masked_stores.py)
    # and transposed outputs (tests/test_transposed.py), both schedules, partial tiles, stream-K
    verified_masked_stores = True
    verified_transposed_outputs = True
    # ran against the float64 oracle on an H100: reductions folded by atomics
    # (tests/test_gpu_atomic_reductions.py) and gated GEMMs (tests/test_gpu_gated.py, on an
    # H200 too), both schedules, partial tiles, stream-K
    verified_atomic_reductions = True
    gated_kernel = True
    verified_gated = True
    # grouped GEMMs ran against the float64 oracle on an H100 (tests/test_gpu_grouped.py and
    # tests/test_fuzz_grouped.py): balanced, skewed and empty groups, partial tiles at every group
    # edge, rows past the groups, poisoned outputs, four configs, the lhs gradient; and the
    # weight gradient's walk, groups of the contraction (six group patterns with NaN past the
    # groups and cut k-tiles, four configs, the ping-pong look-ahead past the last unit)
    grouped_kernel = True
    verified_grouped = True
    verified_grouped_k = True
    # cooperative 256x128 tiles for grouped GEMMs (_grouped_tall_config) ran against the float64
    # oracle on an H100 (tests/test_gpu_grouped.py, "cooperative_256x128_c1x2": balanced,
    # skewed and empty groups, groups smaller than a tile, partial tiles at group edges, rows
    # past the groups)
    verified_grouped_tall = True
    # ran against the float64 oracle on an H200 (tests/test_gpu_row_stats.py: a row softmax, norm
    # and log-sum-exp at once over partial tiles, both schedules, clusters, stream-K, a batch, NaN
    # and infinite inputs, a transposed output)
    row_stats_kernel = True
    row_tile_ns = _TILE_N
    verified_row_stats = True
    # 8-bit float partial sums promoted every two k-tiles (256 deep) rather than each: on an H100
    # the fused 8-bit epilogues ran 5-7% faster in one process each (plain GEMMs' gain was not
    # steady across runs), at a relative error of 2.1e-4 against 1.3e-4 at K = 16384 (XLA's
    # promoting dot 1.3e-4, its default dot 2.1e-3-3.1e-3); its GPU tests passed there
    # (benchmarks/FINDINGS.md, fourteenth and fifteenth sittings). With a cooperative tile's
    # warpgroups promoting at alternate k-tiles, in the same rounds as both promoting at the same
    # ones, they ran up to 7% faster still (5 of 6 problems) and 8192^3 to fp32 4% ("Sixteenth
    # sitting")
    promotion_k_tiles = 2
    verified_promotion_k_tiles = True

    def accumulator_reason(self, problem: KernelProblem) -> str | None:
        if problem.acc_dtype == "float16" and problem.ab_dtype != "float16":
            return f"float16 accumulation takes float16 inputs, not {problem.ab_dtype}; use float32."
        if problem.promote and problem.ab_dtype not in FP8:
            return f"partial-sum promotion is for 8-bit float inputs, not {problem.ab_dtype}."
        if (problem.acc_dtype == "int32") != (problem.ab_dtype in INT8):
            return f"{problem.ab_dtype} inputs accumulate in {'int32' if problem.ab_dtype in INT8 else 'float32'}."
        return None

    def mma_majors(self, problem: KernelProblem) -> tuple[str, str] | None:
        # WGMMA reads 8-bit and TF32 A and B from shared memory K-major only (16-bit ones either way)
        return None if bits(problem.ab_dtype) == 16 else ("k", "k")

    def config_reason(self, config: GemmConfig) -> str | None:
        if config.use_2cta:
            return ("use_2cta=True asks for Blackwell's 2-CTA MMA (tcgen05), which SM90 does not have; "
                    "use use_2cta=False (a cluster along M multicasts B instead).")
        if config.tile_m not in _TILE_M:
            return (f"tile_m={config.tile_m} is not supported on SM90; use one of {_TILE_M} "
                    "(a WGMMA covers 64 rows; a warpgroup issues one to three of them per k-step).")
        if config.tile_m == 192 and not config.pingpong:
            return ("tile_m=192 needs pingpong=True (one warpgroup runs the tile's three 64-row "
                    "WGMMAs); the cooperative schedule takes tile_m 64, 128 or 256.")
        if config.tile_m == 256 and config.pingpong:
            return ("tile_m=256 needs pingpong=False (two cooperating warpgroups of 128 rows "
                    "each); ping-pong tiles have at most 192 rows.")
        if config.tile_n not in _TILE_N:
            return f"tile_n={config.tile_n} is not supported on SM90; use one of {_TILE_N}."
        for name in ("cluster_m", "cluster_n"):
            v = getattr(config, name)
            if v not in (1, 2, 4):
                return f"{name}={v} must be 1, 2 or 4 (a power of two)."
        if config.cluster_m * config.cluster_n > _MAX_CLUSTER:
            return (f"cluster {config.cluster_m}x{config.cluster_n} has more than {_MAX_CLUSTER} "
                    "CTAs; SM90 clusters in jax_efc are at most 4 CTAs (e.g. 2x1, 1x2, 2x2).")
        if config.epi_m % (64 * mma_warpgroups(config)):
            return (f"epi_m={config.epi_m} with a cooperative {config.tile_m}-row tile: each epilogue "
                    f"subtile must span the rows of all {mma_warpgroups(config)} warpgroups that share "
                    f"the tile, a multiple of {64 * mma_warpgroups(config)} rows; use epi_m=0 (the "
                    "tile's height) or pingpong=True.")
        if config.tile_m * config.tile_n > _ACC_PER_THREAD * _WG * mma_warpgroups(config):
            if config.pingpong:
                return (f"pingpong=True with a {config.tile_m}x{config.tile_n} tile: one ping-pong "
                        f"warpgroup holds the whole tile's fp32 accumulators, at most {_ACC_PER_THREAD} "
                        "per thread; use 128x128, 192x128, 128x192 or 64x256 (or pingpong=False for "
                        "the cooperative schedule, where two warpgroups share a tile).")
            return (f"a cooperative {config.tile_m}x{config.tile_n} tile needs more than "
                    f"{_ACC_PER_THREAD} fp32 accumulators per thread; use 256x128, 128x256 or "
                    "a smaller tile.")
        return None

    def resources_reason(self, problem: KernelProblem) -> str | None:
        cfg = problem.config
        held = 2 * cfg.tile_m * cfg.tile_n // (_WG * mma_warpgroups(cfg))
        if problem.promote and held > _ACC_PER_THREAD:
            return (f"{'ping-pong' if cfg.pingpong else 'cooperative'} {cfg.tile_m}x{cfg.tile_n} tiles of "
                    f"{problem.ab_dtype} inputs: promoting partial sums into fp32 holds two accumulators an "
                    f"element, {held} registers a thread (at most {_ACC_PER_THREAD}); use cooperative "
                    "128x128 or 128x192 tiles, or precision=jax.lax.DotAlgorithmPreset."
                    "ANY_F8_ANY_F8_F32_FAST_ACCUM (no promotion).")
        if pipeline_stages(problem) >= 2:
            return None
        epi_m, epi_n = epilogue_tile(cfg)
        return (f"tile {cfg.tile_m}x{cfg.tile_n} with {epi_m}x{epi_n} epilogue subtiles, "
                f"{len(problem.ir.outputs)} outputs and {len(tile_operand_indices(problem.ir))} "
                "tile operands leaves too little shared memory for 2 A/B pipeline stages; use a "
                f"smaller tile or smaller subtiles (epi_m={64 * mma_warpgroups(cfg)}, epi_n=16).")

    def choose_config(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                      sm_count: int = DEFAULT_SM_COUNT) -> GemmConfig:
        """A tile and cluster shape for an M x N x K x L GEMM on a GPU with ``sm_count`` SMs.

        Large problems (two 128x128 tiles per SM, or 1.8 with K under 12288) run ping-pong tiles:
        one consumer's epilogue hides under the other's mainloop. Of 192x128 tiles in 1x2 clusters
        (each A tile multicast to the two CTAs along N), 128x192 ones in 2x1 clusters walked along
        N (each B tile multicast) and 128x128 ones in 1x2, a plain GEMM takes the first of 128x192,
        192x128, 128x128 that fills the SMs' rounds about as well as those after it, an epilogue
        with work the first of 192x128, 128x192, 128x128 (a gated one 192x128 from a looser
        fill). With a long K (>= 12288), plain GEMMs and epilogues with no TILE operand and at
        most 4 bytes of output an element (one fp32 or two 16-bit outputs) run cooperative
        128x256 tiles in 2x1 clusters instead where those fill the SMs as well (a plain GEMM with
        A stored (K, M) from K = 8192). When the epilogue's smem buffers would leave the ping-pong
        ring fewer than 5 stages even in its smallest subtiles (64x16), or the problem is smaller,
        the cooperative schedule runs: 128x256 tiles (two warpgroups, 128 fp32 accumulators per
        thread) when they (nearly) fill the SMs, else 128x128 (or 64x128 when even those leave
        most SMs idle), with a 2x1 cluster multicasting B when M spans several tiles. Wherever a
        cooperative tile's epilogue buffers leave it fewer than 3 stages, narrower subtiles and
        tiles buy them back (:meth:`_roomy`).
        A grouped GEMM takes cooperative 256x128 tiles in 1x2 clusters where those pad balanced
        groups no more than 128-row tiles and fill the SMs (:func:`_grouped_tall_config`).
        An epilogue that reads a TILE operand and folds column sums keeps 128x128 ping-pong tiles
        (beside 192 accumulators a thread it spilled).
        Large problems walk the tiles in bands of 8 clusters for L2 reuse. Epilogues that do work
        get 64x32 or 64x16 subtiles on ping-pong tiles where those buy the ring stages (192x128
        and 128x192 tiles qualify when some subtile leaves them 5), else 64-wide ones where the
        ring keeps enough stages (128x128 ping-pong, 128x256).
        """
        config = self.grouped_fit(problem, self.gated_fit(problem, self._tile_choice(problem, m, n, k, l, sm_count)))
        return self._roomy(problem, self.row_fit(problem, config, n), n)

    def row_tile(self, config: GemmConfig, tile_n: int) -> GemmConfig:
        # cooperative tiles of 128 rows hold rows of any width up to 256 (128 accumulators a thread
        # at 256, where a ping-pong warpgroup would hold 256)
        return dataclasses.replace(config, tile_m=128, tile_n=tile_n, pingpong=False, cluster_n=1,
                                   cluster_m=min(config.cluster_m, 2), epi_m=0, raster="m")

    def candidate_configs(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                          sm_count: int = DEFAULT_SM_COUNT) -> list[GemmConfig]:
        """The heuristic's config, then its tile and cluster swapped for the others the heuristic
        chooses among (``_TUNED_TILES``), those the kernel can run, at most
        ``_AUTOTUNE_CANDIDATES``."""
        best = self.choose_config(problem, m, n, k, l, sm_count)
        found = [best]
        for tm, tn, pingpong, cm, cn in _TUNED_TILES:
            # the heuristic's subtile height where it divides the tile, else the tile's
            epi_m = best.epi_m if best.epi_m and tm % best.epi_m == 0 else 0
            cfg = dataclasses.replace(best, tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn,
                                      pingpong=pingpong, epi_m=epi_m)
            if cfg not in found and self.unsupported_reason(dataclasses.replace(problem, config=cfg),
                                                            (m, n, k, l)) is None:
                found.append(cfg)
        return found[:_AUTOTUNE_CANDIDATES]

    def _tile_choice(self, problem: KernelProblem, m: int, n: int, k: int, l: int, sm_count: int) -> GemmConfig:
        sms = sm_count
        has_work = bool(problem.ir.instrs) or bool(problem.ir.operands)
        if problem.promote:
            return _promoting_config(m, n, l, sms, any(o.transposed for o in problem.ir.outputs))
        if k <= problem.tile_k and has_work:
            # One k-tile: the kernel is its epilogue, bound by memory. Cooperative tiles run both
            # consumer groups' epilogues at once (ping-pong ones take turns), and 128x256 tiles
            # in 128x32 subtiles keep the most TILE-operand bytes in flight: fp8_dense's gradient
            # pass (K = 16, 8192x14336, gelu's derivative) took 0.59 ms in them on the H200, 0.64
            # in 128x128 ones and 1.63 in ping-pong 192x128 ones in 64x16 subtiles
            # (benchmarks/FINDINGS.md, "The FP8 gradient pass").
            return GemmConfig(tile_m=128, tile_n=256)

        def tiles(tm: int, tn: int) -> int:
            return _tiles(m, n, l, tm, tn)

        stages_of = functools.partial(stages_in, problem)

        if problem.groups and not problem.ragged_k and (self.verified_grouped_tall or unverified_allowed()):
            tall = _grouped_tall_config(m, n, problem.groups, sms)
            if tall and stages_of(tall) >= _WIDE_TILE_STAGES:
                return tall

        def pingpong(tm: int, tn: int = 128) -> GemmConfig:
            """Ping-pong tm x 128 tiles in 1x2 clusters walked along M, or 128x192 ones in 2x1
            clusters walked along N, with the largest epilogue subtile (the tile's height by 32,
            64x32, 64x16) that leaves the ring its most stages. A plain GEMM keeps the tile-high
            subtile while the ring has _PINGPONG_STAGES: its fp32 output (TF32) left 128x192
            tiles 4 stages in 128x32 subtiles, 5 in 64x32, and so fell back to 128x128 tiles,
            which ran 8192^3 in 3.681 ms against 3.234 in 128x192 tiles of 64x32 subtiles (an
            H100; XLA 3.147: benchmarks/FINDINGS.md, "Ninth sitting")."""
            along_n = tn > 128
            cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=2 if along_n else 1, cluster_n=1 if along_n else 2,
                             raster="n" if along_n else "m", swizzle=8, pingpong=True)
            if not has_work and stages_of(cfg) >= _PINGPONG_STAGES:
                return cfg
            return max((cfg, dataclasses.replace(cfg, epi_m=64), dataclasses.replace(cfg, epi_m=64, epi_n=16)),
                       key=stages_of)

        def widened(cfg: GemmConfig, min_stages: int) -> GemmConfig:
            """``cfg`` with 64-wide epilogue subtiles (half the barriers and TMA stores) when the
            epilogue does work and the ring keeps ``min_stages`` stages."""
            wide = dataclasses.replace(cfg, epi_n=64)
            return wide if has_work and stages_of(wide) >= min_stages else cfg

        def fill(tm: int, tn: int) -> float:
            """Useful share of the work when tm x tn tiles run in rounds of one per SM: the edge
            tiles' padding and the last round's idle SMs count as waste."""
            return m * n * l / (tm * tn * sms * -(-tiles(tm, tn) // sms))

        # Ping-pong hides one consumer's epilogue under the other's mainloop: it beat cooperative
        # 128x256 tiles for every epilogue from two full waves of 128x128 tiles, or, with a K under
        # _LONG_K, from two of _ONE_WAVE (a CTA's first epilogue hides under its second mainloop
        # and the last one is half a 128x256 tile's). The ring's stages are counted in the subtile
        # ping-pong would take (alpha-beta with two fp32 outputs keeps 6 in 64x16 subtiles, 4 in
        # 128x32). Measurements: benchmarks/FINDINGS.md, "Tile shapes and epilogue subtiles".
        two_waves = 2 * sms if k >= _LONG_K else 2 * _ONE_WAVE * sms
        if (-(-m // 128) >= 8 and -(-n // 128) >= 2 and tiles(128, 128) >= two_waves
                and stages_of(pingpong(128)) >= _PINGPONG_STAGES):
            # 192x128 loads about a fifth less A/B per multiply-add from L2 than 128x128 (smem
            # reads per WGMMA stay the same); at the H200's 700 W cap the clock a kernel holds
            # depends on its work, so it runs faster unless its tiles fill the SMs' rounds more
            # than _FILL_SLACK worse or its smem leaves fewer stages. Cooperative 256x128 and
            # 64x256 ping-pong tiles were slower (benchmarks/FINDINGS.md, "Tile shapes and
            # epilogue subtiles").
            # Ping-pong tiles of more than 128x128 hold 192 accumulators a thread; beside them an
            # epilogue that reads a TILE operand and folds column sums spilled (ptxas, 192x128:
            # fused_mlp's GELU derivative and its bias gradient 464 bytes in 64x32 subtiles, its
            # gated derivative and two bias gradients 500 in 64x16; none at 128x128;
            # benchmarks/FINDINGS.md, "Tenth sitting"), so such epilogues keep 128x128.
            crowded = (bool(tile_operand_indices(problem.ir))
                       and any(o.reduce and "m" in o.over for o in problem.ir.outputs))
            # A gated epilogue loses more in 128x128 tiles: at 4096x14336x4096 (2N = 28672) 192x128
            # tiles fill the rounds 0.953 against 0.987, yet ran 1.427 ms against 1.691 on an H100
            # (XLA's two GEMMs 1.575; benchmarks/FINDINGS.md, "Eighteenth sitting").
            tall = pingpong(192)
            slack = _GATED_FILL_SLACK if problem.ir.gated else _FILL_SLACK
            fits_tall = (not crowded and stages_of(tall) >= _PINGPONG_STAGES
                         and fill(192, 128) >= fill(128, 128) - slack)
            tm = 192 if fits_tall else 128
            # A plain GEMM with a long K has little epilogue to hide: a 128x128 tile's takes
            # about 2k SM cycles against 115k of WGMMA at K = 14336. There cooperative 128x256
            # tiles in 2x1 clusters, which read a sixth less smem and a third less L2 per
            # multiply-add, win where they fill the SMs' rounds as well; so do epilogues that read
            # only vectors and write at most 4 bytes an element, exposed. Alpha-beta's TILE
            # operands and two outputs keep ping-pong, which hides them.
            # A plain GEMM with A stored (K, M) (a weight gradient's x^T) loses more in ping-pong
            # tiles, so takes 128x256 from a shorter K: at K = 8192 on an H100, 128x128 ran
            # 4096x14336 in 1.656 ms against 1.396 in 128x256 (XLA 1.363), 14336x4096 in 1.572
            # against 1.503 and 4096x4096 in 0.417 against 0.391; at K = 4096 (14336x4096) 0.761
            # against 0.782 (benchmarks/FINDINGS.md, "Eleventh sitting").
            out_bits = sum(bits(o.dtype) for o in problem.ir.outputs)
            light = out_bits <= 32 and not tile_operand_indices(problem.ir)
            long_k_from = _LONG_K_M_MAJOR_A if problem.a_major == "m" and not has_work else _LONG_K
            if (light and k >= long_k_from and n >= 256
                    and fill(128, 256) >= fill(tm, 128) - _FILL_TIE):
                long_k = GemmConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, swizzle=8)
                return widened(long_k, _WIDE_TILE_STAGES)
            # A plain GEMM has no epilogue to hide, only its mainloop to run cheaply: 128x192 tiles
            # in 2x1 clusters walked along N read about a tenth less smem per multiply-add than
            # 128x128 or 192x128 (an m64n192 WGMMA reads each A fragment for 192 columns, not 128)
            # and, multicasting B, as little L2 as 192x128 in 1x2. On the H200 they were faster
            # than the choice above in 22 of 25 pairs (up to 3.4%; 8192^3, 8192x14336x4096,
            # 16384x14336x4096, the N = 28672 shapes, either operand transposed), and slower where
            # they fill the SMs' rounds worse (2.3% at 4096x14336x4096, 5.6% at 16384x4096x4096).
            # Epilogues with work keep 192x128 where it fits (192 accumulators a thread run their
            # epilogue dense either way; 128x192 was no faster there) and elsewhere take 128x192
            # over 128x128 where it fills as well: faster in 27 of 28 pairs (0.9-7.6%) for four
            # epilogues at 4096x28672x8192, 8192x13824x4096, 4096x22016x4096 and 1000x22016x4096.
            # The measurements: benchmarks/FINDINGS.md, "Tile shapes and epilogue subtiles".
            broad = pingpong(128, 192)
            if ((not has_work or not fits_tall) and not crowded and fill(128, 192) >= fill(tm, 128) - _FILL_SLACK
                    and stages_of(broad) >= _PINGPONG_STAGES):
                return broad
            if not has_work and not fits_tall and problem.a_major == "m":
                # Below _LONG_K_M_MAJOR_A, 128x128 ping-pong tiles read an A stored (K, M) slowly
                # too, so it takes 192 along the longer side where that fills nearly as well: on an
                # H100 at K = 4096, 14336x4096 took 0.769 ms in 128x128 against 0.696 in 192x128
                # (XLA 0.704), 4096x14336 0.780 against 0.714 in 128x192 (XLA 0.711), each filling
                # the SMs' rounds 2% worse; 192 along the shorter side was 4-11% slower, 128x256
                # and 256x128 3-7% (benchmarks/FINDINGS.md, "Thirteenth sitting").
                tile = (192, 128) if m >= n else (128, 192)
                wide = pingpong(*tile)
                if (fill(*tile) >= fill(128, 128) - _FILL_SLACK_M_MAJOR_A
                        and stages_of(wide) >= _PINGPONG_STAGES):
                    return wide
            cfg = tall if fits_tall else pingpong(128)
            # The ring's depth is what the mainloop feeds on: a k-tile takes a 128x128 consumer
            # about 520 SM cycles of WGMMA, and its TMA load (L2 to smem, multicast) takes several
            # of those (_PINGPONG_STAGES). So pingpong() takes smaller epilogue subtiles where they
            # give the ring a stage: 64x32 rather than 128x16 of the same size, since each TMA
            # copy of a 16-bit tensor then moves 64 bytes a row, not 32, and alpha-beta's early
            # tiles no longer slow down while all CTAs run their first epilogues at once
            # (benchmarks/FINDINGS.md, "Where the SM cycles go"); on 192x128 tiles 64x16, the
            # subtile that leaves alpha-beta's ring 5 stages ("Tile shapes and epilogue subtiles").
            if cfg.epi_m:  # a shorter subtile bought the ring stages: none to spare for wider ones
                return cfg
            # 64-wide epilogue subtiles (half the barriers and TMA stores) when they cost the ring
            # no stage: a 128x128 tile with one 16-bit output keeps 6 either way.
            return widened(cfg, stages_of(cfg))

        # 128x256 once its tiles fill nearly one wave (a wave of 128x256 tiles beats two of
        # 128x128: the same work per SM at a higher MMA efficiency), and only while its epilogue
        # buffers (outputs and TILE operands) leave _WIDE_TILE_STAGES stages.
        wide_tile = GemmConfig(tile_m=128, tile_n=256)
        if n >= 256 and tiles(128, 256) >= _ONE_WAVE * sms and stages_of(wide_tile) >= _WIDE_TILE_STAGES:
            tm, tn = 128, 256
        elif tiles(128, 128) >= sms // 2 or m > 64:
            tm, tn = 128, 128
        else:
            tm, tn = 64, 128
        big = -(-m // tm) >= 8 and tiles(tm, tn) >= 2 * sms
        # Large problems walk bands of 8 clusters (L2 reuse) in 2x1 clusters multicasting B.
        cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=2 if big else 1, cluster_n=1,
                         swizzle=8 if big else 1)
        # 64-wide epilogue subtiles when _WIDE_TILE_STAGES still fit; plain GEMMs, which gained
        # nothing from them, keep 32.
        return widened(cfg, _WIDE_TILE_STAGES) if tn == 256 else cfg

    def _roomy(self, problem: KernelProblem, config: GemmConfig, n: int) -> GemmConfig:
        """``config``, or where its cooperative tile's epilogue buffers leave the ring fewer than
        _WIDE_TILE_STAGES stages, the first of 16-wide subtiles, then those in a 128-column tile,
        then in a 64-row one, that leaves that many (else the one that leaves the most). Many or
        wide outputs and TILE operands (an epilogue split at a reduction stores every value XLA
        finishes with) left 128x32 subtiles no room for 2 stages, and the call went to XLA.
        Gated and grouped tiles keep their shape (their fits chose it), and a tile that holds
        whole rows for in-tile reductions keeps its rows."""
        stages_of = functools.partial(stages_in, problem)

        if config.pingpong or stages_of(config) >= _WIDE_TILE_STAGES:
            return config
        narrower = [dataclasses.replace(config, epi_n=16)]
        if not problem.ir.gated and not problem.groups:
            if config.tile_n > 128 and not (problem.row_stats and n > 128):
                narrower.append(dataclasses.replace(narrower[-1], tile_n=128))
            if config.tile_m == 128 and not problem.row_stats:
                narrower.append(dataclasses.replace(narrower[-1], tile_m=64, cluster_m=1, swizzle=1))
        enough = [cfg for cfg in narrower if stages_of(cfg) >= _WIDE_TILE_STAGES]
        return enough[0] if enough else max([config, *narrower], key=stages_of)


def _grouped_tall_config(t: int, n: int, groups: int, sms: int) -> GemmConfig | None:
    """Cooperative 256x128 tiles in 1x2 clusters (A multicast along N) for a grouped GEMM whose
    groups, of T / G rows if balanced, they pad no more than 128-row tiles would, and whose
    tiles fill the SMs; None otherwise. Each CTA then reads its B tile alone, where a group of
    256 rows in 128-row tiles has two CTAs reading the same B tile, and a group's weights are
    its own bytes, read once per tile row: with 64 groups of 256 rows each (16384 x 3584 x
    4096, 1.9 GB of weights) they ran in 0.844 ms against 1.002 for ping-pong 128x128 tiles in
    1x2 clusters, and 0.743 against 0.808 with 8 groups (H100; benchmarks/FINDINGS.md, "Tenth
    sitting")."""
    rows = max(t // max(groups, 1), 1)

    def padded(tm: int) -> int:
        return -(-rows // tm) * tm

    if padded(256) > padded(128) or _tiles(rows, n, groups, 256, 128) < _ONE_WAVE * sms:
        return None
    return GemmConfig(tile_m=256, tile_n=128, cluster_n=2, raster="m")


def _promoting_config(m: int, n: int, l: int, sms: int, stores_transposed: bool) -> GemmConfig:
    """Cooperative tiles for 8-bit float inputs whose partial sums are promoted: each thread holds
    two accumulators an element, which leaves at most 96 columns a warpgroup. 128x192 (an m64n192
    WGMMA reads each A fragment for 192 columns, not 128) unless its tiles pad N more than
    _PROMOTING_PAD_SLACK worse than 128-wide ones. How they fill the SMs' rounds does not count:
    at 4096^3 (N padded 3%; 5.3 rounds of 128x192 tiles on 132 SMs against 7.8 of 128x128) they
    ran the 8-bit epilogues 5-7% faster, with or without stream-K (H100: 0.144 against 0.155 ms
    to bf16, 0.141 against 0.149 to e4m3; benchmarks/FINDINGS.md, "Seventeenth sitting").
    2x1 clusters multicasting B walked in bands of 8 when M spans several tiles. Beside the 192
    accumulators a thread of 128x192 tiles, an epilogue that also stores an output transposed
    spilled (fp8_mlp's up GEMM, ptxas: 76 bytes in 32-wide subtiles, 8 in 16-wide ones; none
    without the transposed copy), and none in 128x128 tiles, which it takes."""
    def covered(tn: int) -> float:
        return n / (-(-n // tn) * tn)

    wide = n >= 192 and not stores_transposed and covered(192) >= covered(128) - _PROMOTING_PAD_SLACK
    tn = 192 if wide else 128
    big = -(-m // 128) >= 8 and _tiles(m, n, l, 128, tn) >= 2 * sms
    return GemmConfig(tile_m=128, tile_n=tn, cluster_m=2 if big else 1, swizzle=8 if big else 1)


POLICY = Sm90Policy()
