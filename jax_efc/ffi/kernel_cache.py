"""The persistent on-disk kernel cache: a compiled kernel kept across processes.

On a hit the lowering emits the kernel's custom call from the stored module, without running
the CuTe DSL; on a miss the DSL compiles it as usual (``cutlass_call``) and, once the call
is lowered, the compiled module is stored. On by default; ``JAX_EFC_KERNEL_CACHE=0`` turns it off.

An entry's key covers everything its module depends on: the kernel's compile key (epilogue
IR and constants, dtypes, majors, config, schedule, arch), the shapes, dtypes and layouts of
its arguments, the versions of jax_efc, the DSL and JAX, a digest of jax_efc's kernel
sources, and the ``CUTE_DSL_*`` settings that change its code. Entries live owner-only under
``jax_efc.config.cache_dir()/kernels``, are written atomically (a temporary file renamed into
place) with a checksum, so a torn or foreign file is ignored (and removed), never loaded; past
``JAX_EFC_KERNEL_CACHE_BYTES`` (default 2 GiB) the least recently used are deleted.
"""

from __future__ import annotations

import hashlib
import os
import base64
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax_efc import device

__all__ = ["enabled", "Entry", "entry_key", "exists", "load", "store", "clear", "directory", "usage"]

_MAGIC = b"jax_efc kernel v1\n"
_DEFAULT_BYTES = 2 << 30


@dataclass(frozen=True)
class Entry:
    """What emitting a compiled kernel's custom call takes."""

    module: bytes
    fingerprint: bytes
    input_layouts: tuple
    output_layouts: tuple
    aliases: tuple[tuple[int, int], ...]


def enabled() -> bool:
    """Whether the cache is on: unless ``JAX_EFC_KERNEL_CACHE`` is ``0``."""
    return os.environ.get("JAX_EFC_KERNEL_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> str:
    from jax_efc.config import private_cache_dir

    return private_cache_dir("kernels")


def entry_key(compile_key: Any, inputs: Sequence[Any], in_modes: Sequence[Any],
              outputs: Sequence[Any], aliases: dict[int, int]) -> str:
    """The file name of the entry for one kernel call."""
    # the DSL's settings, but for the two that do not change its code: the arch (in the compile
    # key already, whether set or found on the GPU) and where its own cache lives
    settings = tuple(sorted((k, v) for k, v in os.environ.items()
                            if k.startswith("CUTE_DSL_") and k not in ("CUTE_DSL_ARCH", "CUTE_DSL_CACHE_DIR")))
    text = repr((_MAGIC, compile_key, [(tuple(x.shape), str(x.dtype)) for x in inputs], tuple(in_modes),
                 [(tuple(x.shape), str(x.dtype)) for x in outputs], sorted(aliases.items()),
                 device.build_versions(), settings))
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> str:
    return os.path.join(directory(), key + ".kernel")


def exists(key: str) -> bool:
    """Whether an entry is stored under ``key`` (not whether it is whole: ``load`` checks)."""
    try:
        return os.path.exists(_path(key))
    except OSError:
        return False


def load(key: str) -> Entry | None:
    """The entry stored under ``key``, or None; a damaged or foreign file is removed. A cache
    directory that cannot be used is a miss (``store`` then says why)."""
    try:
        path = _path(key)
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    head, checksum, body = blob[: len(_MAGIC)], blob[len(_MAGIC): len(_MAGIC) + 32], blob[len(_MAGIC) + 32:]
    entry = None
    if head == _MAGIC and hashlib.sha256(body).digest() == checksum:
        try:
            fields = json.loads(body)
            entry = Entry(module=base64.b64decode(fields["module"]),
                          fingerprint=base64.b64decode(fields["fingerprint"]),
                          input_layouts=_tuples(fields["input_layouts"]),
                          output_layouts=_tuples(fields["output_layouts"]),
                          aliases=tuple(tuple(a) for a in fields["aliases"]))
        except (ValueError, KeyError, TypeError):  # an entry this code cannot read is rebuilt
            entry = None
    if entry is None:
        _remove(path)
        return None
    os.utime(path)  # recently used: evicted last
    return entry


def _tuples(layouts: list) -> tuple:
    return tuple(None if x is None else tuple(x) for x in layouts)


def store(key: str, entry: Entry) -> None:
    """Write ``entry`` under ``key`` atomically, then keep the cache within its size bound."""
    body = json.dumps(dict(module=base64.b64encode(entry.module).decode(),
                           fingerprint=base64.b64encode(entry.fingerprint).decode(),
                           input_layouts=entry.input_layouts, output_layouts=entry.output_layouts,
                           aliases=entry.aliases)).encode()
    folder = directory()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, _path(key))
    except BaseException:
        _remove(tmp)
        raise
    _evict(folder, int(os.environ.get("JAX_EFC_KERNEL_CACHE_BYTES", _DEFAULT_BYTES)))


def _entries(folder: str) -> list[tuple[float, int, str]]:
    found = []
    for name in os.listdir(folder):
        if name.endswith(".kernel"):
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append((st.st_mtime, st.st_size, path))
    return sorted(found)


def _evict(folder: str, limit: int) -> None:
    entries = _entries(folder)
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= limit:
            break
        _remove(path)
        total -= size


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def usage() -> tuple[int, int]:
    """(entries, bytes) in the cache."""
    entries = _entries(directory())
    return len(entries), sum(size for _, size, _ in entries)


def clear() -> int:
    """Remove every entry; returns how many there were."""
    entries = _entries(directory())
    for _, _, path in entries:
        _remove(path)
    return len(entries)
