"""Numerics of the SM90 kernel (``jax_efc.ffi.fused_gemm``) against the XLA reference.

The reference is ``jax_efc.epilogue.evaluate`` on ``lax.dot_general`` with an fp32 result.
Inputs are random normal, so an output element the kernel never wrote (left as whatever the
allocator handed out) shows up: before each call the allocator is primed with NaN-filled
blocks of the outputs' sizes, which it hands back for the kernel's outputs, and the test
requires every output finite and within a relative Frobenius error of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _setup():
    import jax
    import jax.numpy as jnp
    from jax import lax

    import jax_efc.ffi as F
    from jax_efc.config import GemmConfig
    from jax_efc.epilogue import evaluate
    from jax_efc.tracing import trace_epilogue

    return jax, jnp, lax, F, GemmConfig, evaluate, trace_epilogue


def _plan(ir, a, b, ops, **kw):
    """The kernel's plan for a call on this GPU (asserting it has one)."""
    from jax_efc import device
    from jax_efc.plan import plan_kernel

    plan = plan_kernel(ir, a, b, ops, arch=device.arch(), **kw)
    assert plan.backend == "kernel", plan.reason
    return plan


def _run(fn, shapes_dtypes, *, m, n, k, batch=None, a_batched=True, b_batched=True, dtype="bfloat16",
         transpose_a=False, transpose_b=False, config=None, out_dtypes=None, static=None, tol=2e-2):
    jax, jnp, lax, F, GemmConfig, evaluate, trace_epilogue = _setup()
    dtype = jnp.dtype(dtype)
    acc_shape = (m, n) if batch is None else (batch, m, n)
    keys = jax.random.split(jax.random.PRNGKey(m * 7 + n * 3 + k), 3 + len(shapes_dtypes))
    a_shape = (k, m) if transpose_a else (m, k)
    b_shape = (n, k) if transpose_b else (k, n)
    if batch is not None and a_batched:
        a_shape = (batch, *a_shape)
    if batch is not None and b_batched:
        b_shape = (batch, *b_shape)
    a = jax.random.normal(keys[0], a_shape, jnp.float32).astype(dtype)
    b = jax.random.normal(keys[1], b_shape, jnp.float32).astype(dtype)
    ops = [jax.random.normal(kk, s, jnp.float32).astype(d) for kk, (s, d) in zip(keys[3:], shapes_dtypes)]
    ir, *_ = trace_epilogue(fn, acc_shape, [s for s, _ in shapes_dtypes], [d for _, d in shapes_dtypes],
                            static or {}, {}, out_dtypes, dtype)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, acc_dtype=jnp.float32,
              config=None if config is None else GemmConfig(*config[:4], **(config[4] if len(config) > 4 else {})))
    plan = _plan(ir, a, b, ops, **kw)

    def reference(a, b, *ops):
        a_ = jnp.swapaxes(a, -1, -2) if transpose_a else a
        b_ = jnp.swapaxes(b, -1, -2) if transpose_b else b
        acc = jnp.matmul(a_, b_, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        return evaluate(ir, acc, ops)

    kernel = jax.jit(lambda a, b, *ops: F.fused_gemm(a, b, *ops, plan=plan))
    jax.block_until_ready(kernel(a, b, *ops))  # compile first so priming is the last allocation
    # prime the allocator: NaN blocks of each output's size, freed just before the call
    poison = [jnp.full(acc_shape, jnp.nan, o.dtype) for o in ir.outputs]
    jax.block_until_ready(poison)
    del poison
    got = jax.block_until_ready(kernel(a, b, *ops))
    want = jax.jit(reference)(a, b, *ops)
    assert len(got) == len(ir.outputs)
    for o, g, w in zip(ir.outputs, got, want):
        assert g.shape == acc_shape and g.dtype == jnp.dtype(o.dtype), (o.name, g.shape, g.dtype)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.isfinite(g64).all(), f"output {o.name}: {np.size(g64) - np.isfinite(g64).sum()} non-finite"
        err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
        assert err < tol, f"output {o.name}: relative error {err:.3g}"
        # per 128 x 128 block too: one wrong tile among thousands barely moves the total
        worst = max(_rel_error(g64[..., i:i + 128, j:j + 128], w64[..., i:i + 128, j:j + 128])
                    for i in range(0, g64.shape[-2], 128) for j in range(0, g64.shape[-1], 128))
        assert worst < 2 * tol, f"output {o.name}: relative error {worst:.3g} in a 128x128 block"


def _alpha_beta(acc, c, x):
    """The seed's alpha-beta epilogue with alpha, beta and x_factor baked in."""
    return {"D": acc * 2.0 + c * 1.0 + x * 3.0, "Y": acc}


def _rel_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("config", [(128, 128, 1, 1), (192, 128, 1, 2, {"pingpong": True}),
                                    (256, 128, 1, 2), (128, 192, 2, 1, {"pingpong": True, "raster": "n"})])
def test_plain_gemm_majors_odd_shape(transpose_a, transpose_b, config):
    # M, N, K not multiples of the tile: partial tiles on every edge (N, K multiples of 8)
    _run(lambda acc: acc, [], m=1000, n=1000, k=1000, transpose_a=transpose_a,
         transpose_b=transpose_b, config=config)


@pytest.mark.parametrize("config", [(128, 256, 2, 1), (128, 128, 1, 2), (128, 128, 2, 2),
                                    (64, 128, 1, 1), (128, 192, 1, 1), (256, 128, 2, 1), None,
                                    (192, 128, 1, 2, {"pingpong": True, "epi_n": 64, "epi_m": 64}),
                                    (256, 128, 2, 1, {"epi_m": 128}), (256, 192, 1, 1), (128, 128, 4, 1),
                                    (128, 128, 1, 4)])
def test_configs(config):
    _run(lambda acc, bias: acc + bias, [((1, 768), "bfloat16")], m=1032, n=768, k=520,
         config=config)


# shapes whose last round of whole tiles on an H200 (66 clusters of 2, or 132 CTAs) is at
# most 1/5 full, so the last tiles' k-iterations are split across all clusters, or whose
# tiles fill at most half of one round, so all of them are
@pytest.mark.parametrize("config,m,n,k,batch,epilogue,transpose", [
    ((128, 128, 1, 2, {"pingpong": True, "swizzle": 8}), 2176, 4096, 1288, None, "bias_gelu", False),
    ((128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_n": 64}), 2176, 4096, 1288, None, "bias_gelu",
     False),
    ((128, 256, 2, 1, {"swizzle": 8}), 4608, 3840, 1288, None, "alpha_beta", False),
    ((128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_n": 16}), 2176, 4096, 1288, None, "alpha_beta",
     False),
    ((128, 128, 1, 2, {"pingpong": True, "swizzle": 8, "epi_m": 64}), 2176, 4096, 1288, None, "alpha_beta",
     False),
    ((128, 128, 1, 1, {"pingpong": True}), 1152, 2048, 1024, 2, "alpha_beta", True),
    ((192, 128, 1, 2, {"pingpong": True, "swizzle": 8}), 2300, 1536, 1288, None, "bias_gelu", False),
    ((128, 192, 2, 1, {"pingpong": True, "swizzle": 8, "raster": "n", "epi_m": 64, "epi_n": 16}), 2296, 2824,
     1288, None, "alpha_beta", True),
    ((256, 128, 1, 2, {"swizzle": 8}), 2048, 2304, 1288, None, "bias_gelu", True),
    ((128, 128, 1, 1, {}), 1024, 512, 8192, None, "bias_gelu", False),
    ((128, 128, 1, 2, {"pingpong": True}), 256, 2048, 4104, None, "alpha_beta", True),
], ids=["pingpong_bias_gelu", "pingpong_epi64_bias_gelu", "cooperative_alpha_beta",
        "pingpong_epi16_alpha_beta", "pingpong_epi64x32_alpha_beta", "pingpong_alpha_beta_batched_transposed",
        "pingpong_192x128_bias_gelu", "pingpong_128x192_alpha_beta_transposed",
        "cooperative_256x128_bias_gelu_transposed", "split_all_bias_gelu",
        "split_all_pingpong_alpha_beta_transposed"])
def test_stream_k(config, m, n, k, batch, epilogue, transpose):
    import jax

    from jax_efc import device
    from jax_efc.config import GemmConfig
    from jax_efc.kernels.schedule import plan_schedule

    cfg = GemmConfig(*config[:4], **config[4])
    clusters, _ = device.residency(cfg.cluster_m * cfg.cluster_n, None, 0)
    assert plan_schedule(cfg, m, n, k, batch or 1, clusters, 64).stream_k, "the shape no longer splits"
    acc = (m, n) if batch is None else (batch, m, n)
    if epilogue == "bias_gelu":
        fn, operands, outs = lambda acc, bias: jax.nn.gelu(acc + bias), [((1, n), "bfloat16")], None
    else:
        fn = lambda acc, c, x: {"D": acc * 2.0 + c * 0.5 + x * 3.0, "Y": acc}  # noqa: E731
        operands, outs = [(acc, "bfloat16")] * 2, {"D": "bfloat16", "Y": "float32"}
    _run(fn, operands, m=m, n=n, k=k, batch=batch, config=config, out_dtypes=outs,
         transpose_a=transpose, transpose_b=transpose)


def test_persistent_grid_fits_the_gpu():
    # a cluster stays inside one GPC, so clusters of 4 can fit fewer times than SMs // 4 (30
    # on an H200, not 33); the grid is sized by the driver's answer, and the assumption used
    # when compiling without a GPU must not exceed it
    from jax_efc import device
    from jax_efc.kernels.sm90_policy import POLICY

    sms = device.sm_count(0)
    assert device._query_max_active_clusters(1) == sms
    assert 0 < device._query_max_active_clusters(2) <= sms // 2
    fours = device._query_max_active_clusters(4)
    assert 0 < fours <= sms // 4
    assert POLICY.assumed_max_clusters(4, sms) <= fours
    assert device.residency(4, None, 0) == (fours, True)


def test_dependent_kernels_in_one_jit():
    # Each kernel launches as a programmatic dependent of the previous one on the stream, and
    # the previous kernel lets it launch from its start: three GEMMs that each read the last
    # one's output, one jitted program. The first runs on 4 CTAs for a long K, so the second's
    # CTAs start on idle SMs while it runs; they must wait for its output before reading.
    jax, jnp, lax, F, GemmConfig, evaluate, trace_epilogue = _setup()
    cfg = GemmConfig(128, 128, stream_k=False)
    dims = [(256, 256, 16384), (256, 512, 256), (256, 256, 512)]
    keys = jax.random.split(jax.random.PRNGKey(5), len(dims) + 1)
    x = jax.random.normal(keys[0], dims[0][::2], jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(kk, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
          for kk, (_, n, k) in zip(keys[1:], dims)]
    irs = [trace_epilogue(lambda acc: acc, (m, n), [], [], {}, {}, jnp.bfloat16, jnp.bfloat16)[0]
           for m, n, _ in dims]
    kw = dict(transpose_a=False, transpose_b=False, acc_dtype=jnp.float32, config=cfg)
    plans = [_plan(ir, jax.ShapeDtypeStruct((m, k), x.dtype), w, [], **kw) for (m, _, k), ir, w in zip(dims, irs, ws)]

    def chain(x, *ws):
        for plan, w in zip(plans, ws):
            (x,) = F.fused_gemm(x, w, plan=plan)
        return x

    def reference(x, *ws):
        for w in ws:
            x = jnp.matmul(x, w, preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST).astype(x.dtype)
        return x

    run = jax.jit(chain)
    want = np.asarray(jax.jit(reference)(x, *ws), np.float64)
    for _ in range(3):
        got = np.asarray(run(x, *ws), np.float64)
        assert np.isfinite(got).all()
        assert _rel_error(got, want) < 2e-2


def test_short_k():
    _run(lambda acc: acc, [], m=256, n=256, k=40, config=(128, 128, 1, 1))


def test_bias_gelu_fp16():
    import jax

    _run(lambda acc, bias: jax.nn.gelu(acc + bias), [((1, 4096), "float16")], m=2048, n=4096,
         k=1024, dtype="float16", config=(128, 256, 2, 1))


# ping-pong: 468 tiles, three or four a CTA, so each CTA runs paced epilogues before its
# last, dense one, with partial tiles on both edges
@pytest.mark.parametrize("config,m,n", [((128, 128, 2, 1), 296, 384),
                                        ((128, 128, 1, 2, {"pingpong": True, "swizzle": 8}), 1416, 1544)],
                         ids=["cooperative", "pingpong_paced"])
def test_multi_output_all_roles_batched_shared_b(config, m, n):
    import jax
    import jax.numpy as jnp

    def fn(acc, c, bias, col, s, *, alpha):
        y = acc * alpha + c * s + bias
        return {"D": jax.nn.gelu(y) * col, "Y": jnp.where(y > 0, y, 0.01 * y), "Z": jnp.tanh(y) - jnp.exp(-jnp.abs(y))}

    L = 3  # transposed A: M is contiguous, so a multiple of 8
    _run(fn, [((L, m, n), "bfloat16"), ((L, 1, n), "float32"), ((m, 1), "bfloat16"), ((L, 1, 1), "float32")],
         m=m, n=n, k=512, batch=L, b_batched=False, transpose_a=True, static={"alpha": 0.5},
         out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32, "Z": jnp.float16}, config=config)


def test_math_ops():
    import jax.numpy as jnp
    from jax import lax

    def fn(acc, c):
        x = acc * 0.05
        return (jnp.sign(x) * jnp.sqrt(jnp.abs(x)) + lax.erf(x) + jnp.log1p(jnp.abs(x)) + jnp.expm1(-jnp.abs(x))
                + jnp.maximum(x, c) - jnp.minimum(x, 0.5) + x ** 3 + jnp.floor(x) + jnp.sin(x) * jnp.cos(x)
                + jnp.where((x > 0) & (c < 0), 1.0, -1.0) + 1 / (1 + jnp.exp(-x)))

    _run(fn, [((512, 512), "float32")], m=512, n=512, k=256, config=(128, 128, 1, 1))


def test_fast_erf_erfc_float32():
    """erf/erfc run as rational fits (fragment_math.py): fp32 outputs hold them to the reference,
    and log(erfc) of arguments up to about 8 checks erfc's relative accuracy in its tail."""
    import jax.numpy as jnp
    from jax import lax

    def fn(acc):
        z = acc * 0.1
        return {"erf": lax.erf(z), "erfc": lax.erfc(z), "log_tail": jnp.log(lax.erfc(jnp.abs(z)))}

    _run(fn, [], m=512, n=512, k=256, config=(128, 128, 1, 1), tol=2e-5,
         out_dtypes={"erf": jnp.float32, "erfc": jnp.float32, "log_tail": jnp.float32})


# TILE operands are TMA-loaded per epilogue subtile into shared memory (two buffers, the first
# two subtiles fetched under the mainloop; the CTA's last tile's come through the A/B ring's
# stages past its last k-tile, loaded by the producer, across both parts of a stage at
# 128x256): partial edge tiles, several outputs of different
# dtypes, 16- and 32-bit operands, operands shared across the batch, 32- and 64-wide subtiles.
@pytest.mark.parametrize("config", [(128, 256, 1, 1), (128, 128, 2, 1), (64, 128, 1, 1, {"epi_n": 64}),
                                    (128, 192, 1, 1), (128, 128, 1, 2, {"pingpong": True, "epi_n": 16}),
                                    (128, 128, 1, 2, {"pingpong": True, "epi_m": 64}),
                                    (192, 128, 1, 2, {"pingpong": True, "epi_m": 64, "epi_n": 16})])
def test_tile_operands_alpha_beta_edges(config):
    import jax.numpy as jnp

    m, n = 1000, 1000  # partial tiles on both edges (N a multiple of 8 for TMA)
    _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=520, config=config,
         out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32})


@pytest.mark.parametrize("config, shape", [
    ((128, 128, 1, 2, {"pingpong": True, "epi_m": 64}), (2048, 4096, 200)),
    ((128, 128, 1, 2, {"pingpong": True, "epi_m": 64}), (1000, 1000, 64)),
    ((128, 256, 1, 1), (2048, 4096, 64)),
    ((128, 128, 2, 1), (1000, 1000, 200)),
])
def test_tile_operands_fewer_k_tiles_than_stages(config, shape):
    # a tile of one to four k-tiles against a ring of more stages: the stages that take the
    # CTA's last tile's TILE operands were last filled by an earlier tile's k-tiles, in
    # another phase, or never
    import jax.numpy as jnp

    m, n, k = shape
    _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=k, config=config,
         out_dtypes={"D": jnp.bfloat16, "Y": jnp.bfloat16})


@pytest.mark.parametrize("shape", [(2048, 4096, 4096), (1000, 14336, 1032), (3000, 4096, 1032)])
def test_alpha_beta_heuristic_config(shape):
    # the heuristic's ping-pong tiles: 128x128 in 64x32 subtiles, or 192x128 in 64x16 ones
    # (3000 rows); bf16 outputs staged in the ring on the last tile
    import jax.numpy as jnp

    m, n, k = shape
    _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=k,
         out_dtypes={"D": jnp.bfloat16, "Y": jnp.bfloat16})


def test_cooperative_256x128_tile_operands_batched_fp16():
    # two 128-row warpgroups share the tile's epilogue: TILE operands through 256x32 buffers
    import jax.numpy as jnp

    L, m, n = 2, 600, 392
    _run(_alpha_beta, [((L, m, n), "float16"), ((m, n), "float16")], m=m, n=n, k=520, batch=L,
         dtype="float16", config=(256, 128, 2, 1), out_dtypes={"D": jnp.float16, "Y": jnp.float16})


def test_pingpong_192x128_batched_fp16_transposed():
    # three 64-row WGMMAs per k-step from an M-major A; B shared across the batch
    import jax

    _run(lambda acc, bias: jax.nn.gelu(acc + bias), [((1, 520), "float16")], m=424, n=520, k=328,
         batch=3, b_batched=False, dtype="float16", transpose_a=True,
         config=(192, 128, 1, 2, {"pingpong": True}))


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_plain_gemm_by_the_heuristic(transpose_a, transpose_b):
    # a large plain GEMM: the heuristic's 128x192 ping-pong tiles in 2x1 clusters along N
    # (test_kernel_compile checks the choice); partial tiles and clusters on every edge
    _run(lambda acc: acc, [], m=3000, n=6152, k=1032, transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.mark.parametrize("epilogue", ["bias_gelu", "alpha_beta", "alpha_beta_f32_y"])
def test_epilogues_on_128x192_by_the_heuristic(epilogue):
    # where 192x128 tiles fill the SMs worse, epilogues with work take 128x192 ping-pong tiles
    # in 2x1 clusters along N (test_kernel_compile checks the choice): 128x32 subtiles for
    # the bias, 64x16 for alpha-beta (with an fp32 output too); 8 rows of the last tile row
    # and 8 columns of the last tile column are in the output
    import jax
    import jax.numpy as jnp

    m, n, k = 1000, 6152, 1032
    if epilogue == "bias_gelu":
        _run(lambda acc, bias: jax.nn.gelu(acc + bias), [((1, n), "bfloat16")], m=m, n=n, k=k)
    else:
        y_dtype = jnp.float32 if epilogue == "alpha_beta_f32_y" else jnp.bfloat16
        _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=k,
             out_dtypes={"D": jnp.bfloat16, "Y": y_dtype})


def test_alpha_beta_fp32_outputs_by_the_heuristic():
    # two fp32 outputs next to two TILE operands: the heuristic's ping-pong tiles in 64x16
    # subtiles (test_kernel_compile checks the choice); partial tiles on every edge
    import jax.numpy as jnp

    m, n = 2000, 4104
    _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=1032,
         out_dtypes={"D": jnp.float32, "Y": jnp.float32}, tol=1e-4)


@pytest.mark.parametrize("outputs, k", [(7, 96), (12, 96), (6, 48), (12, 48)])
def test_many_fp32_outputs_by_the_heuristic(outputs, k):
    # outputs enough that the heuristic narrows the subtiles (128x16), or the tile too (64x128
    # in 64x16), to keep two ring stages, from its 128x128 or (one k-tile) 128x256 tiles
    # (test_plan checks the choice); partial tiles, a batch
    import jax.numpy as jnp

    def fn(acc, c):
        return tuple(acc * (i + 1) - c * i for i in range(outputs))

    L, m, n = 3, 138, 104
    _run(fn, [((L, m, n), "float32")], m=m, n=n, k=k, batch=L, out_dtypes=[jnp.float32] * outputs, tol=1e-4)


def test_tile_operand_f32_shared_across_batch():
    import jax.numpy as jnp

    def fn(acc, c, x):
        return {"D": jnp.maximum(acc, c) * x, "E": acc - c}

    L, m, n = 3, 300, 392
    _run(fn, [((m, n), "float32"), ((L, m, n), "float16")], m=m, n=n, k=264, batch=L,
         dtype="float16", config=(64, 128, 1, 1, {"epi_n": 64}),
         out_dtypes={"D": jnp.float16, "E": jnp.float32})


def test_bias_gelu_epi64_cluster():
    import jax

    _run(lambda acc, bias: jax.nn.gelu(acc + bias), [((1, 1024), "bfloat16")], m=1032, n=1024,
         k=520, config=(128, 256, 2, 1, {"epi_n": 64}))


# Ping-pong schedule (GemmConfig(pingpong=True)): two consumer warpgroups on alternate tiles
# taking turns with the epilogue buffers; partial edge tiles, TILE operands, clusters.
@pytest.mark.parametrize("tile", [(64, 256), (128, 128), (192, 128), (128, 192)])
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (8192, 4096, 4096)])
@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu", "alpha_beta"])
def test_pingpong(tile, shape, epilogue):
    import jax
    import jax.numpy as jnp

    m, n, k = shape
    cluster = (2, 1) if epilogue != "plain" else (1, 1)
    config = (*tile, *cluster, {"pingpong": True})
    if epilogue == "plain":
        _run(lambda acc: acc, [], m=m, n=n, k=k, config=config)
    elif epilogue == "bias_gelu":
        _run(lambda acc, bias: jax.nn.gelu(acc + bias), [((1, n), "bfloat16")], m=m, n=n, k=k,
             config=(*config[:4], {"pingpong": True, "epi_n": 64}))
    else:
        _run(_alpha_beta, [((m, n), "bfloat16"), ((m, n), "bfloat16")], m=m, n=n, k=k, config=config,
             out_dtypes={"D": jnp.bfloat16, "Y": jnp.float32})
