#!/usr/bin/env bash
# Everything that must be seen on a GPU, in one go: the GPU tests, each example, the seed's
# `jax-efc run`, and the benchmark with both XLA baselines. Logs go to $1 (default: ./gpu-logs);
# the summary is printed last.
#   usage: benchmarks/gpu_suite.sh [LOGDIR] [--quick | --no-bench]
set -uo pipefail
logs=${1:-gpu-logs}
mkdir -p "$logs"
summary=()
step() {  # step NAME COMMAND...: run, log, and remember the exit status
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$logs/$name.log")")")
}
step gpu-tests python3 -m pytest -q -m gpu tests
step jax-efc-run python3 -m jax_efc run --mnkl 8192,8192,8192,1 --ab_dtype Float16 --c_dtype Float16 --d_dtype Float16 \
  --x_dtype Float16 --y_dtype Float16 --epilogue alpha-beta --alpha 2.0 --beta 1.0 --x_factor 3.0
step alpha-beta python3 examples/alpha_beta.py --mnkl 8192,8192,8192,1
step activation python3 examples/activation.py --mnk 8192,4096,4096
step multi-output python3 examples/multi_output.py --mnkl 4096,4096,4096,2
step complex python3 examples/complex_epilogue.py --mnk 4096,4096,4096
step fp8-scaled python3 examples/fp8_scaled.py --mnk 8192,8192,8192
step flax-mlp python3 examples/flax_mlp.py --features 4096,14336,4096 --batch 8192 --dtype bfloat16 --steps 20
step sharded python3 examples/sharded_training.py --mesh 1,1 --dtype bfloat16 --batch 8192 --width 4096 --hidden 14336
step info python3 -m jax_efc info
step selftest python3 -m jax_efc selftest
if [[ ${2:-} == --no-bench ]]; then
  :
elif [[ ${2:-} == --quick ]]; then
  step bench python3 benchmarks/run.py --quick --also-no-triton --json "$logs/bench.json"
else
  step bench python3 benchmarks/run.py --also-no-triton --json "$logs/bench.json" \
    --shapes 8192,8192,8192 8192,14336,4096 8192,4096,14336 8192,4096,4096 1000,4096,4096
fi
step bench-8bit python3 benchmarks/run.py --json "$logs/bench-8bit.json" \
  --epilogues "$(python3 -c 'import jax_efc.bench as b; print(",".join(b.EIGHT_BIT_EPILOGUES))')" \
  --shapes 8192,8192,8192 8192,14336,4096 4096,4096,4096
# the kernel's epilogue reductions against the same epilogue without them, in one run
step bench-reduce env JAX_EFC_UNVERIFIED_KERNELS=1 python3 benchmarks/run.py --json "$logs/bench-reduce.json" \
  --epilogues bias+gelu_tanh,bias+gelu_tanh+colsum --shapes 8192,8192,8192 8192,14336,4096 8192,4096,14336 4096,4096,4096
step first-step python3 benchmarks/first_step.py
for f in "$logs"/gpu-tests.log "$logs"/bench-8bit.log "$logs"/bench-reduce.log "$logs"/first-step.log "$logs"/jax-efc-run.log "$logs"/flax-mlp.log "$logs"/sharded.log "$logs"/bench.log; do
  [[ -f $f ]] || continue
  printf '\n===== %s\n' "$f"; tail -n 40 "$f"
done
printf '\n===== summary\n'
printf '%s\n' "${summary[@]}"
