"""Each example runs as a script with small arguments and passes its own check."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "alpha_beta.py": ["--mnkl", "128,64,32,2"],
    "activation.py": ["--mnk", "128,64,32"],
    "multi_output.py": ["--mnkl", "128,64,32,2"],
    "complex_epilogue.py": ["--mnk", "128,64,32", "--dtype", "float16"],
    "flax_mlp.py": ["--steps", "5", "--batch", "32", "--features", "16,32,8"],
    "fp8_scaled.py": ["--mnk", "128,64,256"],
    "gpt_fp8.py": ["--layers", "dense,fused,fp8,fp8-fast,flax-fp8", "--blocks", "1", "--width", "64", "--seq", "32",
                   "--steps", "40"],
    "moe.py": ["--steps", "20", "--tokens", "64", "--width", "16", "--hidden", "32", "--expert-parallel", "4",
               "--cpu-devices", "4"],
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example(script):
    if script in ("flax_mlp.py", "gpt_fp8.py", "moe.py"):
        pytest.importorskip("flax")
        pytest.importorskip("optax")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *CASES[script]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend" in proc.stdout


def test_benchmark_script():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--shapes", "32,64,16",
                           "--epilogues", "gemm,bias+gelu", "--rounds", "1", "--min-round-time", "0.001"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bias+gelu" in proc.stdout


BENCHMARKS = {
    # script: small arguments, a line its output must hold
    "grouped_peers.py": (["--shapes", "256,64,32,4", "--routing", "balanced", "skewed", "--rounds", "1",
                          "--configs", "auto", "128,128,1,2"], "ours: efc.grouped_gemm 128,128,1,2"),
    "moe_step.py": (["--tokens", "64", "--width", "16", "--hidden", "32", "--dtype", "float32", "--rounds", "1"],
                    "relative difference of the losses"),
    "promotion.py": (["--shapes", "256,512,384", "--rounds", "1"], "XLA HIGHEST"),
}


@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_benchmark_scripts_run_small(script):
    """The grouped GEMM's and 8-bit promotion's benchmarks run end to end on small shapes (here on
    the reference) and pass their own checks (the MoE step's losses agree)."""
    if script == "moe_step.py":
        pytest.importorskip("flax")
        pytest.importorskip("optax")
    args, needle = BENCHMARKS[script]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert needle in proc.stdout
