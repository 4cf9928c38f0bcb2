"""examples/moe.py's layer: grouped_gemm experts against ragged_dot ones, and expert parallelism
over 8 host devices (all_to_all in shard_map) against one device, forward and gradients, for
balanced, skewed and empty expert loads."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

_spec = importlib.util.spec_from_file_location(
    "moe_example", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "moe.py"))
moe = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe)

TOKENS, WIDTH, HIDDEN, EXPERTS, DEVICES = 64, 16, 24, 16, 8


def _setup(rng, load):
    """A layer's parameters and tokens; the router biased (through an always-on feature of the
    tokens) so that ``load`` holds."""
    model = moe.MoE(EXPERTS, HIDDEN, top_k=2)
    x = rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)
    x[:, 0] = 1.0
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), x)["params"])
    params = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.1 for k, v in params.items()}
    bias = params["router"][0]
    if load == "skewed":  # most copies to device 0's two experts
        bias[:2] += 2.0
    elif load == "one_device":  # every copy to device 0: the other devices get none
        bias[:2] += 30.0
    elif load == "empty_experts":  # only every third expert gets any
        bias[np.arange(EXPERTS) % 3 != 0] -= 30.0
    return model, {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x)


def _results(model, params, x):
    @jax.jit
    def run(params, x):
        f = lambda p, x: model.apply({"params": p}, x)
        loss = lambda p, x: jnp.sum(jnp.sin(f(p, x)) * jnp.arange(WIDTH))
        return f(params, x), jax.grad(loss, (0, 1))(params, x)

    return run(params, x)


def _loads(model, params, x):
    """How many token copies each expert gets."""
    _, expert, _ = moe._sort_by_expert(x, params["router"], model.top_k)
    return np.bincount(np.asarray(expert), minlength=EXPERTS)


def _assert_close(got, want, tol):
    for path, a, b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-30), jax.tree_util.keystr(path[0])


LOADS = ["balanced", "skewed", "one_device", "empty_experts"]


@pytest.mark.parametrize("load", LOADS)
def test_expert_parallel_matches_one_device(rng, load):
    model, params, x = _setup(rng, load)
    counts = _loads(model, params, x)
    per_device = counts.reshape(DEVICES, -1).sum(1)
    assert {"balanced": counts.min() > 0, "skewed": per_device[0] > per_device.sum() / 2,
            "one_device": per_device[0] == counts.sum(), "empty_experts": (counts == 0).sum() >= EXPERTS // 2}[load]
    mesh = jax.make_mesh((DEVICES,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    _assert_close(_results(model.clone(mesh=mesh), params, x), _results(model, params, x), 1e-5)


@pytest.mark.parametrize("load", ["balanced", "empty_experts"])
def test_grouped_gemm_experts_match_ragged_dot(rng, load):
    model, params, x = _setup(rng, load)
    _assert_close(_results(model, params, x), _results(model.clone(implementation="ragged_dot"), params, x), 1e-5)


def test_expert_parallel_sends_tokens_by_all_to_all(rng):
    model, params, x = _setup(rng, "balanced")
    mesh = jax.make_mesh((DEVICES,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    hlo = jax.jit(lambda p, x: model.clone(mesh=mesh).apply({"params": p}, x)).lower(params, x).as_text()
    assert hlo.count("all_to_all") >= 2 and "all_gather" not in hlo
