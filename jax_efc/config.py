"""Kernel configuration a user may pin, and the process-wide switches."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["GemmConfig", "disabled", "strict", "cache_dir", "private_cache_dir", "write_record", "read_record"]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile and cluster shape of the fused GEMM kernel.

    ``None`` (the default everywhere) lets a heuristic choose per problem. A field outside its
    domain raises ``ValueError`` when the config is made, on every platform. A config that the
    device's kernel cannot run (an SM90 tile and schedule that do not go together, or too
    little shared memory for the epilogue's buffers) raises ``ValueError`` naming the cause
    when a call pinned to it is compiled for that device; platforms without a kernel ignore it.
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
    # epilogue subtile height in rows (0: the tile's height; else a multiple of 64 that divides
    # it): at the same buffer size, shorter and wider subtiles move more bytes per row of each
    # TMA copy of an epilogue tensor
    epi_m: int = 0
    # ping-pong schedule: two consumer warpgroups each own whole tiles (at most 192x128,
    # 128x192 or 64x256) and take alternate tiles of the persistent schedule, so one runs its
    # epilogue while the other runs its mainloop. False: the cooperative schedule (one or two
    # warpgroups share each tile, up to 256x128 or 128x256).
    pingpong: bool = False
    # stream-K: when the last round of whole tiles would leave many SMs idle, the last two
    # rounds' k-iterations are shared evenly by all of them, and all k-iterations when the
    # tiles would fill at most half of one round (partial sums meet through an fp32 workspace
    # in global memory). False: every tile is computed whole by one CTA.
    stream_k: bool = True
    # Blackwell's 2-CTA MMA: a pair of CTAs along M (cluster_m even) issues one tcgen05 MMA of
    # tile_m (128 or 256) rows, each CTA holding tile_m / 2 of them and half of the B tile, so
    # each loads half as much B into shared memory per multiply-add. Hopper has no such MMA.
    use_2cta: bool = False
    # SMs the persistent grid leaves free for kernels that run beside it, such as a collective's
    # (NCCL runs CTAs of its own, which wait for SMs a persistent GEMM holds to its end)
    sm_margin: int = 0

    def __post_init__(self) -> None:
        reason = _field_error(self)
        if reason:
            raise ValueError(f"GemmConfig: {reason}")


def _field_error(config: GemmConfig) -> str | None:
    """The first field outside its domain, as a sentence; the checks every kernel shares."""
    for name in ("tile_m", "tile_n", "cluster_m", "cluster_n", "swizzle", "stages", "epi_n", "epi_m", "sm_margin"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name}={value!r} must be an int."
    for name in ("tile_m", "tile_n", "cluster_m", "cluster_n"):
        if getattr(config, name) < 1:
            return f"{name}={getattr(config, name)} must be positive."
    if config.sm_margin < 0:
        return f"sm_margin={config.sm_margin} must be 0 or more."
    if config.raster not in ("m", "n"):
        return f"raster={config.raster!r} must be 'm' or 'n'."
    if config.swizzle not in (1, 2, 4, 8):
        return f"swizzle={config.swizzle} must be 1, 2, 4 or 8."
    if config.stages != 0 and not 2 <= config.stages <= 8:
        return f"stages={config.stages} must be 0 (as many as fit) or between 2 and 8."
    if config.epi_n not in (16, 32, 64):
        return f"epi_n={config.epi_n} must be 16, 32 or 64."
    if config.tile_n % config.epi_n:
        return (f"tile_n={config.tile_n} is not a multiple of epi_n={config.epi_n}, the epilogue's "
                "subtile width; choose a tile_n that is, or a narrower epi_n.")
    if config.epi_m < 0 or config.epi_m % 64 or config.epi_m and config.tile_m % config.epi_m:
        return (f"epi_m={config.epi_m} must be 0 (the tile's height) or a multiple of 64 that "
                f"divides tile_m={config.tile_m}.")
    for name in ("pingpong", "stream_k", "use_2cta"):
        if not isinstance(getattr(config, name), bool):
            return f"{name}={getattr(config, name)!r} must be True or False."
    if config.use_2cta and config.cluster_m % 2:
        return (f"use_2cta=True pairs the CTAs of a cluster along M; cluster_m={config.cluster_m} must be "
                "even (2, 4, ...).")
    return None


def disabled() -> bool:
    """``JAX_EFC_DISABLE=1``: every op lowers to the XLA reference."""
    return os.environ.get("JAX_EFC_DISABLE", "0") not in ("", "0")


def strict() -> bool:
    """``JAX_EFC_STRICT=1``: the kernel runs wherever it can (GEMMs the heuristic would hand
    to XLA included), and a fallback to the reference is an error naming the reason."""
    return os.environ.get("JAX_EFC_STRICT", "0") not in ("", "0")


def cache_dir() -> str:
    """jax_efc's per-user cache directory: ``JAX_EFC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jax_efc``, else ``~/.cache/jax_efc``."""
    path = os.environ.get("JAX_EFC_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "jax_efc")
    return os.path.abspath(path)


def private_cache_dir(*parts: str) -> str:
    """``cache_dir()/parts``, created owner-only (0700), and made so if it is this user's but
    open to others. Raises ``PermissionError`` where a directory on the way is a link or
    another user's, rather than write into a directory someone else could have planted."""
    path = cache_dir()
    for part in ("", *parts):
        path = os.path.join(path, part) if part else path
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if os.path.islink(path) or st.st_uid != os.getuid():
            raise PermissionError(
                f"jax_efc's cache directory {path} is a link or another user's; set "
                "JAX_EFC_CACHE_DIR to a directory of your own.")
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
    return path


def write_record(folder: str, name: str, body: dict) -> None:
    """``body`` as JSON in ``folder/name.json``, written atomically (a reader sees the old record
    or the new one, never a torn one)."""
    import json
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body))
    os.replace(tmp, os.path.join(folder, name + ".json"))


def read_record(folder: str, name: str) -> dict | None:
    """The JSON object in ``folder/name.json``, or None (none there, or one that does not parse)."""
    import json

    try:
        with open(os.path.join(folder, name + ".json")) as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None

