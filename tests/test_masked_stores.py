"""In-place outputs stored only where a mask holds: ``jnp.where(mask, new, c)`` written over c
(``inplace``). The IR marks them (``Output.mask``) where nothing else reads c; the reference
gives ``where(mask, new, c)`` under donation, autodiff and vmap; the kernel, which stores them
with predicated global stores and never loads c, is checked on first use until it has run on a
GPU."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import run_for_sm90


def _relu_over(acc, c):
    return jnp.where(acc > 0, acc * 2.0, c)


def _keep_where_zero(acc, c, keep):
    return jnp.where(keep != 0, c, acc - 1.0)


def _arrays(rng, m=96, n=80, k=64, dtype=jnp.float32):
    a, b = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((m, k), (k, n)))
    c = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return a, b, c, np.asarray(a, np.float64) @ np.asarray(b, np.float64)


def test_a_masked_output_over_its_donated_operand_is_where_of_it(rng):
    """Against a float64 oracle: the new values where the mask holds, c's elsewhere, written in
    c's own donated buffer (a mask from the accumulator, or negated from an operand)."""
    a, b, c, acc = _arrays(rng)
    step = jax.jit(lambda a, b, c: efc.gemm(a, b, _relu_over, c, inplace=0), donate_argnums=2)
    want = np.where(acc > 0, acc * 2, np.asarray(c))
    donated = jnp.array(c)
    where = donated.unsafe_buffer_pointer()
    y = step(a, b, donated)
    assert y.unsafe_buffer_pointer() == where and donated.is_deleted()
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    keep = jnp.asarray(rng.random((96, 80)) < 0.5, jnp.float32)
    masked = jax.jit(lambda a, b, c, k: efc.gemm(a, b, _keep_where_zero, c, k, inplace=0), donate_argnums=2)
    y = masked(a, b, jnp.array(c), keep)
    np.testing.assert_allclose(np.asarray(y), np.where(np.asarray(keep) != 0, np.asarray(c), acc - 1),
                               rtol=1e-5, atol=1e-5)
    # bf16: where the mask is false, c's values exactly (NaN and infinities too)
    a16, b16, c16 = (x.astype(jnp.bfloat16) for x in (a, b, c))
    c16 = c16.at[::7].set(jnp.nan).at[1::7].set(-jnp.inf)
    y = jax.jit(lambda a, b, c: efc.gemm(a, b, _relu_over, c, inplace=0), donate_argnums=2)(a16, b16, jnp.array(c16))
    acc16 = np.asarray(a16, np.float64) @ np.asarray(b16, np.float64)
    kept = np.asarray(y, np.float32)[acc16 <= 0]
    np.testing.assert_array_equal(kept.view(np.uint32), np.asarray(c16, np.float32)[acc16 <= 0].view(np.uint32))


def _ir(fn, shapes, inplace=0, epi_dtype=None, dtype=jnp.bfloat16):
    from jax_efc.epilogue import with_masked_stores
    from jax_efc.tracing import trace_epilogue

    ir, *_ = trace_epilogue(fn, (128, 128), shapes, [dtype] * len(shapes), {}, {}, None, dtype,
                            *(() if epi_dtype is None else (epi_dtype,)))
    return with_masked_stores(ir.with_outputs([dataclasses.replace(o, inplace=inplace if k == 0 else None)
                                               for k, o in enumerate(ir.outputs)]))


@pytest.mark.parametrize("fn, shapes, masked", [
    (_relu_over, 1, True),  # a mask from the accumulator
    (lambda acc, c, m: jnp.where(m > 0.5, acc, c), 2, True),  # from an operand
    (_keep_where_zero, 2, True),  # negated: where(mask, c, new)
    (lambda acc, c: jnp.where(acc > 0, acc + c, c), 1, False),  # c read by the new value too
    (lambda acc, c: jnp.where(c > 0, acc, c), 1, False),  # by the mask
    (lambda acc, c: (jnp.where(acc > 0, acc, c), c * acc), 1, False),  # by another output
    (lambda acc, c: jnp.where(acc > 0, c, c), 1, False),
    (lambda acc, c: jnp.maximum(acc, c), 1, False),  # no where
])
def test_which_in_place_outputs_are_masked(fn, shapes, masked):
    """A where over the in-place output's own operand, which nothing else reads, is marked with
    its mask, and the kernel's program reads the operand no more; anything else that reads it
    keeps the plain in-place store."""
    from jax_efc.epilogue import masked_stores

    ir = _ir(fn, [(128, 128)] * shapes)
    assert (ir.outputs[0].mask is not None) == masked
    program = masked_stores(ir, [0])
    assert program.uses(1) != masked
    assert all(o.mask is None for o in masked_stores(ir, []).outputs)
    if masked:  # the mask is a boolean value of the program, negated where c is the true arm
        mask = ir.instrs[ir.outputs[0].mask - len(ir.inputs)]
        assert mask.dtype == "bool" and (mask.op == "not") == (fn is _keep_where_zero)


def test_an_operand_the_epilogue_dtype_rounds_is_not_masked():
    """c (float32) seen through a bfloat16 epilogue is rounded where it is kept: stored whole."""
    ir = _ir(_relu_over, [(128, 128)], epi_dtype=jnp.bfloat16, dtype=jnp.float32)
    assert ir.outputs[0].mask is None
    assert _ir(_relu_over, [(128, 128)], dtype=jnp.float32).outputs[0].mask is not None


def test_not_in_place_is_not_masked():
    assert _ir(_relu_over, [(128, 128)], inplace=None).outputs[0].mask is None


def test_the_cotangent_of_c_flows_where_it_is_kept(rng):
    """Differentiated, a masked output is where(mask, new, c): c's cotangent is the output's
    where the mask is false and zero where it holds; under vmap, the same per batch."""
    a, b, c, acc = _arrays(rng, 64, 48, 32)
    g = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(efc.gemm(a, b, _relu_over, c, inplace=0) * g)

    da, db, dc = jax.grad(loss, argnums=(0, 1, 2))(a, b, c)
    mask = acc > 0
    np.testing.assert_allclose(np.asarray(dc), np.where(mask, 0, np.asarray(g)), atol=1e-6)
    dacc = np.where(mask, 2 * np.asarray(g, np.float64), 0)
    np.testing.assert_allclose(np.asarray(da), dacc @ np.asarray(b, np.float64).T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(db), np.asarray(a, np.float64).T @ dacc, rtol=1e-4, atol=1e-4)
    cs = jnp.stack([c, -c])
    ys = jax.vmap(lambda c: efc.gemm(a, b, _relu_over, c, inplace=0))(cs)
    for y, cc in zip(ys, cs):
        np.testing.assert_allclose(np.asarray(y), np.where(mask, acc * 2, np.asarray(cc)), rtol=1e-5, atol=1e-5)


def test_masked_stores_are_checked_on_first_use_where_they_have_not_run(monkeypatch):
    """Hopper's masked stores have run on a GPU; Blackwell's have not, and a policy that does not
    mark them verified names them, so the plan checks them on first use (jax_efc.self_check); an
    operand shared across a batch is not aliased, and its output is stored whole."""
    pytest.importorskip("cutlass")
    from jax_efc.config import GemmConfig
    from jax_efc.kernels import policy
    from jax_efc.kernels.problem import KernelProblem
    from jax_efc.kernels.sm90_policy import Sm90Policy

    ir = _ir(_relu_over, [(128, 128)])
    problem = KernelProblem(ir, "bfloat16", "float32", "k", "n", False, False, False, (False,), "sm_90a",
                            GemmConfig())
    assert problem.aliased == ((0, 0),) and problem.masked == (0,)
    assert not problem.program.uses(1)
    assert policy("sm_90a").unverified_reason(problem) is None
    monkeypatch.setattr(Sm90Policy, "verified_masked_stores", False)
    assert policy("sm_90a").unverified_reason(problem) == \
        "the sm_90a kernel's outputs stored over their operands only where a mask holds"
    assert policy("sm_100a").unverified_reason(problem) is not None
    shared = dataclasses.replace(problem, batched=True, a_batched=True)
    assert shared.masked == () and shared.program.uses(1) and policy("sm_90a").unverified_reason(shared) is None


_EXPORT = """
import json, re
import jax, jax.numpy as jnp
import jax_efc as efc
S = jax.ShapeDtypeStruct
a, b, c = S((2000, 1024), jnp.bfloat16), S((1024, 1000), jnp.bfloat16), S((2000, 1000), jnp.bfloat16)
fn = lambda a, b, c: efc.gemm(a, b, lambda acc, c: jnp.where(acc > 0, acc, c), c, inplace=0)
text = jax.export.export(jax.jit(fn, donate_argnums=2), platforms=["cuda"],
                         disabled_checks=efc.export_checks())(a, b, c).mlir_module()
call = [l for l in text.splitlines() if "CuteDSLRT" in l]
print(json.dumps({"backends": efc.backends(fn, a, b, c), "calls": len(call),
                  "aliases": re.findall(r"operand_index = (\\d+)", "".join(call))}))
"""


def test_an_export_from_a_cpu_holds_the_kernel():
    """Hopper's masked stores have run on a GPU, so an export for sm_90a from a CPU machine holds
    the kernel, its output aliasing c."""
    pytest.importorskip("cutlass.jax")
    out = json.loads(run_for_sm90(_EXPORT, JAX_EFC_UNVERIFIED_KERNELS="0").strip().splitlines()[-1])
    assert out["backends"] == ["kernel (sm_90a)"] and out["calls"] == 1 and out["aliases"] == ["2"], out


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, efc.GemmConfig(128, 128, 1, 2, pingpong=True),
                                    efc.GemmConfig(128, 256, 2, 1)], ids=["heuristic", "pingpong", "coop"])
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 1024), (1000, 3000, 520)])
@pytest.mark.parametrize("negated", [False, True], ids=["mask", "negated"])
def test_the_kernel_stores_only_where_the_mask_holds(rng, monkeypatch, config, m, n, k, negated):
    """On the GPU, donated: where the mask is false c keeps its bits exactly (poisoned with NaN
    and a pattern the kernel would never compute), where it holds the new values; partial tiles
    and both schedules; the output is c's buffer."""
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    keep = jnp.asarray(rng.random((m, n)) < 0.5, jnp.bfloat16)
    bits = np.where(rng.random((m, n)) < 0.5, 0x7FC1, 0x1234).astype(np.uint16)  # a NaN payload, a tiny value
    c = jnp.asarray(bits.view(jnp.bfloat16))

    def epilogue(acc, c, keep):
        return jnp.where(keep != 0, c, acc * 0.5) if negated else jnp.where(keep == 0, acc * 0.5, c)

    call = lambda a, b, c, keep: efc.gemm(a, b, epilogue, c, keep, inplace=0, config=config)  # noqa: E731
    assert efc.backends(call, a, b, c, keep)[0].startswith("kernel")
    f = jax.jit(call, donate_argnums=2)
    where = c.unsafe_buffer_pointer()
    y = f(a, b, c, keep)
    assert y.unsafe_buffer_pointer() == where
    got = np.asarray(y).view(np.uint16)
    held = np.asarray(keep) != 0
    np.testing.assert_array_equal(got[held], bits[held])
    want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * 0.5
    new = np.asarray(y, np.float64)[~held]
    err = np.linalg.norm(new - want[~held]) / np.linalg.norm(want[~held])
    assert err < 1e-2, err
