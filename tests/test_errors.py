"""Every rejected input fails with an error that names the problem and the fix."""

import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

import jax_efc as efc
from jax_efc.epilogue import EpilogueError


@pytest.fixture
def ab(rng):
    return (jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((8, 12)), jnp.float32))


def test_mismatched_k(ab):
    a, _ = ab
    with pytest.raises(ValueError, match=r"contracting dimensions differ.*\(16, 8\).*\(7, 12\)"):
        efc.gemm(a, jnp.ones((7, 12)))


def test_rank_and_batch(ab):
    a, b = ab
    with pytest.raises(ValueError, match="both must be 2-D"):
        efc.gemm(a[None, None], b)
    with pytest.raises(ValueError, match="batch dimensions differ"):
        efc.gemm(jnp.ones((2, 16, 8)), jnp.ones((3, 8, 12)))


def test_dtypes(ab):
    a, b = ab
    with pytest.raises(TypeError, match="same dtype"):
        efc.gemm(a, b.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="int32"):
        efc.gemm(a.astype(jnp.int32), b.astype(jnp.int32))
    with pytest.raises(TypeError, match="epilogue operand 0 has dtype int32"):
        efc.gemm(a, b, lambda acc, m: acc * m, jnp.ones((16, 12), jnp.int32))


def test_operand_shape(ab):
    a, b = ab
    with pytest.raises(EpilogueError, match=r"epilogue operand 0 has shape \(16,\).*column vector \(16, 1\)"):
        efc.gemm(a, b, lambda acc, v: acc + v, jnp.ones((16,)))


def test_output_shape(ab):
    a, b = ab
    with pytest.raises(EpilogueError, match=r"output '1' has shape \(12,\)"):
        efc.gemm(a, b, lambda acc, bias: (acc + bias, bias * 2), jnp.ones(12))
    with pytest.raises(EpilogueError, match=r"returns no outputs \(an empty dict\).*\(16, 12\)"):
        efc.gemm(a, b, lambda acc: {})
    with pytest.raises(EpilogueError, match=r"output '0' is None"):
        efc.gemm(a, b, lambda acc: None)
    with pytest.raises(EpilogueError, match=r"output 'Y' is None"):
        efc.gemm(a, b, lambda acc: {"D": acc, "Y": None})


@pytest.mark.parametrize(
    "fn, prim",
    [
        (lambda acc: acc - jnp.prod(acc, axis=1, keepdims=True), "reduce_prod"),
        (lambda acc: jnp.cumsum(acc, axis=0), "cum"),
        (lambda acc: acc @ jnp.ones((12, 12)), "dot_general"),
        (lambda acc: acc[::-1], "rev"),
    ],
)
def test_unsupported_primitive_names_it_and_the_line(ab, fn, prim):
    a, b = ab
    with pytest.raises(EpilogueError, match=rf"uses `{prim}\w*` at .*test_errors.py:\d+"):
        efc.gemm(a, b, fn)


def test_transposing_a_vector_is_rejected(ab):
    a, b = ab
    with pytest.raises(EpilogueError, match="only NumPy-style broadcasting"):
        efc.gemm(jnp.ones((12, 8)), b, lambda acc, v: acc + v[:, None], jnp.ones(12))


def test_closed_over_array(ab):
    a, b = ab
    w = jnp.arange(12.0)
    with pytest.raises(EpilogueError, match="closes over an array of shape"):
        efc.gemm(a, b, lambda acc: acc * w)


def test_bad_out_dtypes_and_scalars(ab):
    a, b = ab
    with pytest.raises(EpilogueError, match="out_dtypes has keys"):
        efc.gemm(a, b, lambda acc: {"D": acc}, out_dtypes={"E": jnp.float16})
    with pytest.raises(EpilogueError, match="out_dtypes has 2 entries"):
        efc.gemm(a, b, lambda acc: (acc,), out_dtypes=(jnp.float16, jnp.float16))
    with pytest.raises(EpilogueError, match="keyword scalars must be 0-d"):
        efc.gemm(a, b, lambda acc, *, s: acc * s, s=jnp.ones(3))
    with pytest.raises(ValueError, match="need an epilogue"):
        efc.gemm(a, b, None, jnp.ones(12))


def test_user_error_inside_epilogue(ab):
    a, b = ab
    with pytest.raises(EpilogueError, match="tracing the epilogue failed: TypeError"):
        efc.gemm(a, b, lambda acc, *, s: acc * s)


def test_fused_dense_errors(ab):
    a, b = ab
    with pytest.raises(ValueError, match="unknown activation 'gelu2'"):
        efc.fused_dense(a, b, activation="gelu2")
    with pytest.raises(ValueError, match=r"bias has shape \(8,\); expected \(12,\)"):
        efc.fused_dense(a, b, jnp.ones(8))
    with pytest.raises(ValueError, match="x's last dimension must equal"):
        efc.fused_dense(b, b)
    with pytest.raises(ValueError, match="residual has shape"):
        efc.fused_dense(a, b, residual=jnp.ones((16, 8)))


@pytest.mark.parametrize("fields, needle", [
    (dict(tile_m=0), "tile_m=0 must be positive"),
    (dict(tile_n=128.0), "tile_n=128.0 must be an int"),
    (dict(raster="k"), "raster='k' must be 'm' or 'n'"),
    (dict(swizzle=3), "swizzle=3 must be 1, 2, 4 or 8"),
    (dict(stages=1), "stages=1 must be 0"),
    (dict(epi_n=48), "epi_n=48 must be 16, 32 or 64"),
    (dict(tile_n=80), "tile_n=80 is not a multiple of epi_n=32"),
    (dict(epi_m=32), "epi_m=32 must be 0 (the tile's height) or a multiple of 64"),
    (dict(tile_m=192, epi_m=128), "divides tile_m=192"),
    (dict(pingpong=1), "pingpong=1 must be True or False"),
])
def test_config_fields_are_checked_when_made(fields, needle):
    """On every platform, not only where a kernel would run it."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        efc.GemmConfig(**fields)
    efc.GemmConfig(tile_n=64, epi_n=64, epi_m=64, pingpong=True, swizzle=8, stages=4, raster="n")


def test_fingerprint_is_stable_across_processes():
    code = (
        "import jax, jax.numpy as jnp, jax_efc as efc\n"
        "from jax_efc.primitive import fused_gemm_eqns\n"
        "from test_gemm import alpha_beta\n"
        "args = [jnp.ones(s) for s in [(8, 4), (4, 6), (8, 6), (8, 6)]]\n"
        "f = lambda a, b, c, x: efc.gemm(a, b, alpha_beta, c, x, alpha=2.0, beta=1.0, x_factor=3.0)\n"
        "print(fused_gemm_eqns(jax.make_jaxpr(f)(*args))[0].params['ir'].fingerprint)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)])}
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=env).stdout.strip() for _ in range(2)}
    assert len(runs) == 1 and len(runs.pop()) == 24
