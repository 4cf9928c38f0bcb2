"""Kernel configuration a user may pin, and the process-wide switches."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["GemmConfig", "disabled", "strict"]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile and cluster shape of the fused GEMM kernel.

    ``None`` (the default everywhere) lets a heuristic choose per problem. A config that the
    kernel cannot run raises ``ValueError`` naming the offending field.
    """

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    # persistent tile order: "m" walks down M first within a swizzle band, "n" along N
    raster: str = "m"
    # width, in clusters, of the band the raster order walks before moving on (L2 reuse)
    swizzle: int = 1
    # A/B shared-memory pipeline depth; 0 = as many as fit next to the epilogue buffers
    stages: int = 0
    # epilogue subtile width in columns (16, 32 or 64): wider means fewer barriers and TMA
    # stores per tile, narrower leaves more shared memory to the A/B pipeline
    epi_n: int = 32
    # ping-pong schedule: two consumer warpgroups each own whole tiles (at most 192x128,
    # 128x192 or 64x256) and take alternate tiles of the persistent schedule, so one runs its
    # epilogue while the other runs its mainloop. False: the cooperative schedule (one or two
    # warpgroups share each tile, up to 256x128 or 128x256).
    pingpong: bool = False
    # stream-K: when the last round of whole tiles would leave many SMs idle, the last two
    # rounds' k-iterations are shared evenly by all of them (partial sums meet through an
    # fp32 workspace in global memory). False: every tile is computed whole by one CTA.
    stream_k: bool = True


def disabled() -> bool:
    """``JAX_EFC_DISABLE=1``: every op lowers to the XLA reference."""
    return os.environ.get("JAX_EFC_DISABLE", "0") not in ("", "0")


def strict() -> bool:
    """``JAX_EFC_STRICT=1``: a fallback to the reference is an error naming the reason."""
    return os.environ.get("JAX_EFC_STRICT", "0") not in ("", "0")
