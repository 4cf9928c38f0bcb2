"""The kernels' epilogue rewrites (``jax_efc.kernels.rewrite``), checked on the CPU with the
reference evaluator: a rewritten program computes the same outputs, as accurately in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_efc.epilogue import evaluate
from jax_efc.tracing import trace_epilogue
from jax_efc.kernels.rewrite import rewrite


def _trace(fn, n_ops=0):
    ir, *_ = trace_epilogue(fn, (64, 96), [(1, 96)] * n_ops, [jnp.bfloat16] * n_ops, {}, {},
                            jnp.bfloat16, jnp.bfloat16)
    return ir


def _cone(ir, name):
    """The instruction values output ``name`` depends on, in program order."""
    (out,) = [o for o in ir.outputs if o.name == name]
    return sorted(v for v in ir.with_outputs([out]).live() if v >= len(ir.inputs))


def _gelu_tanh64(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_gelu_tanh_in_a_larger_epilogue():
    # jax.nn.gelu's default (tanh) form next to outputs that share its argument and compute
    # the same x**3 and tanh: only the GELU is rewritten, every output keeps its value
    def fn(acc, bias):
        x = acc + bias
        return {"D": jax.nn.gelu(x), "Y": x**3, "Z": jnp.tanh(x) * 2.0}

    ir = _trace(fn, 1)
    new = rewrite(ir)
    assert [i.op for i in new.instrs].count("tanh") == 2
    assert [new.instrs[v - 2].op for v in _cone(new, "D")].count("integer_pow") == 0
    assert [new.instrs[v - 2].op for v in _cone(new, "Y")] == ["add", "integer_pow"]
    rng = np.random.default_rng(0)
    acc = jnp.asarray(rng.standard_normal((64, 96)) * 3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 96)), jnp.bfloat16)
    for o, want, got in zip(ir.outputs, evaluate(ir, acc, [bias]), evaluate(new, acc, [bias])):
        w, g = np.asarray(want, np.float64), np.asarray(got, np.float64)
        assert np.abs(w - g).max() <= 1e-2 * np.abs(w).max(), o.name  # bf16 outputs: an ulp at most


def test_gelu_tanh_as_exact_as_jax_nn_in_fp32():
    # fp32 outputs: the rewritten form is as close to the float64 function as jax.nn.gelu's own
    # fp32 evaluation, over the range and both tails
    ir, *_ = trace_epilogue(jax.nn.gelu, (110_001,), [], [], {}, {}, jnp.float32, jnp.float32)
    new = rewrite(ir)
    assert "integer_pow" not in [i.op for i in new.instrs]
    rng = np.random.default_rng(1)
    x = jnp.asarray(np.concatenate([rng.standard_normal(100_000) * 3, np.linspace(-30, 30, 10_001)]),
                    jnp.float32)
    truth = _gelu_tanh64(np.asarray(x, np.float64))
    scale = np.maximum(np.abs(truth), 1.0)
    (ours,), (theirs,) = evaluate(new, x, []), evaluate(ir, x, [])
    ours_err = (np.abs(np.asarray(ours, np.float64) - truth) / scale).max()
    theirs_err = (np.abs(np.asarray(theirs, np.float64) - truth) / scale).max()
    assert ours_err <= 1.25 * theirs_err + 1e-7, (ours_err, theirs_err)


@pytest.mark.parametrize("fn", [
    lambda acc: 0.5 * acc * (1 + jnp.tanh(0.79788456 * (acc + 0.04 * acc**3))),  # another constant
    lambda acc: jax.nn.gelu(acc, approximate=False),  # the erf form
    lambda acc: acc * jax.nn.sigmoid(acc),
])
def test_other_programs_are_left_alone(fn):
    ir = _trace(fn)
    assert rewrite(ir) == ir
