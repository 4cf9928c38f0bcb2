"""Side-by-side speed and correctness of jax_efc's fused GEMMs against plain JAX.

How: jitted functions, a warm-up, an untimed cycle of rounds, then several rounds of many
calls (the median round counts), blocking only at the end of a round, random normal inputs
rotated among several sets when they fit in L2, and every variant checked against a float32
reference in the same run. The baseline is the same epilogue in plain JAX under ``jax.jit``.

    python -m jax_efc.bench [--quick | --shapes M,N,K[,L] ...] [--epilogues gemm,bias+gelu_tanh]
                            [--configs auto 192,128,1,2,pingpong=1 ...] [--clocks]
                            [--also-no-triton] [--json out.json [--resume]]

Several ``--configs`` of one epilogue and shape are timed in the same interleaved rounds;
``--clocks`` adds the SM clock and board power each side held (nvidia-smi); ``--bound`` adds
our plain GEMM's time in the same rounds (and, with ``--clocks``, its clock and power), and the
baseline's time over it: the most fusing the epilogue can gain; and the same for the GEMMs as
XLA's dots: the most it could gain with GEMMs at XLA's speed.

``--resume`` keeps the figures a stopped run left in ``--json``'s file and measures only the
rest, so the same command, run again, finishes the set.

``--also-no-triton`` repeats the run in a subprocess with
``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` (XLA reads its flags once, at start-up), so
the baseline is XLA's cuBLASLt-epilogue path, and prints that second table.

The package: ``problems.py`` (shape sets, named epilogues, a :class:`Problem` each),
``timing.py`` (the interleaved-rounds protocol, clocks), ``report.py`` (:class:`Result`,
tables, plots), ``command.py`` (the command line).
"""

from .command import add_arguments, main, parse_config, parse_epilogues, parse_shape, run_from_args
from .problems import (ALPHA_BETA_SCALARS, EPILOGUES, EIGHT_BIT_EPILOGUES, FP8_TRAIN_STEPS, MLP_STEPS, QUICK_SHAPES, REDUCTION_EPILOGUES,
                       SCAN_EPILOGUES, STANDARD_SHAPES,
                       TRAIN_EPILOGUES, Problem, Shape, bench_problem, config_label, epilogue_problem,
                       eight_bit_problem, fp8_train_problem, mlp_problem, random_inputs, scan_problem, train_problem)
from .report import NO_TRITON_FLAG, Result, baseline_title, fixed_width, format_table, plot
from .timing import (MAX_TIMED, PEAK_TFLOPS, ROUNDS, ClockSampler, measure, measure_together, run, text_progress,
                     timing_order)

__all__ = ["Problem", "Result", "Shape", "ROUNDS", "MAX_TIMED", "PEAK_TFLOPS", "STANDARD_SHAPES", "QUICK_SHAPES",
           "EPILOGUES", "EIGHT_BIT_EPILOGUES", "REDUCTION_EPILOGUES", "TRAIN_EPILOGUES", "MLP_STEPS", "SCAN_EPILOGUES", "ALPHA_BETA_SCALARS", "NO_TRITON_FLAG",
           "epilogue_problem", "eight_bit_problem", "train_problem", "mlp_problem", "scan_problem", "bench_problem", "random_inputs",
           "config_label", "measure", "measure_together", "run", "timing_order", "text_progress", "ClockSampler",
           "format_table", "fixed_width", "baseline_title", "plot", "add_arguments", "parse_shape", "parse_config", "parse_epilogues",
           "run_from_args", "main"]
