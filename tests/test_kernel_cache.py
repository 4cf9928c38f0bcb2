"""The on-disk kernel cache (``jax_efc.ffi.kernel_cache``): entries, their integrity and bound,
and a second process that emits the very custom calls of the first without the DSL compiling."""

from __future__ import annotations

import json
import os
import re

import jax
import pytest

from conftest import run_for_sm90
from jax_efc.ffi import kernel_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_EFC_KERNEL_CACHE", "1")
    return tmp_path / "kernels"


def _entry(n: int = 1000) -> kernel_cache.Entry:
    return kernel_cache.Entry(module=os.urandom(n), fingerprint=os.urandom(32),
                              input_layouts=((0, 1, 2), None), output_layouts=((0, 1, 2),), aliases=((1, 0),))


def _key(compile_key=("k",), shape=(1, 64, 64)) -> str:
    spec = jax.ShapeDtypeStruct(shape, "bfloat16")
    return kernel_cache.entry_key(compile_key, [spec], [(1, 2, 0)], [spec], {})


def test_entries_round_trip_and_are_private(cache):
    entry = _entry()
    kernel_cache.store(_key(), entry)
    assert kernel_cache.load(_key()) == entry
    assert kernel_cache.load(_key(shape=(1, 64, 128))) is None
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    assert kernel_cache.usage()[0] == 1
    assert kernel_cache.clear() == 1 and kernel_cache.usage() == (0, 0)


def test_the_key_covers_what_the_module_depends_on(cache, monkeypatch):
    base = _key()
    assert _key(compile_key=("other",)) != base
    assert _key(shape=(2, 64, 64)) != base
    monkeypatch.setenv("CUTE_DSL_OPT_LEVEL", "1")  # a DSL setting that changes its code
    assert _key() != base
    monkeypatch.delenv("CUTE_DSL_OPT_LEVEL")
    assert _key() == base
    # the arch is in the compile key, set or found; the DSL's cache location changes no code
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", "/elsewhere")
    assert _key() == base


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_or_foreign_entry_is_ignored_and_removed(cache, damage):
    kernel_cache.store(_key(), _entry())
    (path,) = cache.glob("*.kernel")
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    else:
        path.write_bytes(b"not a jax_efc kernel")
    assert kernel_cache.load(_key()) is None
    assert not path.exists()


def test_the_cache_keeps_its_size_bound(cache, monkeypatch):
    monkeypatch.setenv("JAX_EFC_KERNEL_CACHE_BYTES", str(5000))
    for i in range(5):
        kernel_cache.store(_key(compile_key=(i,)), _entry(1500))
        os.utime(next(p for p in cache.glob("*.kernel") if p.name.startswith(_key(compile_key=(i,)))),
                 (1000 + i, 1000 + i))
    kept = [i for i in range(5) if kernel_cache.load(_key(compile_key=(i,))) is not None]
    assert kept == [3, 4]  # the least recently used went first


_EXPORT = """
import json, sys
import jax, jax.numpy as jnp
import jax_efc as efc
from cutlass.jax import get_export_disabled_safety_checks
if sys.argv[1] == "no-dsl":
    import cutlass.cute
    def compile(*args, **kwargs):
        raise RuntimeError("the DSL compiled a kernel")
    cutlass.cute.compile = compile
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
def loss(x, w, b):
    return efc.fused_dense(x, w, b, activation="gelu").astype(jnp.float32).sum()
exported = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"],
                             disabled_checks=get_export_disabled_safety_checks())(
    S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf))
print(json.dumps([line for line in exported.mlir_module().splitlines() if "custom_call @CuteDSLRT" in line]))
"""


def _calls(out: str) -> list[str]:
    """The module's kernel calls, in a canonical order (a stored kernel's call stands in the main
    function, a compiled one's in a function of its own). SSA names and source locations
    differ between two programs; nothing else may."""
    return sorted(re.sub(r"loc\(#loc\d+\)|%[\w#:]+", "", line) for line in json.loads(out.strip().splitlines()[-1]))


def _built(calls: list[str]) -> list[str]:
    """The calls without their compiled module and its fingerprint: two compiles of one kernel
    need not give the same bytes."""
    return sorted(re.sub(r'(key|module) = "(\\.|[^"\\])*"', "", c) for c in calls)


def test_a_second_process_emits_the_same_kernels_without_the_dsl(tmp_path):
    pytest.importorskip("cutlass.jax")
    env = dict(JAX_EFC_CACHE_DIR=str(tmp_path), JAX_EFC_KERNEL_CACHE="1")
    first = _calls(run_for_sm90(_EXPORT, "dsl", **env))
    stored = sorted((tmp_path / "kernels").glob("*.kernel"))
    assert len(first) == 3 and len(stored) == 3
    assert _calls(run_for_sm90(_EXPORT, "no-dsl", **env)) == first
    stored[0].write_bytes(stored[0].read_bytes()[:100])  # torn: that kernel compiles again
    again = _calls(run_for_sm90(_EXPORT, "dsl", **env))
    assert _built(again) == _built(first)
    assert len(list((tmp_path / "kernels").glob("*.kernel"))) == 3
    assert _calls(run_for_sm90(_EXPORT, "no-dsl", **env)) == again
    off = dict(env, JAX_EFC_KERNEL_CACHE="0", JAX_EFC_CACHE_DIR=str(tmp_path / "off"))
    assert _built(_calls(run_for_sm90(_EXPORT, "dsl", **off))) == _built(first)
    assert not list((tmp_path / "off").glob("kernels/*.kernel"))
    (tmp_path / "file").write_text("")
    blocked = dict(env, JAX_EFC_CACHE_DIR=str(tmp_path / "file" / "cache"))  # not creatable
    assert _built(_calls(run_for_sm90(_EXPORT, "dsl", **blocked))) == _built(first)


def test_an_unusable_cache_directory_costs_the_cache_not_the_kernel(tmp_path, monkeypatch, caplog):
    from jax_efc import device

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(blocker / "cache"))  # under a file: not creatable
    assert kernel_cache.load(_key()) is None
    monkeypatch.delenv("CUTE_DSL_CACHE_DIR", raising=False)
    device.use_private_dsl_cache()
    assert "CUTE_DSL_CACHE_DIR" not in os.environ
    assert any("keeps its default cache directory" in r.getMessage() for r in caplog.records)


_RUN = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import jax_efc as efc
if sys.argv[1] == "no-dsl":
    import cutlass.cute
    def compile(*args, **kwargs):
        raise RuntimeError("the DSL compiled a kernel")
    cutlass.cute.compile = compile
rng = np.random.default_rng(0)
x, w, b = (jnp.asarray(rng.standard_normal(s) / 8, jnp.bfloat16) for s in ((1000, 768), (768, 520), (520,)))
def loss(x, w, b):
    return (efc.fused_dense(x, w, b, activation="gelu").astype(jnp.float32) ** 2).sum()
grads = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, b)
print(json.dumps([np.asarray(g, np.float32).ravel().tolist() for g in grads]))
"""


@pytest.mark.gpu
def test_a_stored_kernel_runs_and_gives_the_compiled_kernels_bits(tmp_path):
    """On the GPU: a second process that loads every kernel of a training step from the cache
    computes bit for bit what the first, compiling, process did, and both match the reference."""
    import subprocess
    import sys

    import numpy as np

    def run(mode: str, **env: str) -> list[np.ndarray]:
        proc = subprocess.run([sys.executable, "-c", _RUN, mode], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "JAX_EFC_CACHE_DIR": str(tmp_path), "JAX_EFC_STRICT": "1", **env})
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [np.asarray(g) for g in json.loads(proc.stdout.strip().splitlines()[-1])]

    first = run("dsl", JAX_EFC_KERNEL_CACHE="1")
    assert len(list((tmp_path / "kernels").glob("*.kernel"))) >= 3
    stored = run("no-dsl", JAX_EFC_KERNEL_CACHE="1")
    want = run("dsl", JAX_EFC_DISABLE="1", JAX_EFC_STRICT="0")
    for f, s, w in zip(first, stored, want):
        assert np.array_equal(f, s)
        assert np.linalg.norm(f - w) <= 2e-2 * np.linalg.norm(w)


_WARMUP = """
import json, sys, time
import jax, jax.numpy as jnp
import jax_efc as efc
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
def loss(x, w, b):
    return efc.fused_dense(x, w, b, activation="gelu").astype(jnp.float32).sum()
step = jax.grad(loss, (0, 1, 2))
specs = S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf)
t0 = time.perf_counter()
lines = efc.warmup(step, *specs, processes=int(sys.argv[1]))
took = time.perf_counter() - t0
import cutlass.cute
def compile(*args, **kwargs):
    raise RuntimeError("the DSL compiled a kernel")
cutlass.cute.compile = compile
exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=efc.export_checks())(*specs)
print(json.dumps({"lines": lines, "kernels": exported.mlir_module().count("custom_call @CuteDSLRT"),
                  "again": efc.warmup(step, *specs), "seconds": took}))
"""


def test_warmup_builds_a_steps_kernels_in_parallel_for_the_lowering(tmp_path):
    """efc.warmup compiles a training step's three kernels in worker processes; the step's own
    lowering then finds every one in the cache (its DSL compile is disabled), and a second
    warmup finds nothing to do."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_WARMUP, "2", JAX_EFC_CACHE_DIR=str(tmp_path), JAX_EFC_KERNEL_CACHE="1")
                     .strip().splitlines()[-1])
    assert out["lines"] == ["compiled"] * 3, out
    assert out["kernels"] == 3
    assert out["again"] == ["cached"] * 3
    assert len(list((tmp_path / "kernels").glob("*.kernel"))) == 3


_WARMUP_GROUPED = """
import json
import jax, jax.numpy as jnp
import jax_efc as efc
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
def loss(x, w, s, b):
    return efc.grouped_gemm(x, w, s, lambda acc, b: jax.nn.silu(acc + b), group_operands=[b]).sum()
step = jax.grad(loss, (0, 1, 3))
specs = S((1024, 256), bf), S((4, 256, 384), bf), S((4,), jnp.int32), S((4, 384), jnp.float32)
lines = efc.warmup(step, *specs)
import cutlass.cute
def compile(*args, **kwargs):
    raise RuntimeError("the DSL compiled a kernel")
cutlass.cute.compile = compile
exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=efc.export_checks())(*specs)
print(json.dumps({"lines": lines, "kernels": exported.mlir_module().count("custom_call @CuteDSLRT"),
                  "again": efc.warmup(step, *specs)}))
"""


def test_warmup_builds_grouped_kernels(tmp_path):
    """efc.warmup builds a grouped GEMM's kernels too (its forward, its lhs gradient and its
    weight gradient, which take the group sizes), and the lowering then loads them from the
    cache."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_WARMUP_GROUPED, JAX_EFC_CACHE_DIR=str(tmp_path),
                                  JAX_EFC_KERNEL_CACHE="1").strip().splitlines()[-1])
    assert out["lines"] == ["compiled"] * 3, out
    assert out["kernels"] == 3
    assert out["again"] == ["cached"] * 3


_AHEAD = """
import json, sys, time
import jax, jax.numpy as jnp
import jax_efc as efc
from jax_efc import compile_ahead
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
def loss(x, w, b):
    return efc.fused_dense(x, w, b, activation="gelu").astype(jnp.float32).sum()
step = jax.jit(jax.grad(loss, (0, 1, 2)))
specs = S((2048, 1536), bf), S((1536, 1536), bf), S((1536,), bf)
if sys.argv[1] == "broken":  # every worker dies at once: the lowering compiles the kernels itself
    compile_ahead._spawn = lambda arch: __import__("subprocess").Popen(
        [sys.executable, "-c", "pass"], text=True, stdin=-1, stdout=-1)
else:
    import cutlass.cute
    def compile(*args, **kwargs):
        raise RuntimeError("the DSL compiled a kernel in the tracing process")
    cutlass.cute.compile = compile
exported = jax.export.export(step, platforms=["cuda"], disabled_checks=efc.export_checks())(*specs)
outcomes = sorted(f.result() for f in compile_ahead._started.values())
print(json.dumps({"kernels": exported.mlir_module().count("custom_call @CuteDSLRT"), "outcomes": outcomes}))
"""


_AHEAD_GROUPED = """
import json
import jax, jax.numpy as jnp
import jax_efc as efc
from jax_efc import compile_ahead
import cutlass.cute
def compile(*args, **kwargs):
    raise RuntimeError("the DSL compiled a kernel in the tracing process")
cutlass.cute.compile = compile
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
def loss(x, w, s, b):
    return efc.grouped_gemm(x, w, s, lambda acc, b: jax.nn.silu(acc + b), group_operands=[b]).sum()
step = jax.jit(jax.grad(loss, (0, 1, 3)))
specs = S((1024, 256), bf), S((4, 256, 384), bf), S((4,), jnp.int32), S((4, 384), jnp.float32)
exported = jax.export.export(step, platforms=["cuda"], disabled_checks=efc.export_checks())(*specs)
outcomes = sorted(f.result() for f in compile_ahead._started.values())
print(json.dumps({"kernels": exported.mlir_module().count("custom_call @CuteDSLRT"), "outcomes": outcomes}))
"""


def test_grouped_kernels_compile_ahead_too(tmp_path):
    """A grouped GEMM's kernels (its forward, its lhs gradient and its weight gradient) are built
    by the workers while the step is traced, as dense ones are: the tracing process's DSL
    compile never runs. (The workers also build the linearised tangent product, which grad
    transposes away.)"""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_AHEAD_GROUPED, JAX_EFC_CACHE_DIR=str(tmp_path), JAX_EFC_KERNEL_CACHE="1",
                                  JAX_EFC_COMPILE_AHEAD="1").strip().splitlines()[-1])
    assert out["kernels"] == 3 and out["outcomes"] == ["compiled"] * 4, out


@pytest.mark.parametrize("workers", ["working", "broken"])
def test_kernels_compile_ahead_while_the_program_is_traced(tmp_path, workers):
    """With compiling ahead on, a training step's three kernels are built by worker processes
    while the step is traced: the lowering's own DSL compile never runs, and every kernel is
    in the module. Where the workers fail, the lowering compiles the kernels itself."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_AHEAD, workers, JAX_EFC_CACHE_DIR=str(tmp_path), JAX_EFC_KERNEL_CACHE="1",
                                  JAX_EFC_COMPILE_AHEAD="1").strip().splitlines()[-1])
    assert out["kernels"] == 3
    if workers == "working":
        assert out["outcomes"] == ["compiled"] * 3, out
    else:
        assert len(out["outcomes"]) == 3 and all(o.startswith("failed (worker exited") for o in out["outcomes"])
    assert len(list((tmp_path / "kernels").glob("*.kernel"))) == 3


def test_warmup_says_what_it_needs(monkeypatch):
    """Without a GPU warmup needs a target architecture; with the kernel cache off it has
    nowhere to put the kernels: each a RuntimeError saying so, nothing compiled."""
    import jax.numpy as jnp

    import jax_efc as efc

    spec = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(RuntimeError, match="set_target_arch"):
        efc.warmup(lambda a, b: efc.gemm(a, b), spec, spec)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_EFC_KERNEL_CACHE", "0")
    with pytest.raises(RuntimeError, match="JAX_EFC_KERNEL_CACHE=0 turns off"):
        efc.warmup(lambda a, b: efc.gemm(a, b), spec, spec)
