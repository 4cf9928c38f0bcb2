"""What an architecture contributes besides its kernel: the limits its kernel runs within and
the heuristic that picks its config. :class:`ArchPolicy` holds the checks every architecture
shares (the epilogue program, TMA's alignment, 32-bit indexing); a subclass per architecture
(``sm90_policy.py``) adds its tile shapes, its shared-memory budget and its heuristic. No
cutlass import: the plan asks the policy before anything is compiled, so every refusal is
a sentence rather than a compiler error."""

from __future__ import annotations

import dataclasses
import importlib
import os

from jax_efc.config import GemmConfig
from jax_efc.epilogue import EpilogueIR, Role, in_tile_reason
from jax_efc.kernels.dtypes import OPERAND_DTYPES, OUT_DTYPES, VALUE_DTYPES, align_elems, bits
from jax_efc.kernels.problem import KernelProblem, cta_tile, epilogue_tile, tile_k

__all__ = ["ArchPolicy", "MAX_ELEMENTS", "unverified_allowed"]

# the most elements one tensor may hold: the kernels' offsets are 32-bit signed integers
MAX_ELEMENTS = 2**31 - 1
# the most groups of a grouped GEMM: its kernel keeps two int32 per group in shared memory
MAX_GROUPS = 1024


def unverified_allowed() -> bool:
    """``JAX_EFC_UNVERIFIED_KERNELS=1``: run kernels that have not run on a GPU of their
    architecture without checking them first."""
    return os.environ.get("JAX_EFC_UNVERIFIED_KERNELS", "0") not in ("", "0")


class ArchPolicy:
    """One architecture's limits and heuristic. Subclasses set the class attributes and
    implement :meth:`config_reason`, :meth:`resources_reason` and :meth:`choose_config`."""

    arch: str  # "sm_90a"
    kernel: str  # "module:Class" of the kernel, imported only to build one
    # SMs the heuristic and the persistent grid assume when compiling without a GPU
    default_sm_count: int
    ab_dtypes: tuple[str, ...]
    acc_dtypes: tuple[str, ...]
    # what the shared epilogue driver stores, reads as operands and evaluates in
    out_dtypes: tuple[str, ...] = OUT_DTYPES
    operand_dtypes: tuple[str, ...] = OPERAND_DTYPES
    value_dtypes: tuple[str, ...] = VALUE_DTYPES
    # A/B and accumulator dtypes whose kernels compile and pass the instruction checks but have
    # not yet run on a GPU of this architecture, and whether its epilogue reductions have: what
    # has not, each kernel checks on first use (jax_efc.self_check), or runs under
    # JAX_EFC_UNVERIFIED_KERNELS=1
    unverified_ab_dtypes: tuple[str, ...] = ()
    unverified_acc_dtypes: tuple[str, ...] = ()
    verified_reductions: bool = False
    verified_atomic_reductions: bool = False  # of those, folded across tiles by atomics (Output.atomic)
    verified_inplace: bool = False  # outputs stored over their operand (KernelProblem.aliased)
    verified_masked_stores: bool = False  # of those, stored only where a mask holds (.masked)
    verified_transposed_outputs: bool = False  # outputs stored transposed, M contiguous (Output.transposed)
    # whether the kernel pairs a gated GEMM's gate and up columns (EpilogueIR.gated), and whether
    # that has run on a GPU of this architecture
    gated_kernel: bool = False
    verified_gated: bool = False
    # k-tiles of 8-bit float partial sums accumulated between promotions into fp32 where the call
    # does not ask for the most precise arithmetic (which promotes each k-tile), and whether
    # promoting less often than each k-tile has run on a GPU of this architecture
    promotion_k_tiles: int = 1
    verified_promotion_k_tiles: bool = False
    # whether the kernel runs grouped (ragged) GEMMs (KernelProblem.groups), and whether that has
    # run on a GPU of this architecture
    grouped_kernel: bool = False
    verified_grouped: bool = False
    verified_grouped_k: bool = False  # of those, groups of the contraction (KernelProblem.ragged_k)
    # whether the kernel finishes reductions over N inside a tile that spans the rows and
    # evaluates what consumes them (KernelProblem.row_stats: a row softmax, a row norm), the
    # tile widths it may take for them, and whether that has run on a GPU of this architecture
    row_stats_kernel: bool = False
    row_tile_ns: tuple[int, ...] = ()
    verified_row_stats: bool = False
    # GEMMs the heuristic hands to XLA's GEMM (xla_faster_reason): at most this many rows per B
    # (None: none are), or more rows in 128x128 tiles that fill less than this share of the SMs
    xla_rows: int | None = None
    xla_fill: float = 0.0

    def kernel_class(self) -> type:
        module, name = self.kernel.split(":")
        return getattr(importlib.import_module(module), name)

    def runs_by_default(self) -> bool:
        """Whether the kernel runs calls without a first-use check or
        ``JAX_EFC_UNVERIFIED_KERNELS=1``: some of its input types have run on a GPU of this
        architecture (or the switch is set)."""
        return unverified_allowed() or bool(set(self.ab_dtypes) - set(self.unverified_ab_dtypes))

    def unverified_reason(self, problem: KernelProblem) -> str | None:
        """What of ``problem``'s kernel has not yet run on a GPU of this architecture (its input
        or accumulator type, its epilogue reductions, by partials or by atomics, in-place or
        transposed outputs), as a phrase; ``None``: all has."""
        for dtype in (problem.ab_dtype, problem.b_dtype):
            if dtype in self.unverified_ab_dtypes:
                return f"the {self.arch} kernel with {dtype} inputs"
        if problem.acc_dtype in self.unverified_acc_dtypes:
            return f"the {self.arch} kernel with {problem.acc_dtype} accumulation"
        if not self.verified_reductions and any(o.reduce for o in problem.ir.outputs):
            return f"the {self.arch} kernel's epilogue reductions"
        if not self.verified_atomic_reductions and any(o.atomic for o in problem.ir.outputs):
            return f"the {self.arch} kernel's epilogue reductions folded across tiles by atomics"
        if not self.verified_inplace and problem.aliased:
            return f"the {self.arch} kernel's outputs written over their operands"
        if not self.verified_masked_stores and problem.masked:
            return f"the {self.arch} kernel's outputs stored over their operands only where a mask holds"
        if not self.verified_transposed_outputs and any(o.transposed for o in problem.ir.outputs):
            return f"the {self.arch} kernel's outputs stored transposed"
        if not self.verified_gated and problem.ir.gated:
            return f"the {self.arch} kernel's gated epilogue (gate and up columns paired)"
        if not self.verified_grouped and problem.groups:
            return f"the {self.arch} grouped (ragged) GEMM kernel"
        if not self.verified_row_stats and problem.row_stats:
            return f"the {self.arch} kernel's row reductions consumed inside the tile (a row softmax or norm)"
        if not self.verified_grouped_k and problem.ragged_k:
            return f"the {self.arch} grouped GEMM over groups of the contraction (a grouped weight gradient)"
        return None

    def default_promotion(self) -> int:
        """k-tiles per promotion of 8-bit float partial sums (``KernelProblem.promote``) where the
        call does not ask for the most precise arithmetic (which promotes each k-tile):
        :attr:`promotion_k_tiles`, or 1 until promoting less often has run on a GPU here."""
        return self.promotion_k_tiles if self.verified_promotion_k_tiles or unverified_allowed() else 1

    # ---- limits
    def config_reason(self, config: GemmConfig) -> str | None:
        """Why the kernel cannot run ``config`` at all (``None``: it can)."""
        raise NotImplementedError

    def resources_reason(self, problem: KernelProblem) -> str | None:
        """Why ``problem``'s kernel does not fit the SM (shared memory, registers)."""
        raise NotImplementedError

    def accumulator_reason(self, problem: KernelProblem) -> str | None:
        """Why the MMA cannot accumulate ``problem``'s inputs in its ``acc_dtype``."""
        return None

    def splits_k(self, problem: KernelProblem) -> bool:
        """Whether stream-K may split ``problem``'s k-iterations: its partial sums meet in an
        fp32 workspace, written in the accumulator's register order."""
        return problem.acc_dtype == "float32"

    def dtype_reason(self, problem: KernelProblem) -> str | None:
        """Why the kernel takes no A, B or accumulator of ``problem``'s dtypes: asked first, before
        anything that reads them (their widths, their majors)."""
        for dtype in {problem.ab_dtype, problem.b_dtype}:
            if dtype not in self.ab_dtypes:
                return f"A/B dtype {dtype} is not supported; use {' or '.join(self.ab_dtypes)}."
        if problem.b_dtype != problem.ab_dtype and tile_k(problem.b_dtype) != problem.tile_k:
            return f"A is {problem.ab_dtype} but B is {problem.b_dtype}; only dtypes of one width mix."
        if problem.acc_dtype not in self.acc_dtypes:
            return f"accumulator dtype {problem.acc_dtype} is not supported; use {' or '.join(self.acc_dtypes)}."
        return None

    def mma_majors(self, problem: KernelProblem) -> tuple[str, str] | None:
        """The (A, B) majors the MMA reads ``problem``'s inputs in, or ``None`` for any: the plan
        transposes an input stored otherwise once, before the kernel."""
        return None

    def unsupported_reason(self, problem: KernelProblem,
                           mnkl: tuple[int, int, int, int] | None = None) -> str | None:
        """``None`` if the kernel can run ``problem`` (on an M x N x K x L GEMM when ``mnkl`` is
        given), else one sentence naming the offending value and what to do."""
        if problem.arch != self.arch:
            return f"the {self.arch} policy was asked about a kernel for {problem.arch}."
        reason = self.dtype_reason(problem)
        if reason:
            return reason
        reason = self.accumulator_reason(problem)
        if reason:
            return reason
        if problem.a_major not in ("k", "m") or problem.b_major not in ("k", "n"):
            return f"bad majors a={problem.a_major!r}, b={problem.b_major!r}."
        need = self.mma_majors(problem)
        if need is not None and (problem.a_major, problem.b_major) != need:
            return (f"{problem.ab_dtype} A and B must be {need[0]}-major and {need[1]}-major for the MMA "
                    f"(A is {problem.a_major}-major, B {problem.b_major}-major).")
        if len(problem.operand_batched) != len(problem.ir.operands):
            return "operand_batched must have one flag per epilogue operand."
        reason = (self.config_reason(problem.config) or self._ir_reason(problem.ir)
                  or self.gated_reason(problem) or self.grouped_reason(problem) or self.row_stats_reason(problem)
                  or self.resources_reason(problem))
        if reason or mnkl is None:
            return reason
        return self._shape_reason(problem, mnkl)

    def gated_reason(self, problem: KernelProblem) -> str | None:
        """Why the kernel cannot pair ``problem``'s gated columns (``None``: it can, or the GEMM is
        not gated): a CTA tile must hold whole (gate, up) pairs of 2B columns and an epilogue
        subtile must lie within one block of B."""
        block = problem.ir.gated
        if not block:
            return None
        if not self.gated_kernel:
            return f"the {self.arch} kernel does not pair a gated GEMM's gate and up columns."
        tile_n, (_, epi_n) = cta_tile(problem.config)[1], epilogue_tile(problem.config)
        if tile_n % (2 * block):
            return (f"gated={block}: a tile of {tile_n} columns does not hold whole (gate, up) pairs of "
                    f"{2 * block} columns; use a tile_n that is a multiple of {2 * block}.")
        if block % epi_n:
            return (f"gated={block}: epilogue subtiles of {epi_n} columns do not divide a block of {block}; "
                    "use an epi_n that does (16, 32 or 64), or a block that is a multiple of 16.")
        if any(o.reduce for o in problem.ir.outputs):
            return "the gated epilogue does not reduce; XLA computes gated GEMMs with reductions."
        if problem.acc_dtype == "int32":
            # (the up projection's bare accumulator would be stored from its fp32 copy)
            return "the gated epilogue reads integer accumulators as fp32 only; XLA computes 8-bit integer ones."
        return None

    def row_stats_reason(self, problem: KernelProblem) -> str | None:
        """Why the kernel cannot finish ``problem``'s consumed reductions inside its tiles
        (``None``: it can, or there are none): each is over N alone, and what they reduce reads
        no tile operand (those arrive a subtile at a time, as the outputs are stored)."""
        if not problem.row_stats:
            return None
        if not self.row_stats_kernel:
            return f"the {self.arch} kernel does not finish reductions inside its tiles; XLA computes what uses them."
        if problem.groups:
            return "grouped GEMMs do not consume reductions inside the kernel; XLA computes what uses them."
        return in_tile_reason(problem.program)

    def row_fit(self, problem: KernelProblem, config: GemmConfig, n: int) -> GemmConfig:
        """``config`` with a tile as wide as the rows of ``n`` columns where ``problem`` consumes
        reductions over N inside it: the narrowest of ``row_tile_ns`` that holds them."""
        if not problem.row_stats or cta_tile(config)[1] >= n or not self.row_tile_ns:
            return config
        tile_n = min((t for t in self.row_tile_ns if t >= n), default=max(self.row_tile_ns))
        return self.row_tile(config, tile_n)

    def row_tile(self, config: GemmConfig, tile_n: int) -> GemmConfig:
        """``config`` with ``tile_n`` columns, for :meth:`row_fit`."""
        return dataclasses.replace(config, tile_n=tile_n, cluster_n=1)

    def grouped_reason(self, problem: KernelProblem) -> str | None:
        """Why the kernel cannot run ``problem`` as a grouped GEMM (``None``: it can, or it is not
        one): its clusters span one row tile (a group's rows need not fill a pair), it runs whole
        tiles, and each output tile stores only its group's rows."""
        if not problem.groups:
            return None
        if not self.grouped_kernel:
            return f"the {self.arch} kernel does not run grouped GEMMs."
        if problem.groups > MAX_GROUPS:
            return (f"{problem.groups} groups: the grouped kernel keeps a table of at most {MAX_GROUPS} in shared "
                    "memory; split the groups over several calls.")
        if problem.config.cluster_m != 1:
            return (f"cluster_m={problem.config.cluster_m}: a grouped GEMM's clusters span one row tile (a group's "
                    "rows need not fill several); use cluster_m=1 (cluster_n may multicast A).")
        if any(o.reduce for o in problem.ir.outputs):
            return "the grouped kernel does not reduce; XLA computes grouped GEMMs with reductions."
        if problem.ir.gated:
            return "the grouped kernel does not pair gated columns; XLA computes gated grouped GEMMs."
        if problem.aliased or any(o.transposed for o in problem.ir.outputs):
            return "the grouped kernel stores its outputs untransposed and into arrays of their own only."
        if problem.ragged_k:
            return self._ragged_k_reason(problem)
        if problem.a_major != "k":
            return "the grouped kernel reads A (the tokens) K-major only."
        return None

    @staticmethod
    def _ragged_k_reason(problem: KernelProblem) -> str | None:
        """Why the grouped kernel cannot run ``problem``, a grouped GEMM over groups of the
        contraction: it reads both operands M/N-major (their rows are the contraction), which
        Hopper's MMA does only for 16-bit inputs, and stores each group's product as it is."""
        if bits(problem.ab_dtype) != 16:
            return (f"the grouped weight-gradient kernel reads 16-bit inputs only (not {problem.ab_dtype}: the "
                    "MMA reads 8-bit and TF32 operands K-major, and the contraction runs along their rows).")
        if (problem.a_major, problem.b_major) != ("m", "n"):
            return "the grouped weight-gradient kernel reads A stored (T, M) and B stored (T, N) only."
        ir = problem.ir
        if ir.operands or ir.instrs or len(ir.outputs) != 1 or ir.outputs[0].value != 0:
            return "the grouped weight-gradient kernel stores the plain product only."
        return None

    def grouped_fit(self, problem: KernelProblem, config: GemmConfig) -> GemmConfig:
        """``config`` as a grouped GEMM runs it: a cluster along M becomes one along N."""
        if not problem.groups or config.cluster_m == 1:
            return config
        return dataclasses.replace(config, cluster_m=1, cluster_n=min(2, config.cluster_m * config.cluster_n),
                                   raster="m")

    def gated_fit(self, problem: KernelProblem, config: GemmConfig) -> GemmConfig:
        """``config`` with the smallest change that lets it pair ``problem``'s gated columns: the
        widest epilogue subtile dividing the block (64x16 on a ping-pong tile of more than
        128x128), and where its tile does not hold whole pairs, tiles of at most 128x128
        (cooperative 128x256 where a pair is wider)."""
        block = problem.ir.gated
        if not block:
            return config
        epi_n = max((w for w in (16, 32, 64) if block % w == 0 and w <= config.epi_n), default=16)
        config = dataclasses.replace(config, epi_n=epi_n)
        # a ping-pong consumer's 192 accumulators a thread (192x128) spilled beside a 64x32
        # subtile's gate and up values (20 bytes; 40 at 64x64), not beside a 64x16 one's
        # (tests/test_kernel_compile_gated.py). At 8192x14336x4096 192x128 tiles ran 1.26x
        # faster than 128x128 ones on the H100 (64x32 subtiles), and 64x16 subtiles as fast as
        # 64x32 on the H200 (benchmarks/FINDINGS.md, "Gated GEMMs")
        crowded = config.pingpong and config.tile_m * config.tile_n > 128 * 128
        if crowded and block % 16 == 0:
            config, crowded = dataclasses.replace(config, epi_m=64, epi_n=16), False
        if cta_tile(config)[1] % (2 * block) == 0 and not crowded:
            return config
        if 128 % (2 * block) == 0 and not config.pingpong:
            return dataclasses.replace(config, tile_n=128, cluster_n=1, raster="m")
        if 128 % (2 * block) == 0:  # ping-pong 128x128 (64x128) in 1x2 clusters, as the heuristic runs them
            tile_m = min(config.tile_m, 128)
            return dataclasses.replace(config, tile_m=tile_m, tile_n=128, cluster_m=1, cluster_n=2, raster="m",
                                       epi_m=config.epi_m if config.epi_m and tile_m % config.epi_m == 0 else 0)
        return dataclasses.replace(config, tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1,
                                   raster="m", epi_m=0)

    def _ir_reason(self, ir: EpilogueIR) -> str | None:
        if ir.epi_dtype != "float32":
            return f"the epilogue dtype is {ir.epi_dtype}; the kernels evaluate epilogues in float32."
        for inp in ir.operands:
            if inp.dtype not in self.operand_dtypes:
                return (f"{inp.name} has dtype {inp.dtype}; kernel epilogue operands must be one of "
                        f"{self.operand_dtypes}. Cast it first.")
        for ins in ir.instrs:
            if ins.dtype not in self.value_dtypes:
                return (f"the epilogue computes a {ins.dtype} value (`{ins.op}`); the kernels "
                        f"evaluate only {self.value_dtypes} values.")
        for out in ir.outputs:
            value = ir.inputs[out.value].dtype if out.value < len(ir.inputs) else \
                ir.instrs[out.value - len(ir.inputs)].dtype
            if out.reduce and value not in ("float32", "float16", "bfloat16"):
                return (f"output {out.name!r} reduces a {value} value; the kernels reduce floating "
                        "values only (cast it to float32 in the epilogue).")
            if out.dtype not in self.out_dtypes:
                return (f"output {out.name!r} has dtype {out.dtype}; the kernels store only "
                        f"{self.out_dtypes}.")
        if not ir.outputs:
            return "the epilogue has no outputs."
        if all(o.reduce for o in ir.outputs):
            return ("every output of the epilogue is a reduction; the kernels store at least one "
                    "tile (return the tile too, or let XLA run it).")
        return None

    @staticmethod
    def _shape_reason(problem: KernelProblem, mnkl: tuple[int, int, int, int]) -> str | None:
        m, n, k, l = mnkl
        if min(m, n, k, l) <= 0:
            return f"empty GEMM {m}x{n}x{k} (batch {l}); nothing to run."
        tensors = {"A": m * k * (l if problem.a_batched else 1), "B": k * n * (l if problem.b_batched else 1),
                   "the outputs": m * n * l}
        for what, size in tensors.items():
            if size > MAX_ELEMENTS:
                return (f"{what} would hold {size} elements, more than the {MAX_ELEMENTS} the kernel's "
                        "32-bit indexing reaches; split the GEMM (e.g. over the batch or M).")
        contiguous_a = ("K", k) if problem.a_major == "k" else ("M", m)
        contiguous_b = ("K", k) if problem.b_major == "k" else ("N", n)
        for what, (dim, size), dtype in (("A", contiguous_a, problem.ab_dtype), ("B", contiguous_b, problem.b_dtype)):
            ab = align_elems(dtype)
            if size % ab:
                return (f"{what}'s contiguous dimension {dim}={size} is not a multiple of {ab} "
                        f"{dtype} elements (16 bytes), which TMA requires; pad {dim} "
                        f"to a multiple of {ab}.")
        for inp in problem.ir.operands:
            if inp.role is Role.TILE and n % align_elems(inp.dtype):
                a = align_elems(inp.dtype)
                return (f"tile operand {inp.name} ({inp.dtype}) has N={n}, not a multiple of {a} "
                        f"elements (16 bytes), which its TMA load requires; pad N to a multiple "
                        f"of {a}.")
        if problem.row_stats and cta_tile(problem.config)[1] < n:
            return (f"the epilogue consumes a reduction over N, which a tile finishes only when it spans the "
                    f"row: tile_n={cta_tile(problem.config)[1]} is narrower than N={n}; use a tile_n of at least "
                    f"{n}, or leave the config to the heuristic.")
        for out in problem.ir.outputs:
            a = align_elems(out.dtype)
            if out.transposed and m % a:
                return (f"output {out.name!r} ({out.dtype}) is stored transposed, M contiguous, and has M={m}, "
                        f"not a multiple of {a} elements (16 bytes), which the TMA store requires; pad M to a "
                        f"multiple of {a}, or store it untransposed.")
            if not out.transposed and n % a:
                return (f"output {out.name!r} ({out.dtype}) has N={n}, not a multiple of {a} "
                        f"elements (16 bytes), which the TMA store requires; pad N to a multiple "
                        f"of {a}.")
        return None

    # ---- heuristic
    def choose_config(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                      sm_count: int) -> GemmConfig:
        """A config for an M x N x K x L GEMM on a GPU with ``sm_count`` SMs."""
        raise NotImplementedError

    def candidate_configs(self, problem: KernelProblem, m: int, n: int, k: int, l: int,
                          sm_count: int) -> list[GemmConfig]:
        """The configs an autotuner times for an M x N x K x L GEMM: the heuristic's first,
        then others the kernel can run."""
        return [self.choose_config(problem, m, n, k, l, sm_count)]

    def xla_faster_reason(self, problem: KernelProblem, m: int, n: int, l: int,
                          sm_count: int | None = None) -> str | None:
        """Why XLA's GEMM outruns the kernel on an M x N x L GEMM it can run, of any K (``None``: it
        does not): at most ``xla_rows`` rows share each B, or its 128x128 tiles would fill less than
        ``xla_fill`` of the SMs. The heuristic hands such calls to the reference."""
        if self.xla_rows is None:
            return None
        sm_count = sm_count or self.default_sm_count
        rows = m if problem.b_batched else m * l
        tiles = -(-m // 128) * -(-n // 128) * l
        if rows <= self.xla_rows:
            why = f"{rows} rows share each B, so the GEMM is bound by reading B"
        elif tiles < self.xla_fill * sm_count:
            why = f"its {tiles} tiles of 128x128 would leave {sm_count - tiles} of {sm_count} SMs idle"
        else:
            return None
        return (f"{why}: XLA's GEMM runs it faster than the kernel. Pin a config (or set "
                "JAX_EFC_STRICT=1) to run the kernel anyway.")

    def assumed_max_clusters(self, cluster_size: int, sm_count: int | None = None) -> int:
        """Clusters of ``cluster_size`` CTAs a GPU with ``sm_count`` SMs is assumed to run at once
        when there is no GPU to ask (the persistent grid must not exceed it, or the surplus
        clusters run as a second wave: about half speed).

        One CTA fills an SM (the kernels take all of its shared memory) and a cluster stays inside
        one GPC, so GPCs whose SM count is not a multiple of the cluster size strand SMs. On an
        H200 (132 SMs) the driver answers 132, 66 and 30 for clusters of 1, 2 and 4 (not 33),
        hence the 10% margin for clusters of more than 2.
        """
        clusters = (sm_count or self.default_sm_count) // cluster_size
        return clusters if cluster_size <= 2 else clusters * 9 // 10
