"""The Flax modules' ``fp8=`` option: delayed scaling against Flax's own FP8 Dense step by step
(the same variable tree, so its checkpoints load unchanged), current scaling against a float64
oracle, the MLPs against ``fp8_dense`` composed by hand, nnx's state, and the errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import jax_efc as efc
from jax_efc.flax.linen import FusedDense, FusedMLP
from jax_efc.flax.nnx import FusedLinear, OverwriteWithGradient
from jax_efc.flax.nnx import FusedMLP as NnxFusedMLP

from test_fp8_dense import ACTS, _FlaxMlp, _meta, _q, _scale

OWG = "_overwrite_with_gradient"
E4M3 = ml_dtypes.float8_e4m3fn


def _normal(rng, shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _random_meta(rng, length):
    """A meta part way through training: random amaxes in each history, scales not one."""
    def history():
        return jnp.asarray(rng.uniform(0.5, 4.0, length), jnp.float32)

    def scale():
        return jnp.asarray(rng.uniform(0.005, 0.02, 1), jnp.float32)

    return efc.Fp8Meta(scale(), history(), scale(), history(), scale(), history())


def _shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def _assert_close(got, want, rtol, what=""):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=0,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


class _FusedPair(nn.Module):
    """``_FlaxMlp`` (two FP8 nn.Dense layers, ``up`` and ``down``) made of FusedDense."""

    @nn.compact
    def __call__(self, x):
        h = FusedDense(128, activation="gelu_tanh", fp8="delayed", name="up")(x)
        return FusedDense(64, fp8="delayed", name="down")(h)


# linen ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ours", [_FusedPair(), FusedMLP(128, 64, activation="gelu_tanh", fp8="delayed")],
                         ids=["FusedDense", "FusedMLP"])
def test_delayed_scaling_trains_as_flax_fp8_dense(rng, ours):
    """From the same variables (a Flax FP8 model's, scales and histories part way through
    training), four SGD steps of the Flax model and of ours, each overwriting the
    ``_overwrite_with_gradient`` collection with its gradient: the same variable tree, outputs,
    losses, scales and amax histories."""
    x, t = _normal(rng, (32, 96), 2.0), _normal(rng, (32, 64))
    flax_model = _FlaxMlp()
    variables = flax_model.init(jax.random.key(0), x)
    initial = ours.init(jax.random.key(0), x)
    assert _shapes(initial) == _shapes(variables)
    _assert_close(initial, variables, 0, "init")  # the same key, the same values
    variables = {"params": variables["params"],
                 OWG: {name: {"Fp8DirectDotGeneralOp_0": _random_meta(rng, 1024)._asdict()} for name in ("up", "down")}}
    _assert_close(ours.apply(variables, x), flax_model.apply(variables, x), 1e-5, "outputs")

    def sgd_step(model, v):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - t) ** 2))(v)
        return loss, {"params": jax.tree.map(lambda p, g: p - 0.05 * g, v["params"], grads["params"]), OWG: grads[OWG]}

    theirs = mine = variables
    for step in range(4):
        want, theirs = sgd_step(flax_model, theirs)
        got, mine = sgd_step(ours, mine)
        assert abs(float(got) - float(want)) <= 1e-4 * float(want), step
        _assert_close(mine[OWG], theirs[OWG], 1e-5, f"step {step}")
        _assert_close(mine["params"], theirs["params"], 1e-3, f"step {step}")
    for name in ("up", "down"):
        meta = _meta(mine[OWG][name])
        assert float(meta.input_amax_history[0]) > 0 and float(meta.kernel_scale[0]) != 1.0, name


def _plain_model(dense):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return dense(16)(jax.nn.relu(dense(48)(x)))

    return Model()


def test_a_flax_fp8_checkpoint_loads_unchanged(rng):
    """Unnamed layers take nn.Dense's names (``Dense_0``) and keep their state under
    ``Fp8DirectDotGeneralOp_0``: a Flax FP8 model's serialized variables restore into the
    FusedDense model as they are, with its history length, and give the same outputs."""
    x = _normal(rng, (8, 24), 3.0)
    short = functools.partial(nn.Fp8DirectDotGeneralOp, amax_history_length=16)
    flax_model = _plain_model(lambda f: nn.Dense(f, dot_general_cls=short))
    ours = _plain_model(lambda f: FusedDense(f, fp8="delayed", amax_history_length=16))
    variables = flax_model.init(jax.random.key(3), x)
    variables = {**variables, OWG: jax.tree.map(lambda v: v + jnp.asarray(rng.uniform(0.01, 2.0, v.shape), v.dtype),
                                                variables[OWG])}
    assert set(variables[OWG]) == {"Dense_0", "Dense_1"}
    blob = serialization.to_bytes(variables)
    template = ours.init(jax.random.key(4), x)
    assert _shapes(template) == _shapes(variables)
    restored = serialization.from_bytes(template, blob)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_close(ours.apply(restored, x), flax_model.apply(variables, x), 1e-5)


def _current_oracle(x, kernel, bias, activation):
    """``activation(x @ kernel + bias)`` on x and kernel quantised to e4m3 by their own amax, in
    float64."""
    x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    w = np.asarray(kernel, np.float64)
    xq, wq = _q(x2, E4M3, _scale(x2, E4M3)), _q(w, E4M3, _scale(w, E4M3))
    return ACTS[activation][0](xq @ wq + np.asarray(bias, np.float64)).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_current_scaling_against_the_quantised_oracle(rng, activation, dtype):
    x = _normal(rng, (3, 20, 64), 3.0)
    kw = dict(activation=activation, dtype=dtype, bias_init=nn.initializers.normal(1.0))
    linen_layer = FusedDense(40, fp8="current", **kw)
    variables = linen_layer.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # current scaling keeps no state
    nnx_layer = FusedLinear(64, 40, fp8="current", rngs=nnx.Rngs(0), **kw)
    nnx.update(nnx_layer, variables["params"])
    p = jax.tree.map(lambda v: v.astype(dtype), variables["params"])  # the layers' dtype promotion
    want = _current_oracle(x.astype(dtype), p["kernel"], p["bias"], activation)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    outs = [linen_layer.apply(variables, x), nnx_layer(x)]
    for y in outs:
        assert y.dtype == dtype and y.shape == (3, 20, 40)
        assert np.abs(np.asarray(y, np.float64) - want).max() <= tol * np.abs(want).max()
    # an FP8 result, not the unquantised layer's
    p64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
    exact = ACTS[activation][0](np.asarray(x.astype(dtype), np.float64) @ p64["kernel"] + p64["bias"])
    assert np.abs(np.asarray(outs[0], np.float64) - exact).max() > 1e-3 * np.abs(exact).max()


# the MLPs, linen and nnx, against fp8_dense composed by hand ---------------------------------

def _composed_mlp(x, p, metas, *, activation, gated):
    """The MLP as jax_efc's own FP8 ops: ``fp8_mlp``, or gated ``act(x@Wg+bg) * (x@Wu+bu)`` as
    ``fp8_dense`` calls, then the down projection; ``metas`` by layer name, None for current
    scaling."""
    def layer(name, h, act=None):
        return efc.fp8_dense(h, p[name]["kernel"], p[name]["bias"], activation=act, meta=metas[name])

    if not gated:
        return efc.fp8_mlp(x, p["up"]["kernel"], p["up"]["bias"], p["down"]["kernel"], p["down"]["bias"],
                           activation=activation, up_meta=metas["up"], down_meta=metas["down"])
    return layer("down", layer("gate", x, activation) * layer("up", x))


def _linen_mlp(x, gated, fp8, activation, metas):
    """(the output as a function of params and metas, params, metas by layer name) of a linen
    FusedMLP."""
    mlp = FusedMLP(48, activation=activation, gated=gated, fp8=fp8, amax_history_length=8)
    variables = mlp.init(jax.random.key(1), x)
    variables = {**variables, "params": jax.tree.map(lambda v: v + 0.1, variables["params"])}  # non-zero biases
    names = list(variables["params"])
    metas = dict.fromkeys(names) if fp8 == "current" else {name: metas[name] for name in names}

    def apply(params, metas):
        v = {"params": params}
        if fp8 == "delayed":
            v[OWG] = {name: {"Fp8DirectDotGeneralOp_0": m._asdict()} for name, m in metas.items()}
        return mlp.apply(v, x)

    return apply, variables["params"], metas


def _nnx_mlp(x, gated, fp8, activation, metas):
    """The same for nnx's FusedMLP, its state split off and merged back in."""
    mlp = NnxFusedMLP(16, 48, activation=activation, gated=gated, fp8=fp8, amax_history_length=8,
                      bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
    names = list(params)
    metas = dict.fromkeys(names) if fp8 == "current" else {name: metas[name] for name in names}

    def apply(params, metas):
        graphdef, p_state, o_state, rest = nnx.split(mlp, nnx.Param, OverwriteWithGradient, ...)
        nnx.replace_by_pure_dict(p_state, params)
        if fp8 == "delayed":
            nnx.replace_by_pure_dict(o_state, {name: {"fp8_meta": m._asdict()} for name, m in metas.items()})
        return nnx.merge(graphdef, p_state, o_state, rest)(x)

    return apply, params, metas


@pytest.mark.parametrize("make", [_linen_mlp, _nnx_mlp], ids=["linen", "nnx"])
@pytest.mark.parametrize("fp8", ["current", "delayed"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_mlp_runs_jax_efcs_fp8_ops(rng, make, fp8, gated):
    x = _normal(rng, (4, 6, 16), 2.0)
    activation = "silu" if gated else "gelu_tanh"
    metas = {name: _random_meta(rng, 8) for name in ("up", "gate", "down")}
    apply, params, metas = make(x, gated, fp8, activation, metas)
    composed = functools.partial(_composed_mlp, x, activation=activation, gated=gated)
    _assert_close(apply(params, metas), composed(params, metas), 1e-5, "outputs")
    g_params, g_metas = jax.grad(lambda p, m: jnp.sum(jnp.sin(apply(p, m))), (0, 1))(params, metas)
    w_params, w_metas = jax.grad(lambda p, m: jnp.sum(jnp.sin(composed(p, m))), (0, 1))(params, metas)
    _assert_close(g_params, w_params, 1e-5, "params")
    if fp8 == "delayed":
        _assert_close(g_metas, w_metas, 1e-6, "metas")
        assert float(g_metas["down"].output_grad_amax_history[0]) > 0
    assert "f8_e4m3fn" in str(jax.make_jaxpr(apply)(params, metas))


def test_without_fp8_the_mlp_is_still_fused_mlp(rng, monkeypatch):
    import jax_efc.flax.dense as shared

    calls = []
    monkeypatch.setattr(shared, "fused_mlp", lambda *a, **k: calls.append(k["activation"]) or a[0])
    x = _normal(rng, (4, 16))
    mlp = FusedMLP(32, activation="silu", gated=True)
    mlp.apply(mlp.init(jax.random.key(0), x), x)
    NnxFusedMLP(16, 32, activation="relu", rngs=nnx.Rngs(0))(x)
    assert calls == ["silu", "silu", "relu"]  # linen's init and apply, nnx's call


# nnx -----------------------------------------------------------------------------------------

def test_nnx_state_layout():
    """Delayed scaling's state: Fp8Meta's fields as OverwriteWithGradient variables under
    ``fp8_meta``, the nnx type of linen's collection (so nnx.bridge maps one onto the other);
    the parameters stay nnx.Linear's."""
    layer = FusedLinear(24, 40, fp8="delayed", amax_history_length=16, rngs=nnx.Rngs(0))
    state = nnx.state(layer, OverwriteWithGradient)
    assert _shapes(nnx.to_pure_dict(state)) == {"fp8_meta": {f: (1,) if f.endswith("scale") else (16,)
                                                          for f in efc.Fp8Meta._fields}}
    for got, want in zip(layer.meta(), efc.Fp8Meta.init(16)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _shapes(nnx.to_pure_dict(nnx.state(layer, nnx.Param))) == {"kernel": (24, 40), "bias": (40,)}
    assert nnx.variablelib.variable_type_from_name(OWG) is OverwriteWithGradient
    assert FusedLinear(24, 40, fp8="current", rngs=nnx.Rngs(0)).fp8_meta is None
    bridged = nnx.bridge.ToNNX(nn.Dense(40, dot_general_cls=nn.Fp8DirectDotGeneralOp), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(bridged, jnp.ones((2, 24)))
    assert isinstance(bridged.Fp8DirectDotGeneralOp_0["input_scale"], OverwriteWithGradient)


def test_nnx_delayed_scaling_trains_as_flax_fp8_dense(rng):
    """FusedLinear(fp8="delayed") loaded with a Flax FP8 Dense's parameters and state, four SGD
    steps each (nnx: nnx.Optimizer on the parameters, the OverwriteWithGradient variables
    replaced by their gradient): the same losses, scales and amax histories."""
    x, t = _normal(rng, (32, 96), 2.0), _normal(rng, (32, 64))
    dense = nn.Dense(64, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    variables = dense.init(jax.random.key(0), x)
    variables = {"params": variables["params"], OWG: {"Fp8DirectDotGeneralOp_0": _random_meta(rng, 1024)._asdict()}}
    layer = FusedLinear(96, 64, activation="gelu_tanh", fp8="delayed", rngs=nnx.Rngs(5))
    nnx.update(layer, {**variables["params"], "fp8_meta": variables[OWG]["Fp8DirectDotGeneralOp_0"]})
    opt = nnx.Optimizer(layer, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(layer, opt):
        diff = nnx.DiffState(0, (nnx.Param, OverwriteWithGradient))
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - t) ** 2), argnums=diff)(layer)
        params, metas = nnx.split_state(grads, nnx.Param, OverwriteWithGradient)
        opt.update(layer, params)
        nnx.update(layer, metas)
        return loss

    @jax.jit
    def flax_step(v):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean((jax.nn.gelu(dense.apply(v, x)) - t) ** 2))(v)
        return loss, {"params": jax.tree.map(lambda p, g: p - 0.05 * g, v["params"], grads["params"]), OWG: grads[OWG]}

    for step in range(4):
        want, variables = flax_step(variables)
        got = nnx_step(layer, opt)
        assert abs(float(got) - float(want)) <= 1e-4 * float(want), step
        _assert_close(layer.meta(), _meta(variables[OWG]), 1e-5, f"step {step}")
    assert float(layer.fp8_meta.output_grad_scale[...][0]) != 1.0


# errors --------------------------------------------------------------------------------------

_BAD_FP8 = r"fp8 must be one of None, 'current', 'delayed'; got 'e4m3'"
_EPILOGUE = r"fp8='current' supports activation= only, not a custom epilogue="
_HISTORY = r"amax_history_length must be a positive int, got 0"


@pytest.mark.parametrize("make, match", [
    (lambda: FusedDense(8, fp8="e4m3"), _BAD_FP8),
    (lambda: FusedDense(8, fp8="current", epilogue=lambda z: z), _EPILOGUE),
    (lambda: FusedDense(8, fp8="delayed", amax_history_length=0), _HISTORY),
    (lambda: FusedMLP(8, fp8="e4m3"), _BAD_FP8),
    (lambda: FusedMLP(8, fp8="delayed", amax_history_length=0), _HISTORY),
    (lambda: FusedLinear(4, 8, fp8="e4m3", rngs=nnx.Rngs(0)), _BAD_FP8),
    (lambda: FusedLinear(4, 8, fp8="current", epilogue=lambda z: z, rngs=nnx.Rngs(0)), _EPILOGUE),
    (lambda: FusedLinear(4, 8, fp8="delayed", amax_history_length=0, rngs=nnx.Rngs(0)), _HISTORY),
    (lambda: NnxFusedMLP(4, 8, fp8="e4m3", rngs=nnx.Rngs(0)), _BAD_FP8),
    (lambda: NnxFusedMLP(4, 8, fp8="delayed", amax_history_length=0, rngs=nnx.Rngs(0)), _HISTORY),
])
def test_bad_fp8_arguments_fail_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_fp8_layer_given_extra_operands_says_it_has_no_epilogue(rng):
    x = _normal(rng, (4, 8))
    layer = FusedDense(8, fp8="current")
    with pytest.raises(TypeError, match="no epilogue"):
        layer.init(jax.random.key(0), x, x)
