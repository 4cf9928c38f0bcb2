"""The jax-efc command, run in-process on tiny shapes."""

import argparse
import collections
import json
import re
import subprocess
import sys
import time

import jax
import pytest

from jax_efc import bench
from jax_efc.cli import main

TINY = ["--mnkl", "64,32,48,1", "--warmup_iterations", "1", "--iterations", "2"]


@pytest.mark.parametrize("extra", [
    [],
    ["--epilogue", "complex", "--ab_dtype", "Float16", "--d_dtype", "Float32"],
    ["--epilogue", "multi-output", "--mnkl", "32,64,16,2", "--y_dtype", "float32"],
    ["--epilogue", "activation", "--mma_tiler_mn", "128,256", "--cluster_shape_mn", "2,1"],
    ["--expr", "jnp.tanh(acc) * 2", "--ab_dtype", "BFloat16", "--acc_dtype", "Float32"],
])
def test_run(capsys, extra):
    assert main(["run", *TINY, *extra]) == 0
    out = capsys.readouterr().out
    assert "backend: reference" in out and "TFLOP/s" in out and "ok" in out


def test_run_skip_ref_check(capsys):
    assert main(["run", *TINY, "--skip_ref_check"]) == 0
    assert "relative error" not in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["run", "--mnkl", "64,32"], "--mnkl"),
    (["run", "--ab_dtype", "Float5"], "unknown dtype"),
    (["run", "--epilogue", "nope"], "invalid choice"),
    (["run", "--expr", "acc +"], "not a Python expression"),
    (["run", "--epilogue", "complex", "--expr", "acc"], "not allowed with"),
    (["run", *TINY, "--expr", "undefined_name(acc)"], "undefined_name"),
    (["bench", "--shapes", "1,2"], "M,N,K"),
    (["bench", "--epilogues", "gemm,bias+relu6"], "bias+relu6"),
    (["bench", "--calls-per-jit", "0"], "positive integer"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "32,16,8,2", "--epilogues", "gemm,bias+silu,alpha-beta",
            "--rounds", "2", "--min-round-time", "0.001", "--json", str(out_json)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "bias+silu" in captured.out and "32x16x8x2" in captured.out
    assert "6/6" in captured.err  # the progress bar, with each finished problem's ratio
    assert re.search(r"1/6 32x64x48 gemm \d+\.\d\dx", captured.err)
    report = json.loads(out_json.read_text())
    assert report["complete"] and len(report["results"]) == 6
    for r in report["results"]:
        assert r["err"] < 1e-2 and r["baseline_err"] < 1e-2 and r["ours_s"] > 0


def test_bench_stopped_keeps_what_it_measured(monkeypatch, tmp_path):
    out_json = tmp_path / "bench.json"
    measure = bench.measure_together
    calls = []

    def stopped_at_the_second(group, **kw):
        calls.append(group)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(group, **kw)

    monkeypatch.setattr(bench.timing, "measure_together", stopped_at_the_second)
    argv = ["bench", "--shapes", "32,64,48", "--epilogues", "gemm,bias+silu,alpha-beta",
            "--rounds", "1", "--min-round-time", "0.001", "--json", str(out_json)]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    report = json.loads(out_json.read_text())
    assert not report["complete"]
    assert [r["epilogue"] for r in report["results"]] == ["gemm"]
    assert report["results"][0]["ours_s"] > 0
    assert not (tmp_path / "bench.json.tmp").exists()


def test_bench_resume_measures_only_what_is_missing(monkeypatch, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "--epilogues", "gemm,bias+silu,alpha-beta",
            "--rounds", "1", "--min-round-time", "0.001", "--json", str(out_json), "--resume"]
    measure = bench.measure_together
    measured = []

    def stopping_at(stop):
        def measure_or_stop(group, **kw):
            measured.append(group[0].epilogue)
            if len(measured) == stop:
                raise KeyboardInterrupt
            return measure(group, **kw)
        return measure_or_stop

    monkeypatch.setattr(bench.timing, "measure_together", stopping_at(2))
    with pytest.raises(KeyboardInterrupt):
        main(argv)  # no file yet: --resume starts from nothing
    first = json.loads(out_json.read_text())["results"]
    assert [r["epilogue"] for r in first] == ["gemm"]
    measured.clear()
    monkeypatch.setattr(bench.timing, "measure_together", stopping_at(0))
    assert main(argv) == 0
    assert measured == ["bias+silu", "alpha-beta"]  # gemm is not measured again
    report = json.loads(out_json.read_text())
    assert report["complete"]
    assert [r["epilogue"] for r in report["results"]] == ["gemm", "bias+silu", "alpha-beta"]
    assert report["results"][0] == first[0]
    measured.clear()
    assert main(argv) == 0 and measured == []  # a complete file: nothing left to measure
    assert json.loads(out_json.read_text()) == report


def test_bench_resume_refuses_other_xla_flags(monkeypatch, tmp_path):
    out_json = tmp_path / "bench.json"
    out_json.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                    "xla_flags": "--xla_gpu_enable_triton_gemm=false",
                                    "results": [], "no_triton": None, "complete": False}))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(SystemExit, match="xla_flags '--xla_gpu_enable_triton_gemm=false'"):
        main(["bench", "--shapes", "32,64,48", "--json", str(out_json), "--resume"])
    with pytest.raises(SystemExit, match="needs --json"):
        main(["bench", "--shapes", "32,64,48", "--resume"])


def test_bench_bound_times_our_plain_gemm_in_the_same_rounds(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "32,16,8,2", "--epilogues", "bias+gelu_tanh,alpha-beta",
            "--configs", "auto", "128,256,2,1", "--rounds", "2", "--min-round-time", "0.001",
            "--bound", "--json", str(out_json)]
    assert main(argv) == 0
    head = capsys.readouterr().out.splitlines()[1].split()
    assert head[-8:] == ["plain", "ms", "bound", "base", "plain", "ms", "base", "bound"]
    results = json.loads(out_json.read_text())["results"]
    assert len(results) == 8
    for r in results:
        assert r["plain_s"] > 0 and r["baseline_plain_s"] > 0
        assert bench.Result.from_json(r).bound == r["baseline_s"] / r["plain_s"]
        assert bench.Result.from_json(r).baseline_bound == r["baseline_s"] / r["baseline_plain_s"]
    # one plain GEMM per epilogue and shape (ours and XLA's), shared by its configurations
    assert all(a["plain_s"] == b["plain_s"] and a["baseline_plain_s"] == b["baseline_plain_s"]
               for a, b in zip(results[::2], results[1::2]))


def test_bench_calls_per_jit(capsys, monkeypatch, tmp_path):
    # R calls inside one jitted function, each on inputs of its own; times are per call
    timed = []
    real_time = bench.timing.time_interleaved

    def spy(fns, input_sets, *rest):
        timed.append((fns, input_sets))
        return real_time(fns, input_sets, *rest)

    monkeypatch.setattr(bench.timing, "time_interleaved", spy)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "--epilogues", "bias+silu,train:bias+gelu_tanh",
            "--calls-per-jit", "3", "--bound", "--rounds", "2", "--min-round-time", "0.001",
            "--json", str(out_json)]
    assert main(argv) == 0
    assert "3 calls per jit" in capsys.readouterr().out.splitlines()[0]
    assert len(timed) == 2 and len(timed[0][0]) == 4  # ours, baseline, the GEMM alone (ours and XLA's)
    for fns, input_sets in timed:
        ((chained,),) = input_sets
        assert len(chained) == 3 and not (chained[0][0] == chained[1][0]).all()
        outs = fns[0](chained)
        assert len(outs) == 3 and not (jax.tree.leaves(outs[0])[0] == jax.tree.leaves(outs[1])[0]).all()
    for r in json.loads(out_json.read_text())["results"]:
        assert r["calls_per_jit"] == 3 and r["err"] < 2e-2 and r["ours_s"] > 0
    with pytest.raises(ValueError, match="GiB"):
        bench.measure(bench.bench_problem("gemm", (8192, 8192, 8192, 1)), calls_per_jit=100)
    # the command refuses it before measuring anything
    with pytest.raises(SystemExit, match="--calls-per-jit: 100 calls per jit of 8192x8192x8192"):
        main(["bench", "--shapes", "32,64,48", "8192,8192,8192", "--epilogues", "gemm",
              "--calls-per-jit", "100", "--json", str(out_json)])
    assert all(r["calls_per_jit"] == 3 for r in json.loads(out_json.read_text())["results"])


def test_bench_configs_share_their_rounds(capsys, tmp_path):
    # the configurations of one epilogue and shape are timed together with one baseline
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "64,32,16", "--epilogues", "gemm,bias+gelu",
            "--configs", "auto", "128,256,2,1", "--rounds", "2", "--min-round-time", "0.001",
            "--json", str(out_json)]
    assert main(argv) == 0
    results = json.loads(out_json.read_text())["results"]
    assert [(r["shape"][:3], r["epilogue"], r["config"]) for r in results] == [
        (shape, epilogue, config) for shape in ([32, 64, 48], [64, 32, 16])
        for epilogue in ("gemm", "bias+gelu") for config in ("auto", "128,256,2,1")]
    for auto, pinned in zip(results[::2], results[1::2]):
        assert auto["baseline_s"] == pinned["baseline_s"] and auto["baseline_err"] == pinned["baseline_err"]
        assert auto["ours_s"] > 0 and pinned["ours_s"] > 0 and pinned["err"] < 1e-2
    assert "8/8" in capsys.readouterr().err


def test_bench_also_no_triton_runs_a_second_process(capfd, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "32,64,48", "--epilogues", "bias+gelu_tanh", "--configs", "auto",
            "128,128,1,2,pingpong=1", "--rounds", "1", "--min-round-time", "0.001", "--skip-check",
            "--also-no-triton", "--json", str(out_json)]
    assert main(argv) == 0
    report = json.loads(out_json.read_text())
    assert [r["config"] for r in report["no_triton"]] == ["auto", "128,128,1,2,pingpong=1"]
    # the child's own file stays next to ours, complete
    child = json.loads((tmp_path / "bench.no_triton.json").read_text())
    assert child["complete"] and child["results"] == report["no_triton"]
    assert all(r["err"] is None and r["ours_s"] > 0 for r in report["no_triton"])
    # the child prints its own table, titled with the flag its XLA runs with
    assert "baseline: XLA with --xla_gpu_enable_triton_gemm=false" in capfd.readouterr().out


def test_bench_training_step(capsys):
    # a dense layer's output and its three gradients, ours and plain JAX's, each checked
    # against float32 math; the TFLOP/s count its three GEMMs, and the bound times those three
    # GEMMs alone
    import numpy as np

    problem = bench.bench_problem("train:bias+gelu_tanh", (256, 384, 128, 1))
    assert problem.gemms == 3 and [s.shape for s in problem.specs] == [(256, 128), (128, 384), (384,), (256, 384)]
    inputs = bench.random_inputs(problem.specs, jax.random.key(1), problem.stds)
    # the kernel as nn.Dense initializes it (variance 1/K): pre-activations of order 1
    assert np.std(np.asarray(inputs[1], np.float32)) == pytest.approx(128 ** -0.5, rel=0.05)
    assert np.std(np.asarray(inputs[0], np.float32)) == pytest.approx(1.0, rel=0.05)
    ours, ref = problem.ours(*inputs), problem.reference(*inputs)
    assert [o.shape for o in ours] == [(256, 384), (256, 128), (128, 384), (384,)]
    for o, r in zip(ours, ref):
        o, r = np.asarray(o, np.float32), np.asarray(r)
        assert np.linalg.norm(o - r) / np.linalg.norm(r) < 2e-2
    x, kernel, _, dy = (np.asarray(v, np.float64) for v in inputs)
    for alone in (problem.gemms_alone, problem.baseline_gemms_alone):
        for got, want in zip(alone(*inputs), (x @ kernel, dy @ kernel.T, x.T @ dy)):
            np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2 * np.abs(want).max())
    (r,) = bench.run([problem], rounds=2, calls=1, bound=True)
    assert r.plain_s > 0 and r.bound == r.baseline_s / r.plain_s
    assert r.baseline_plain_s > 0 and r.baseline_bound == r.baseline_s / r.baseline_plain_s
    assert r.err < 2e-2 and r.baseline_err < 2e-2
    assert r.tflops == pytest.approx(6 * 256 * 384 * 128 / r.ours_s / 1e12)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args(["--epilogues", "gemm,train:bias+silu"]).epilogues == ["gemm", "train:bias+silu"]
    with pytest.raises(ValueError, match="without a batch"):
        bench.bench_problem("train:bias+silu", (64, 64, 64, 2))



@pytest.mark.parametrize("name, stored_a, stored_b", [("gemm-at", (48, 32), (48, 64)),
                                                      ("gemm-bt", (32, 48), (64, 48))])
def test_bench_transposed_gemms(name, stored_a, stored_b):
    # a training step's backward GEMMs one by one: A or B stored transposed, read in place by
    # ours and by XLA's dot, each against the float64 product of what is stored
    import numpy as np

    problem = bench.bench_problem(name, (32, 64, 48, 1))
    assert [s.shape for s in problem.specs] == [stored_a, stored_b]
    a, b = bench.random_inputs(problem.specs, jax.random.key(2))
    a64, b64 = (np.asarray(v, np.float64) for v in (a, b))
    want = (a64.T @ b64) if name == "gemm-at" else (a64 @ b64.T)
    for got in (problem.ours(a, b), problem.baseline(a, b), problem.gemms_alone(a, b),
                problem.baseline_gemms_alone(a, b)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("name", ["grouped-wgrad:gemm", "grouped-wgrad-skewed:gemm"])
def test_bench_grouped_weight_gradient(name):
    # the experts' weight gradient (G, K, N) of x (M, K) and the output gradient (M, N): each
    # expert's rows of x, transposed, times the gradient's, ours and ragged_dot's VJP against
    # float64, with the TFLOP/s of one M x N x K GEMM shared by the experts
    import numpy as np

    from jax_efc.bench import problems

    m, n, k, g = 96, 40, 24, 3
    problem = bench.bench_problem(name, (m, n, k, g))
    assert [s.shape for s in problem.specs] == [(m, k), (m, n)] and problem.gemms == 1 / g
    x, dy = bench.random_inputs(problem.specs, jax.random.key(0), problem.stds)
    sizes = problems.group_sizes(m, g, "skewed" in name)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    ends = np.cumsum(sizes)
    want = np.stack([x64[e - s:e].T @ dy64[e - s:e] for s, e in zip(sizes, ends)])
    for got in (problem.ours(x, dy), problem.baseline(x, dy)):
        assert got.shape == (g, k, n)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("name,gated", [("train:mlp+gelu_tanh", False), ("train:gated_mlp+silu", True)])
def test_bench_mlp_training_step(name, gated):
    # an MLP's output and the gradients of x and every parameter, ours and plain JAX's, each
    # checked against float32 math; the TFLOP/s count its six (gated: nine) GEMMs
    import numpy as np

    m, n, k = 256, 384, 128
    problem = bench.bench_problem(name, (m, n, k, 1))
    layers = [(k, n), (n,), (n, k), (k,)] + [(k, n), (n,)] * gated
    assert problem.gemms == (9 if gated else 6)
    assert [s.shape for s in problem.specs] == [(m, k), *layers, (m, k)]
    inputs = bench.random_inputs(problem.specs, jax.random.key(1), problem.stds)
    assert np.std(np.asarray(inputs[3], np.float32)) == pytest.approx(n ** -0.5, rel=0.05)
    ours, ref = problem.ours(*inputs), problem.reference(*inputs)
    assert [o.shape for o in ours] == [(m, k), (m, k), *layers]
    for o, r in zip(ours, ref):
        o, r = np.asarray(o, np.float32), np.asarray(r)
        assert np.linalg.norm(o - r) / np.linalg.norm(r) < 2e-2
    # the bound times the step's GEMMs alone: as many, and of the step's shapes
    alone, xla_alone = problem.gemms_alone(*inputs), problem.baseline_gemms_alone(*inputs)
    assert len(alone) == problem.gemms
    assert sorted(o.shape for o in alone) == sorted([(m, n), (m, k), (m, n), (n, k), (m, k), (k, n)]
                                                    + [(m, n), (m, k), (k, n)] * gated)
    h = np.asarray(inputs[0], np.float64) @ np.asarray(inputs[1], np.float64)
    np.testing.assert_allclose(np.asarray(alone[0], np.float64), h, atol=2e-2 * np.abs(h).max())
    for ours_gemm, xla_gemm in zip(alone, xla_alone):
        want = np.asarray(xla_gemm, np.float64)
        np.testing.assert_allclose(np.asarray(ours_gemm, np.float64), want, atol=2e-2 * np.abs(want).max())
    (r,) = bench.run([problem], rounds=2, calls=1, bound=True)
    assert r.plain_s > 0 and r.bound == r.baseline_s / r.plain_s
    assert r.err < 2e-2 and r.baseline_err < 2e-2
    assert r.tflops == pytest.approx(2 * problem.gemms * m * n * k / r.ours_s / 1e12)
    with pytest.raises(ValueError, match="leave --configs at auto"):
        bench.bench_problem(name, (m, n, k, 1), config=bench.parse_config("128,128"))

def test_measure_together_refuses_mixed_problems():
    problems = [bench.bench_problem("gemm", (32, 64, 48, 1)), bench.bench_problem("gemm", (64, 64, 48, 1))]
    with pytest.raises(ValueError, match="one epilogue, shape and dtype"):
        bench.measure_together(problems)


@pytest.mark.parametrize("n", range(1, bench.MAX_TIMED + 1))  # every size it accepts
def test_timing_order_balances_the_neighbours(n):
    # every function is timed right after every other one equally often, counting the seams
    # between rounds and the warm-up (last function first) before the first round (the one
    # timed right after the baseline ran faster on an H200); each round times every function once
    order = bench.timing_order(n, 6)
    rounds = len(order) // n
    assert len(order) % n == 0 and rounds >= 6 and (n == 1 or rounds % (n - 1) == 0)
    assert all(sorted(order[r * n:(r + 1) * n]) == list(range(n)) for r in range(rounds))
    seq = [n - 1, *order]
    follows = collections.Counter(zip(seq, seq[1:]))
    if n == 1:
        assert follows == {(0, 0): 6}
    else:
        assert len(follows) == n * (n - 1) and set(follows.values()) == {rounds // (n - 1)}


def test_timing_order_refuses_too_many_functions():
    with pytest.raises(ValueError, match="at most 16"):
        bench.timing_order(bench.MAX_TIMED + 1, 6)
    with pytest.raises(SystemExit, match="at most 13 configs"):
        bench.main(["--shapes", "64,64,64", "--configs", *["auto"] * 14])


def test_rounds_follow_the_timing_order():
    log = []

    def named(name):
        def fn(x):
            log.append(name)
            return x
        return fn

    x = jax.numpy.ones(4)
    times, windows = bench.timing.time_interleaved([named("a"), named("b"), named("base")], [(x,)], rounds=3,
                                 calls=1, min_round_s=0.0, warmup=1)
    names = ("a", "b", "base")
    order = [names[i] for i in bench.timing_order(3, 3)]
    assert log[:6] == ["a", "a", "b", "b", "base", "base"]  # a warm-up call and a probe each
    assert log[6:12] == order[:6]  # one untimed cycle (2 rounds of 3) settles the clock
    assert log[12:] == order
    assert len(times) == 3 and all(len(w) == 4 for w in windows)  # 3 rounds made two cycles of 2
    # each window is the function's own round: rounds follow one another
    assert windows[0][1][0] >= windows[0][0][1]

    log.clear()  # a lone function settles for one untimed round
    times, windows = bench.timing.time_interleaved([named("a")], [(x,)], rounds=2, calls=3, min_round_s=0.0, warmup=1)
    assert len(log) == 2 + 3 + 2 * 3 and len(windows[0]) == 2


_FAKE_SMI = """
import sys, time
print("clocks.current.sm [MHz], power.draw [W]")  # a header: skipped
print("[N/A], [N/A]", flush=True)
while True:
    print("1500, 650.5", flush=True)
    time.sleep(0.002)
"""


def test_clock_sampler_attributes_samples_to_rounds():
    # no settling time: the CPU's rounds may last only a few milliseconds
    with bench.ClockSampler(settle_s=0.0, command=[sys.executable, "-c", _FAKE_SMI]) as clocks:
        problems = [bench.bench_problem("gemm", (512, 512, 512, 1))]
        (r,) = bench.run(problems, rounds=2, calls=20, clocks=clocks)
        (with_bound,) = bench.run(problems, rounds=2, calls=20, clocks=clocks, bound=True)
    assert clocks.samples and all(s[1:] == (1500.0, 650.5) for s in clocks.samples)
    assert (r.ours_mhz, r.baseline_mhz, r.ours_watts, r.baseline_watts) == (1500, 1500, 650.5, 650.5)
    assert (r.plain_mhz, r.plain_watts) == (None, None)
    assert (with_bound.plain_mhz, with_bound.plain_watts) == (1500, 650.5)
    table = bench.format_table([r])
    assert "ours MHz" in table and "650" in table.splitlines()[-1] and "plain MHz" not in table
    head, *_, last = bench.format_table([with_bound]).splitlines()
    assert head.split()[-4:] == ["plain", "MHz", "plain", "W"] and last.split()[-2:] == ["1500", "650"]
    # a window with no samples inside has no median
    assert clocks.median([(0.0, 0.01)]) == (None, None)


def test_clock_sampler_says_when_it_got_nothing():
    failing = [sys.executable, "-c", "import sys; sys.exit('unknown option --loop-ms')"]
    with pytest.warns(RuntimeWarning, match="no clock samples: unknown option --loop-ms"):
        with bench.ClockSampler(command=failing) as clocks:
            time.sleep(1.0)  # the command fails at start-up, as nvidia-smi would on a bad flag
    assert clocks.median([(0.0, float("inf"))]) == (None, None)


@pytest.mark.parametrize("answer, instant", [
    (subprocess.CompletedProcess([], 0, "687.25\n", ""), True),
    (subprocess.CompletedProcess([], 0, "[N/A]\n", ""), False),
    (subprocess.CompletedProcess([], 2, "", "Field \"power.draw.instant\" is not a valid field"), False),
    (FileNotFoundError("nvidia-smi"), False),
])
def test_clock_sampler_prefers_instant_power(monkeypatch, answer, instant):
    # power.draw is a one-second average on current drivers: the sampler asks for the
    # instantaneous reading where this nvidia-smi gives one as a number
    def fake_run(cmd, **kw):
        assert "--query-gpu=power.draw.instant" in cmd
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(bench.timing.subprocess, "run", fake_run)
    query = [c for c in bench.ClockSampler().command if c.startswith("--query-gpu=")]
    assert query == ["--query-gpu=clocks.sm," + ("power.draw.instant" if instant else "power.draw")]


def test_bench_clocks_need_nvidia_smi(capsys, monkeypatch):
    monkeypatch.setattr(bench.command.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shapes", "32,32,32", "--clocks"])
    assert e.value.code == 2 and "nvidia-smi" in capsys.readouterr().err


def test_bench_plot_without_matplotlib(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("matplotlib") else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shapes", "32,32,32", "--plot", "x.png"])
    assert e.value.code == 2 and "matplotlib" in capsys.readouterr().err


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for field in ("jax:", "devices:", "GPU arch:", "fused_dense gelu_tanh:", "CuTe DSL kernels:"):
        assert field in out


def test_standard_shape_set():
    assert len(bench.STANDARD_SHAPES) == 19 and (8192, 8192, 8192, 1) in bench.STANDARD_SHAPES
    assert (16384, 28672, 8192, 1) in bench.STANDARD_SHAPES and (1000, 14336, 4096, 1) in bench.STANDARD_SHAPES


def test_bench_configs_round_trip():
    import argparse

    from jax_efc.bench import config_label, parse_config
    from jax_efc.config import GemmConfig

    assert parse_config("auto") is None and config_label(None) == "auto"
    cfg = parse_config("128,256,2,1,swizzle=8,raster=n,pingpong=0")
    assert cfg == GemmConfig(128, 256, 2, 1, raster="n", swizzle=8)
    assert parse_config(config_label(cfg)) == cfg
    assert parse_config(config_label(GemmConfig(64, 256, pingpong=True))).pingpong is True
    assert parse_config("128,128,1,2,stream_k=0").stream_k is False
    for bad in ("128,x", "128,256,colour=1", "1,2,3,4,5,6,7,8,9"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a config"):
            parse_config(bad)


@pytest.mark.parametrize("epilogue, plain", [
    ("bias+gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True)),
    ("bias+gelu", lambda x: jax.nn.gelu(x, approximate=False)),
    ("bias+silu", jax.nn.silu),
])
def test_bench_baseline_is_plain_jax(epilogue, plain):
    # the baseline is what a user without jax_efc writes: XLA recognises jax.nn.gelu's own
    # graph (cuBLASLt's BIAS_GELU epilogue with Triton GEMMs off), not a rewritten form
    problem = bench.bench_problem(epilogue, (32, 64, 48, 1))

    def inner(fn):
        (eqn,) = jax.make_jaxpr(fn)(*problem.specs).eqns  # the jitted call
        return str(eqn.params["jaxpr"])

    assert inner(problem.baseline) == inner(jax.jit(lambda a, b, bias: plain(a @ b + bias)))


def test_progress_keeps_long_labels(capsys):
    from jax_efc.bench import text_progress

    label = "8192x4096x4096 alpha-beta 128,128,1,2,swizzle=8,epi_n=16,pingpong=1 1.09x"
    text_progress(3, 4, label)
    assert label in capsys.readouterr().err


@pytest.mark.parametrize("name", ["scan:bias+gelu_tanh", "train:scan:bias+silu"])
def test_bench_scanned_layers(name):
    # L layers under lax.scan over stacked kernels and biases, ours and plain JAX's, each
    # checked against float32 math; the TFLOP/s count L GEMMs a pass (3 L for the step)
    import numpy as np

    m, k, l = 96, 64, 3
    train = name.startswith("train:")
    problem = bench.bench_problem(name, (m, k, k, l))
    assert [s.shape for s in problem.specs] == [(m, k), (l, k, k), (l, k)] + [(m, k)] * train
    inputs = bench.random_inputs(problem.specs, jax.random.key(2), problem.stds)
    assert np.std(np.asarray(inputs[1], np.float32)) == pytest.approx(k ** -0.5, rel=0.05)
    ours, ref = problem.ours(*inputs), problem.reference(*inputs)
    expected = [(m, k), (m, k), (l, k, k), (l, k)] if train else [(m, k)]
    assert [o.shape for o in jax.tree.leaves(ours)] == expected
    for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float32), np.asarray(r)
        assert np.linalg.norm(o - r) / np.linalg.norm(r) < 2e-2
    if not train:  # the scan applies the layers in turn
        h, kernels, biases = (v.astype(np.float32) for v in inputs)
        for i in range(l):
            h = jax.nn.gelu(h @ kernels[i] + biases[i])
        np.testing.assert_allclose(np.asarray(ref), np.asarray(h), rtol=1e-4, atol=1e-4)
    (r,) = bench.run([problem], rounds=2, calls=1, bound=True)
    assert r.plain_s is None and r.err < 2e-2 and r.baseline_err < 2e-2
    assert r.tflops == pytest.approx(2 * problem.gemms * m * k * k * l / r.ours_s / 1e12)
    with pytest.raises(ValueError, match="give M,K,K,L"):
        bench.bench_problem(name, (m, 2 * k, k, l))
    with pytest.raises(ValueError, match="give M,K,K,L"):
        bench.bench_problem(name, (m, k, k, 1))


def test_cache_command(capsys, tmp_path, monkeypatch):
    from jax_efc.ffi import kernel_cache

    monkeypatch.setenv("JAX_EFC_CACHE_DIR", str(tmp_path))
    key = kernel_cache.entry_key(("k",), [], [], [], {})
    kernel_cache.store(key, kernel_cache.Entry(b"module", b"fingerprint", (), (), ()))
    assert main(["cache"]) == 0
    assert f"{tmp_path / 'kernels'}: 1 entries" in capsys.readouterr().out
    assert main(["info"]) == 0
    assert "jax_efc kernels:" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and kernel_cache.usage() == (0, 0)


def test_run_takes_the_cutlass_examples_layout_flags(capsys):
    """--a_major/--b_major/--c_major change how A, B and C are stored (the check still passes),
    --tolerance sets the check's bound, and flags without meaning here are named."""
    args = ["run", "--mnkl", "96,64,48,2", "--iterations", "2", "--a_major", "m", "--b_major", "k",
            "--c_major", "m", "--use_2cta_instrs", "--use_cold_l2"]
    assert main(args + ["--tolerance", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "--use_2cta_instrs: 2-CTA MMA is a Blackwell (sm_100) instruction" in out
    assert "--use_cold_l2:" in out and "--c_major m:" in out
    assert "ok (tolerance 5e-02)" in out
    assert main(args + ["--tolerance", "1e-9"]) == 1  # bf16 cannot meet it: the check fails
    assert "FAIL (tolerance 1e-09)" in capsys.readouterr().out


def test_run_says_what_it_is_doing_and_times_a_pinned_config_beside_the_heuristics(capsys):
    assert main(["run", "--mnkl", "96,64,48,1", "--iterations", "2", "--mma_tiler_mn", "128,128"]) == 0
    err = capsys.readouterr().err
    stages = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[")]
    assert stages[1:] == ["compiling, and checking against the float32 reference",
                          "warming up and timing 3 functions in interleaved rounds", "done"]


def test_bench_plots_a_saved_run(tmp_path, capsys, monkeypatch):
    """`--from-json` draws a run's --json file without measuring; a file that is not one, or a
    missing --plot, is an error naming the flag."""
    import importlib.util

    drawn = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # matplotlib "installed"
    monkeypatch.setattr(bench, "plot", lambda report, path: drawn.append((report, path)))
    monkeypatch.setattr(bench, "run_from_args", lambda args: pytest.fail("measured"))
    run = {"device": "NVIDIA H200", "results": [{"shape": [8, 8, 8, 1], "epilogue": "gemm", "ratio": 1.0}],
           "no_triton": None}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run))
    assert main(["bench", "--from-json", str(saved), "--plot", str(tmp_path / "r.png")]) == 0
    assert drawn == [(run, str(tmp_path / "r.png"))]
    for argv, needle in ((["--from-json", str(saved)], "give --plot"),
                         (["--from-json", str(tmp_path / "none.json"), "--plot", "r.png"], "not a benchmark --json file")):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_run_names_the_config_each_kernel_ran_with(monkeypatch):
    """On the kernel path `run` prints the config from the very plan the lowering reads: the
    pinned one, or the heuristic's (planned here for sm_90a as on an H200)."""
    pytest.importorskip("cutlass")
    from jax_efc import cli

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    auto = bench.bench_problem("bias+gelu_tanh", (8192, 8192, 8192, 1))
    (line,) = cli._configs_that_ran(auto)
    assert line.startswith("kernel config: tile ") and line.endswith("(the heuristic's)") and "ping-pong" in line
    pinned = bench.bench_problem("bias+gelu_tanh", (8192, 8192, 8192, 1), config=bench.parse_config("128,256,2,1"))
    assert cli._configs_that_ran(pinned) == [
        "kernel config: tile 128x256, cluster 2x1, cooperative, epilogue subtile 128x32 (pinned)"]
    handed = bench.bench_problem("gemm", (64, 4096, 4096, 1))  # XLA's GEMM is faster: no kernel line
    assert cli._configs_that_ran(handed) == []


def test_run_plans_a_2cta_128_row_tile_on_blackwell(monkeypatch):
    """On Blackwell, ``--use_2cta_instrs --mma_tiler_mn 128,N`` pins a 2-CTA pair of 64-row CTA
    tiles in 2x1 clusters, and the kernel plans it (compiled for sm_100a here)."""
    pytest.importorskip("cutlass")
    import argparse

    from jax_efc import cli
    from jax_efc.config import GemmConfig

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv("JAX_EFC_UNVERIFIED_KERNELS", "1")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    parser = argparse.ArgumentParser()
    cli._add_run(parser.add_subparsers())
    dtypes = [arg for name in "cdxy" for arg in (f"--{name}_dtype", "BFloat16")]
    args = parser.parse_args(["run", "--mnkl", "1024,2048,512,1", "--use_2cta_instrs", "--mma_tiler_mn", "128,256",
                              *dtypes])
    assert cli._config(args) == GemmConfig(128, 256, 2, 1, use_2cta=True)
    assert cli._configs_that_ran(cli._run_problem(args)) == [
        "kernel config: tile 128x256, cluster 2x1, 2-CTA, epilogue subtile 64x32 (pinned)"]


@pytest.mark.parametrize("name", bench.EIGHT_BIT_EPILOGUES)
def test_bench_eight_bit_problems(name):
    """The 8-bit problems: e4m3 (or int8) A and B in the named layout, both sides checked
    against float32 math of the same 8-bit values; the baseline is XLA's 8-bit dot."""
    m, n, k = 96, 128, 256
    problem = bench.bench_problem(name, (m, n, k, 1))
    assert problem.dtype == ("int8" if name.startswith("int8") else "float8_e4m3fn")
    assert problem.specs[1].shape == ((k, n) if name.startswith("fp8kn") else (n, k))
    (r,) = bench.run([problem], rounds=2, calls=1)
    # an e4m3 output keeps 3 mantissa bits; int8 accumulates exactly
    tolerance = 7e-2 if name.endswith("->fp8") else 1e-7 if name.startswith("int8") else 1e-2
    assert r.err < tolerance and r.baseline_err < tolerance, (r.err, r.baseline_err)
    with pytest.raises(ValueError, match="takes no batch"):
        bench.bench_problem(name, (m, n, k, 2))


def test_selftest_passes_here_and_reports_a_wrong_answer(tmp_path, capsys):
    """Every case passes on this machine (the reference on a CPU), the table names the backend,
    and a case whose answer is wrong is a FAIL with a nonzero exit status."""
    import dataclasses

    from jax_efc import cli, selftest

    path = tmp_path / "rows.json"
    assert cli.main(["selftest", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(selftest.CASES)} of {len(selftest.CASES)} passed" in out and "backend" in out
    rows = json.loads(path.read_text())
    assert [r["case"] for r in rows] == [c.name for c in selftest.CASES] and all(r["result"] == "PASS" for r in rows)
    wrong = dataclasses.replace(selftest.CASES[0], name="off by one", oracle=lambda acc: acc + 1.0)
    (row,) = selftest.run((wrong,))
    assert row["result"] == "FAIL" and row["error"] > row["bound"]
    broken = dataclasses.replace(selftest.CASES[0], name="raises", epilogue=lambda acc: acc @ acc)
    (row,) = selftest.run((broken,))
    assert row["result"] == "FAIL" and "EpilogueError" in row["why"]
    # the gated case's oracle pairs each gate block with its own up block: swapped, it fails
    (gated,) = [c for c in selftest.CASES if c.gated]
    swapped = dataclasses.replace(gated, name="gate and up swapped", oracle=lambda g, u, b: gated.oracle(u, g, b))
    (row,) = selftest.run((swapped,))
    assert row["result"] == "FAIL" and row["error"] > row["bound"]
    # the grouped case's oracle gives each row its own group's bias: reversed, it fails
    (grouped,) = [c for c in selftest.CASES if c.groups and not c.weight_gradient]
    reversed_bias = dataclasses.replace(grouped, name="biases reversed", oracle=lambda acc, b: grouped.oracle(acc, b[::-1]))
    (row,) = selftest.run((reversed_bias,))
    assert row["result"] == "FAIL" and row["error"] > row["bound"]
    # the weight gradient's oracle gives each group its own rows' product: groups reversed, it fails
    (wgrad,) = [c for c in selftest.CASES if c.weight_gradient]
    (row,) = selftest.run((dataclasses.replace(wgrad, name="groups reversed", oracle=lambda acc: acc[::-1]),))
    assert row["result"] == "FAIL" and row["error"] > row["bound"]
