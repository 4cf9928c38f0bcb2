"""FusedDense (linen) and FusedLinear (nnx) are drop-ins for nn.Dense and nnx.Linear."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_efc as efc  # noqa: E402
from jax_efc.flax.linen import FusedDense, FusedMLP  # noqa: E402
from jax_efc.flax.nnx import FusedLinear  # noqa: E402
from jax_efc.flax.nnx import FusedMLP as NnxFusedMLP  # noqa: E402

from conftest import rel_err  # noqa: E402
from jax_efc.primitive import fused_gemm_eqns  # noqa: E402


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# linen ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_linen_params_match_dense(rng, use_bias, param_dtype):
    x = _normal(rng, (3, 5, 24))
    kw = dict(features=40, use_bias=use_bias, param_dtype=param_dtype,
              bias_init=nn.initializers.normal(1.0))  # non-zero, so the values are compared too
    key = jax.random.key(int(rng.integers(1 << 30)))
    _same_tree(FusedDense(**kw, activation="relu").init(key, x), nn.Dense(**kw).init(key, x))


@pytest.mark.parametrize("activation,plain", [(None, lambda z: z), ("relu", nn.relu),
                                              ("gelu_tanh", nn.gelu), (jnp.tanh, jnp.tanh)])
def test_linen_outputs_and_grads_match_dense(rng, activation, plain):
    x = _normal(rng, (2, 6, 32))
    dense = nn.Dense(48, bias_init=nn.initializers.normal(1.0))
    params = dense.init(jax.random.key(1), x)  # an nn.Dense checkpoint, loaded unchanged
    fused = FusedDense(48, activation=activation)

    def loss(apply, params, x):
        return jnp.sum(jnp.sin(apply(params, x)))

    ours = jax.value_and_grad(functools.partial(loss, fused.apply), argnums=(0, 1))(params, x)
    ref = jax.value_and_grad(functools.partial(loss, lambda p, x: plain(dense.apply(p, x))),
                             argnums=(0, 1))(params, x)
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert rel_err(o, r) < 1e-5


class _ScanBlock(nn.Module):
    """One layer of a stack that ``nn.scan`` repeats, an ``nn.Dense`` or its drop-in."""

    fused: bool

    @nn.compact
    def __call__(self, h, _):
        if self.fused:
            return FusedDense(32, activation="gelu_tanh", name="layer")(h), None
        return nn.gelu(nn.Dense(32, name="layer")(h)), None


def test_linen_layers_under_nn_scan_match_dense(rng):
    # nn.scan stacks each layer's kernel and bias along a leading axis, for FusedDense as for
    # nn.Dense: the same params, outputs and gradients
    x = _normal(rng, (6, 32))

    def stack(fused):
        return nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)(fused)

    params = stack(False).init(jax.random.key(2), x, None)
    _same_tree(stack(True).init(jax.random.key(2), x, None), params)

    def loss(fused, params, x):
        return jnp.sum(jnp.sin(stack(fused).apply(params, x, None)[0]))

    ours = jax.value_and_grad(functools.partial(loss, True), argnums=(0, 1))(params, x)
    ref = jax.value_and_grad(functools.partial(loss, False), argnums=(0, 1))(params, x)
    assert jax.tree.leaves(ours)[2].shape == (3, 32, 32)  # the kernels' gradient, stacked
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert rel_err(o, r) < 1e-5


def test_linen_remat_with_efc_policy_keeps_the_gemm(rng):
    """nn.remat with jax_efc's dots policy: the backward reuses the forward GEMM (three fused
    GEMMs in the gradient, as without remat), and the gradients match nn.Dense's."""
    x = _normal(rng, (8, 16))
    dense = nn.Dense(24)
    params = dense.init(jax.random.key(0), x)
    remat = nn.remat(FusedDense, policy=efc.checkpoint_policies.dots_saveable)(24, activation="gelu_tanh")
    grads = jax.grad(lambda p: jnp.sum(jnp.sin(remat.apply(p, x))))
    assert len(fused_gemm_eqns(jax.make_jaxpr(grads)(params))) == 3
    want = jax.grad(lambda p: jnp.sum(jnp.sin(jax.nn.gelu(dense.apply(p, x)))))(params)
    for o, r in zip(jax.tree.leaves(grads(params)), jax.tree.leaves(want)):
        assert rel_err(o, r) < 1e-5


@pytest.mark.parametrize("in_dtype,dtype", [(jnp.bfloat16, None), (jnp.float32, jnp.bfloat16),
                                            (jnp.bfloat16, jnp.bfloat16)])
def test_linen_dtype_promotion_matches_dense(rng, in_dtype, dtype):
    x = _normal(rng, (16, 32), in_dtype)
    dense = nn.Dense(64, dtype=dtype)
    params = dense.init(jax.random.key(0), x)
    y, ref = FusedDense(64, dtype=dtype).apply(params, x), dense.apply(params, x)
    assert y.dtype == ref.dtype
    assert rel_err(y, ref) < (1e-5 if ref.dtype == jnp.float32 else 1e-2)


def test_linen_epilogue_with_residual(rng):
    x, r = _normal(rng, (4, 8, 32)), _normal(rng, (4, 8, 16))
    dense = nn.Dense(16)
    params = dense.init(jax.random.key(0), x)
    gelu_residual = lambda z, r: jax.nn.gelu(z) + r  # noqa: E731
    y = FusedDense(16, epilogue=gelu_residual).apply(params, x, r)
    assert rel_err(y, jax.nn.gelu(dense.apply(params, x)) + r) < 1e-5
    # without a bias the epilogue sees the bare product; a row-vector operand broadcasts
    scale = _normal(rng, (16,))
    nobias = nn.Dense(16, use_bias=False)
    p2 = nobias.init(jax.random.key(1), x)
    y2 = FusedDense(16, use_bias=False, epilogue=lambda z, s: z * s).apply(p2, x, scale)
    assert rel_err(y2, nobias.apply(p2, x) * scale) < 1e-5


def test_linen_argument_errors(rng):
    x = _normal(rng, (4, 8))
    with pytest.raises(ValueError, match="unknown activation"):
        FusedDense(4, activation="swishy")
    with pytest.raises(ValueError, match="not both"):
        FusedDense(4, activation="relu", epilogue=lambda z: z).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="no epilogue"):
        FusedDense(4).init(jax.random.key(0), x, x)


def test_linen_logical_partitioning():
    x = jnp.ones((2, 8))
    boxed = FusedDense(16, kernel_axes=("embed", "mlp"), bias_axes=("mlp",)).init(jax.random.key(0), x)
    specs = nn.get_partition_spec(boxed)["params"]
    assert tuple(specs["kernel"]) == ("embed", "mlp") and tuple(specs["bias"]) == ("mlp",)
    plain = FusedDense(16).init(jax.random.key(0), x)["params"]
    assert not isinstance(plain["kernel"], nn.LogicallyPartitioned)
    _same_tree(nn.unbox(boxed), nn.Dense(16).init(jax.random.key(0), x))


def test_linen_training_matches_dense(rng):
    x, y = _normal(rng, (32, 16)), _normal(rng, (32, 8))

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))

    fused = FusedMLP(64, 8, activation="gelu_tanh")
    params = Plain().init(jax.random.key(0), x)
    _same_tree(fused.init(jax.random.key(0), x), params)

    def losses(model):
        opt = optax.adam(1e-2)
        p, state, out = params, opt.init(params), []

        @jax.jit
        def step(p, state):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
            updates, state = opt.update(g, state, p)
            return optax.apply_updates(p, updates), state, loss

        for _ in range(4):
            p, state, loss = step(p, state)
            out.append(float(loss))
        return np.array(out)

    ours, ref = losses(fused), losses(Plain())
    np.testing.assert_allclose(ours, ref, rtol=1e-4)
    assert ours[-1] < ours[0]


def test_linen_gated_mlp(rng):
    x = _normal(rng, (2, 4, 16))
    mlp = FusedMLP(32, activation="silu", gated=True)
    params = mlp.init(jax.random.key(0), x)
    p = params["params"]
    assert set(p) == {"up", "gate", "down"} and p["down"]["kernel"].shape == (32, 16)
    lin = lambda q, h: h @ q["kernel"] + q["bias"]  # noqa: E731
    ref = lin(p["down"], jax.nn.silu(lin(p["gate"], x)) * lin(p["up"], x))
    assert rel_err(mlp.apply(params, x), ref) < 1e-5



def test_linen_mlp_sharding_metadata(rng):
    x = _normal(rng, (4, 16))
    boxed = FusedMLP(32, activation="silu", gated=True, embed_axis="embed", hidden_axis="mlp").init(
        jax.random.key(0), x)["params"]
    names = {f"{layer}/{p}": boxed[layer][p].names for layer in boxed for p in boxed[layer]}
    assert names == {"up/kernel": ("embed", "mlp"), "up/bias": ("mlp",), "gate/kernel": ("embed", "mlp"),
                     "gate/bias": ("mlp",), "down/kernel": ("mlp", "embed"), "down/bias": ("embed",)}

# nnx -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_state_matches_linear(use_bias):
    kw = dict(use_bias=use_bias, param_dtype=jnp.bfloat16, bias_init=nnx.initializers.normal(1.0))
    ours = nnx.state(FusedLinear(24, 40, activation="silu", rngs=nnx.Rngs(7), **kw))
    _same_tree(ours, nnx.state(nnx.Linear(24, 40, rngs=nnx.Rngs(7), **kw)))


@pytest.mark.parametrize("activation,plain", [(None, lambda z: z), ("gelu", lambda z: jax.nn.gelu(z, approximate=False))])
def test_nnx_outputs_and_grads_match_linear(rng, activation, plain):
    x = _normal(rng, (3, 5, 32))
    linear = nnx.Linear(32, 16, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    fused = FusedLinear(32, 16, activation=activation, rngs=nnx.Rngs(1))
    nnx.update(fused, nnx.state(linear))  # a Linear checkpoint, loaded unchanged

    def loss(model, x, act):
        return jnp.sum(jnp.sin(act(model(x))))

    g_ours = nnx.grad(loss)(fused, x, lambda z: z)
    g_ref = nnx.grad(loss)(linear, x, plain)
    assert rel_err(fused(x), plain(linear(x))) < 1e-5
    for o, r in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        assert rel_err(o, r) < 1e-5


def test_nnx_dtype_and_epilogue(rng):
    x, r = _normal(rng, (8, 32), jnp.bfloat16), _normal(rng, (8, 16), jnp.bfloat16)
    linear = nnx.Linear(32, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    fused = FusedLinear(32, 16, dtype=jnp.bfloat16, epilogue=lambda z, r: jax.nn.relu(z) + r, rngs=nnx.Rngs(0))
    y = fused(x, r)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, jax.nn.relu(linear(x).astype(jnp.float32)) + r) < 1e-2


def test_nnx_sharding_metadata():
    with jax.set_mesh(jax.make_mesh((1, 1), ("embed", "mlp"))):
        layer = FusedLinear(8, 16, rngs=nnx.Rngs(0), kernel_metadata={"out_sharding": ("embed", "mlp")},
                            bias_metadata={"out_sharding": ("mlp",)})
        ref = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_metadata={"out_sharding": ("embed", "mlp")},
                         bias_metadata={"out_sharding": ("mlp",)})
    assert layer.kernel.get_metadata() == ref.kernel.get_metadata()
    assert layer.bias.get_metadata() == ref.bias.get_metadata()
    spec = nnx.get_partition_spec(nnx.state(layer))
    assert tuple(spec["kernel"].get_value()) == ("embed", "mlp")


class _NnxMLP(nnx.Module):
    """The MLP of nnx.Linear, its layers made in FusedMLP's order."""

    def __init__(self, d, hidden, gated, rngs):
        kw = dict(bias_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.up = nnx.Linear(d, hidden, **kw)
        self.gate = nnx.Linear(d, hidden, **kw) if gated else nnx.data(None)
        self.down = nnx.Linear(hidden, d, **kw)
        self.gated = gated

    def __call__(self, x):
        if self.gated:
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("gated", [False, True], ids=["gelu_tanh", "gated_silu"])
def test_nnx_mlp_matches_linear_layers(rng, gated):
    x = _normal(rng, (3, 5, 16))
    ours = NnxFusedMLP(16, 48, activation="silu" if gated else "gelu_tanh", gated=gated,
                       bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(3))
    plain = _NnxMLP(16, 48, gated, nnx.Rngs(3))
    _same_tree(nnx.state(ours), nnx.state(plain))  # same Rngs, same layers, same values

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    assert rel_err(ours(x), plain(x)) < 1e-5
    for o, r in zip(jax.tree.leaves(nnx.grad(loss)(ours, x)), jax.tree.leaves(nnx.grad(loss)(plain, x))):
        assert rel_err(o, r) < 1e-5


def test_nnx_mlp_sharding_metadata():
    with jax.set_mesh(jax.make_mesh((1, 1), ("embed", "mlp"))):
        mlp = NnxFusedMLP(8, 16, gated=True, embed_axis="embed", hidden_axis="mlp", rngs=nnx.Rngs(0))
    spec = nnx.get_partition_spec(nnx.state(mlp))
    got = {f"{layer}/{p}": tuple(spec[layer][p].get_value()) for layer in ("up", "gate", "down")
           for p in ("kernel", "bias")}
    assert got == {"up/kernel": ("embed", "mlp"), "up/bias": ("mlp",), "gate/kernel": ("embed", "mlp"),
                   "gate/bias": ("mlp",), "down/kernel": ("mlp", "embed"), "down/bias": ("embed",)}


def test_unnamed_layers_take_dense_names_and_load_a_plain_checkpoint(rng):
    """A model of unnamed nn.Dense layers and the same model with FusedDense: the same parameter
    tree (Dense_0, Dense_1, and under nn.remat CheckpointDense_0), so the plain model's
    checkpoint (Flax's msgpack serialization of params and optimizer state) loads into the fused
    one and gives the same outputs."""
    import optax
    from flax import serialization

    import jax_efc.flax as efc_flax

    def model(dense):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = dense(16)(x)
                x = nn.remat(dense)(16)(x)
                return dense(4)(x)

        return Model()

    x = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)
    plain, fused = model(nn.Dense), model(efc_flax.FusedDense)
    params = plain.init(jax.random.PRNGKey(0), x)
    assert set(params["params"]) == {"Dense_0", "CheckpointDense_0", "Dense_1"}
    opt = optax.adamw(1e-3)
    state = {"params": params, "opt": opt.init(params)}
    blob = serialization.to_bytes(state)
    template = {"params": fused.init(jax.random.PRNGKey(1), x), "opt": opt.init(params)}
    assert jax.tree.structure(template["params"]) == jax.tree.structure(params)
    restored = serialization.from_bytes(template, blob)
    assert efc_flax.FusedDense is FusedDense and efc_flax.FusedMLP is FusedMLP
    assert rel_err(fused.apply(restored["params"], x), plain.apply(params, x)) < 1e-6
    for leaf_a, leaf_b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
