"""Outputs written over tile operands (``inplace``): the same results, the alias in the kernel's
custom call, and errors naming what cannot be written in place."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_efc as efc
from conftest import run_for_sm90


def _accumulate(acc, c, *, beta):
    return c * beta + acc


def test_an_output_written_over_its_operand_has_the_same_value(rng):
    a = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((64, 80)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((96, 80)), jnp.float32)
    want = np.asarray(c) * 0.5 + np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    step = jax.jit(lambda a, b, c: efc.gemm(a, b, _accumulate, c, beta=0.5, inplace=0), donate_argnums=2)
    np.testing.assert_allclose(np.asarray(step(a, b, jnp.array(c))), want, rtol=1e-5, atol=1e-5)
    out = efc.gemm(a, b, lambda acc, c, r: {"D": acc + c, "R": jnp.maximum(acc, r)}, c, c * 2, inplace={"R": 1})
    np.testing.assert_allclose(np.asarray(out["R"]), np.maximum(want - np.asarray(c) * 0.5, np.asarray(c) * 2),
                               rtol=1e-5, atol=1e-5)
    x, w, r = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 24, 64), (64, 64), (4, 24, 64)))
    y = jax.jit(lambda x, w, r: efc.fused_dense(x, w, residual=r, activation="relu", inplace=True),
                donate_argnums=2)(x, w, jnp.array(r))
    np.testing.assert_allclose(np.asarray(y), np.maximum(np.asarray(x) @ np.asarray(w), 0) + np.asarray(r),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(inplace={"Q": 0}), r"inplace: no output 'Q'; the epilogue returns \['D', 'Y'\]"),
    (dict(inplace={"D": 3}), r"inplace\['D'\] = 3: an operand's index, 0 to 1"),
    (dict(inplace={"D": 1}), r"output 'D' \(float32\(64, 48\)\) cannot be written over operand 1 \(float32\(1, 48\)\)"),
    (dict(inplace={"Y": 0}), r"output 'Y' \(bfloat16\(64, 48\)\) cannot be written over operand 0 \(float32"),
    (dict(inplace={"D": 0, "D2": 0}), "no output 'D2'"),
    (dict(inplace=0), "the epilogue returns 2 outputs; give {output: operand index}"),
])
def test_what_cannot_be_written_in_place_is_named(rng, kw, match):
    a, b = jnp.ones((64, 32)), jnp.ones((32, 48))
    c, bias = jnp.ones((64, 48)), jnp.ones(48)
    with pytest.raises((ValueError, TypeError), match=match):
        efc.gemm(a, b, lambda acc, c, bias: {"D": acc + c + bias, "Y": acc}, c, bias,
                 out_dtypes={"D": jnp.float32, "Y": jnp.bfloat16}, **kw)


def test_reductions_and_what_follows_them_are_not_written_in_place():
    a, b, c = jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((64, 48))
    with pytest.raises(ValueError, match="output '0' is a reduction, or computed after one by XLA"):
        efc.gemm(a, b, lambda acc, c: acc / jnp.sum(acc) + c, c, inplace=0)
    with pytest.raises(ValueError, match="inplace=True writes the result over residual"):
        efc.fused_dense(jnp.ones((4, 32)), jnp.ones((32, 16)), inplace=True)


_EXPORT = """
import json, re
import jax, jax.numpy as jnp
import jax_efc as efc
S = jax.ShapeDtypeStruct
a, b, c = S((2048, 1024), jnp.bfloat16), S((1024, 2048), jnp.bfloat16), S((2048, 2048), jnp.bfloat16)
out = {}
for name, inplace in (("inplace", 0), ("not", None)):
    f = jax.jit(lambda a, b, c: efc.gemm(a, b, lambda acc, c: c + acc, c, inplace=inplace), donate_argnums=2)
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=efc.export_checks())(a, b, c).mlir_module()
    call = [l for l in text.splitlines() if "CuteDSLRT" in l]
    out[name] = {"calls": len(call), "aliases": re.findall(r"operand_index = (\\d+)", "".join(call))}
print(json.dumps(out))
"""


def test_the_kernels_custom_call_aliases_the_operand():
    """Exported for sm_90a (unchecked: no GPU here to check it on first use): the custom call's
    output aliases the operand (input 2: after A and B), and not without ``inplace``."""
    out = json.loads(run_for_sm90(_EXPORT, JAX_EFC_UNVERIFIED_KERNELS="1").strip().splitlines()[-1])
    assert out["inplace"] == {"calls": 1, "aliases": ["2"]}, out
    assert out["not"] == {"calls": 1, "aliases": []}, out


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, efc.GemmConfig(128, 128, 1, 2, pingpong=True),
                                    efc.GemmConfig(128, 256, 2, 1)], ids=["heuristic", "pingpong", "coop"])
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 1024), (1000, 3000, 520)])
def test_the_kernel_writes_the_output_over_its_donated_operand(rng, monkeypatch, config, m, n, k):
    """On the GPU, donated: the output is the operand's buffer, and right (every subtile of the
    operand read before the output's is stored over it, the CTA's last tile's too)."""
    monkeypatch.setenv("JAX_EFC_STRICT", "1")
    a = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    want = np.asarray(c, np.float64) * 0.5 + np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    f = jax.jit(lambda a, b, c: efc.gemm(a, b, _accumulate, c, beta=0.5, inplace=0, config=config),
                donate_argnums=2)
    assert efc.backends(lambda a, b, c: efc.gemm(a, b, _accumulate, c, beta=0.5, inplace=0, config=config),
                        a, b, c)[0].startswith("kernel")
    where = c.unsafe_buffer_pointer()
    y = f(a, b, c)
    assert y.unsafe_buffer_pointer() == where
    err = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-2, err


def test_in_place_outputs_are_checked_on_first_use_until_they_have_run(monkeypatch):
    """The kernels store in-place outputs into their operand's tensor: verified on Hopper; a
    policy that has not run them says so, and a first-use check runs before it
    (jax_efc.self_check)."""
    pytest.importorskip("cutlass")
    from jax_efc.kernels.sm90_policy import Sm90Policy

    from jax_efc.config import GemmConfig
    from jax_efc.kernels import policy
    from jax_efc.kernels.problem import KernelProblem
    from jax_efc.tracing import trace_epilogue

    ir, *_ = trace_epilogue(lambda acc, c: c + acc, (256, 256), [(256, 256)], [jnp.bfloat16], {}, {}, None,
                            jnp.bfloat16)
    problem = KernelProblem(ir.with_outputs([dataclasses.replace(ir.outputs[0], inplace=0)]),
                            "bfloat16", "float32", "k", "n", False, False, False, (False,), "sm_90a", GemmConfig())
    assert problem.aliased == ((0, 0),)
    assert policy("sm_90a").unverified_reason(problem) is None
    monkeypatch.setattr(Sm90Policy, "verified_inplace", False)
    assert policy("sm_90a").unverified_reason(problem) == "the sm_90a kernel's outputs written over their operands"
    batched = KernelProblem(problem.ir, "bfloat16", "float32", "k", "n", True, True, False, (False,), "sm_90a",
                            GemmConfig())
    assert batched.aliased == ()  # the operand is shared across the batch: not the output's shape
