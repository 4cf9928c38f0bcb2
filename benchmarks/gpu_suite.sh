#!/usr/bin/env bash
# What must be seen on a GPU, in parts that each fit a ten-minute run on an H100 or H200 from a
# cold kernel cache (run them in this order; `all` runs every part). Logs go to LOGDIR (default
# ./gpu-logs); each part prints its summary last.
#   usage: benchmarks/gpu_suite.sh [LOGDIR] [promotion|grouped|fused|ffn|tests|stores|examples|bench|model|fp8|all]
#
#   promotion 8-bit float partial sums promoted every second k-tile (the default, a cooperative
#             tile's warpgroups at alternate k-tiles) and each (at HIGHEST): GPU tests, speed and
#             error against fast accumulation and XLA's; fast accumulation in the promoting
#             kernels' tile
#   grouped   the grouped GEMM: its numerics; its speed (and its weight gradient's) against
#             ragged_dot, Pallas's Mosaic GPU ragged dot and a dense GEMM of the same FLOPs; an
#             MoE layer's training step against ragged_dot's
#   fused     the gated GEMMs' speed alone, and the MLPs' training steps (GELU, gated); the epilogue
#             reductions' cost (deterministic and by atomics); a row softmax in the kernel; a
#             dense layer's training step and its GEMMs' bound; the weight gradients' GEMMs alone
#   ffn       a dense layer's training step over the benchmark's twelve FFN shapes
#   tests     the rest of the GPU tests but `stores`' (the compute-sanitizer runs, marked slow, apart)
#   stores    the epilogue reductions' (in-tile row ones too), transposed and masked outputs' GPU tests
#   examples  each example at a GPU size, `jax-efc run`, info and selftest
#   bench     the benchmark's shapes with both XLA baselines, the 8-bit epilogues, TF32 (B in both
#             layouts), autotuning's gain over the heuristic, one config timed twice (the spread),
#             and autotuning on 114 of the SMs (benchmarks/fewer_sms.sh)
#   model     a GPT-style model's first step (compile time), its training step in bf16 and FP8
#   fp8       the bound that model's GEMM share sets on any FP8 step's speedup, the FP8 dense
#             layer's training step against Flax's FP8 Dense, and both kernel by kernel
set -uo pipefail
logs=${1:-gpu-logs}
part=${2:-all}
mkdir -p "$logs"
summary=()
step() {  # step NAME COMMAND...: run, log, and remember the exit status
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$logs/$name.log")")")
}
shapes="8192,8192,8192 8192,14336,4096 4096,4096,4096"
want() { [[ $part == all || $part == "$1" ]]; }

if want promotion; then
  step promotion-tests python3 -m pytest -q -m gpu tests/test_gpu_low_precision.py -k every_two
  # promoted partial sums, each k-tile and every second one, against fast accumulation, ours and
  # XLA's, with the errors at K = 16384
  step promotion python3 benchmarks/promotion.py --shapes $shapes 2048,2048,16384
  # where promotion's time goes: fast accumulation in the promoting kernels' tile (cooperative
  # 128x192, 2x1) against its own heuristic's tiles; as slow as promoting would put it in the tile
  step promotion-tiles python3 benchmarks/run.py --json "$logs/promotion-tiles.json" \
    --shapes 8192,8192,8192 8192,14336,4096 --epilogues fp8:gemm,fp8fast:gemm --configs auto 128,192,2,1,swizzle=8
fi

if want grouped; then
  step grouped python3 -m pytest -q -m gpu tests/test_gpu_grouped.py tests/test_fuzz_grouped.py
  step bench-grouped python3 benchmarks/run.py --json "$logs/bench-grouped.json" \
    --epilogues grouped:bias+silu,grouped-skewed:bias+silu,grouped-wgrad:gemm,grouped-wgrad-skewed:gemm \
    --shapes 16384,14336,4096,8 16384,3584,4096,8 16384,3584,4096,64
  step grouped-peers python3 benchmarks/grouped_peers.py --routing balanced skewed --configs auto 128,128,1,2,pingpong=1 128,256,1,1
  step moe-step python3 benchmarks/moe_step.py
fi
if want fused; then
  step bench-gated python3 benchmarks/run.py --json "$logs/bench-gated.json" --epilogues gated:swiglu,gated:geglu \
    --shapes 8192,14336,4096 4096,14336,4096
  step bench-gated-mlp python3 benchmarks/run.py --bound --json "$logs/bench-gated-mlp.json" \
    --epilogues train:mlp+gelu_tanh,train:gated_mlp+silu,train:interleaved_mlp+silu --shapes 8192,14336,4096
  step bench-reduce python3 benchmarks/run.py --json "$logs/bench-reduce.json" \
    --epilogues bias+gelu_tanh,bias+gelu_tanh+colsum,bias+gelu_tanh+colsum-atomic --shapes $shapes
  step bench-row python3 benchmarks/run.py --json "$logs/bench-row.json" --epilogues gemm,bias+softmax \
    --shapes 16384,128,4096 16384,64,4096
  # a dense layer's training step (fused bias gradient), and XLA's step over our three GEMMs alone
  # the weight gradients' GEMMs (A stored (K, M)) of the dense and MLP steps, against XLA's dot
  step bench-wgrad python3 benchmarks/run.py --clocks --json "$logs/bench-wgrad.json" --epilogues gemm-at \
    --shapes 4096,14336,8192 14336,4096,8192 4096,4096,8192 14336,4096,4096 4096,14336,4096
  step bench-train python3 benchmarks/run.py --bound --json "$logs/bench-train.json" \
    --epilogues train:bias+gelu_tanh --shapes 8192,14336,4096 8192,4096,14336 8192,4096,4096
fi
if want ffn; then
  step bench-train-ffn python3 benchmarks/run.py --clocks --json "$logs/bench-train-ffn.json" --epilogues train:bias+gelu_tanh \
    --shapes 4096,14336,4096 4096,4096,14336 4096,4096,4096 4096,28672,8192 8192,14336,4096 8192,4096,14336 \
    8192,4096,4096 8192,28672,8192 16384,14336,4096 16384,4096,14336 16384,4096,4096 16384,28672,8192
fi
if want tests; then
  step gpu-tests python3 -m pytest -q -m "gpu and not slow" tests \
    --deselect tests/test_gpu_grouped.py --deselect tests/test_fuzz_grouped.py --deselect tests/test_gpu_reductions.py --deselect tests/test_gpu_row_stats.py --deselect tests/test_transposed.py --deselect tests/test_masked_stores.py
fi
if want stores; then
  step stores python3 -m pytest -q -m gpu tests/test_gpu_reductions.py tests/test_gpu_row_stats.py \
    tests/test_transposed.py tests/test_masked_stores.py
fi
if want examples; then
  step jax-efc-run python3 -m jax_efc run --mnkl 8192,8192,8192,1 --ab_dtype Float16 --c_dtype Float16 \
    --d_dtype Float16 --x_dtype Float16 --y_dtype Float16 --epilogue alpha-beta --alpha 2.0 --beta 1.0 --x_factor 3.0
  step alpha-beta python3 examples/alpha_beta.py --mnkl 8192,8192,8192,1
  step activation python3 examples/activation.py --mnk 8192,4096,4096
  step multi-output python3 examples/multi_output.py --mnkl 4096,4096,4096,2
  step complex python3 examples/complex_epilogue.py --mnk 4096,4096,4096
  step fp8-scaled python3 examples/fp8_scaled.py --mnk 8192,8192,8192
  step flax-mlp python3 examples/flax_mlp.py --features 4096,14336,4096 --batch 8192 --dtype bfloat16 --steps 20
  step sharded python3 examples/sharded_training.py --mesh 1,1 --dtype bfloat16 --batch 8192 --width 4096 --hidden 14336
  step info python3 -m jax_efc info
  step selftest python3 -m jax_efc selftest
fi
if want bench; then
  step bench python3 benchmarks/run.py --also-no-triton --json "$logs/bench.json" \
    --shapes 8192,8192,8192 8192,14336,4096 8192,4096,14336 8192,4096,4096 1000,4096,4096
  step bench-8bit python3 benchmarks/run.py --json "$logs/bench-8bit.json" \
    --epilogues "$(python3 -c 'import jax_efc.bench as b; print(",".join(b.EIGHT_BIT_EPILOGUES))')" --shapes $shapes
  step bench-tf32 python3 benchmarks/run.py --dtype float32 --json "$logs/bench-tf32.json" \
    --epilogues gemm,gemm-bt,bias+gelu_tanh --shapes 8192,8192,8192 4096,4096,4096
  step tf32-rounding python3 benchmarks/tf32_rounding.py
  step bench-autotune python3 benchmarks/run.py --json "$logs/bench-autotune.json" --configs auto autotune \
    --epilogues gemm,bias+gelu_tanh --shapes $shapes
  # the benchmark's own spread: the heuristic's config timed twice in the same rounds, the
  # yardstick for autotuning's gain (tuned rows that ran the heuristic's kernel came out up to
  # 3.9% apart on an H100: benchmarks/FINDINGS.md, "Seventh sitting")
  step bench-same-config python3 benchmarks/run.py --json "$logs/bench-same-config.json" --configs auto auto \
    --epilogues gemm,bias+gelu_tanh --shapes $shapes
  # autotuning on another SM count: an MPS client held to 87% of the SMs (114 of 132)
  step autotune-fewer-sms benchmarks/fewer_sms.sh 87 env JAX_EFC_CACHE_DIR="$logs/cache-fewer-sms" \
    python3 benchmarks/run.py --configs auto autotune --epilogues gemm,bias+gelu_tanh --shapes 4096,4096,4096
fi
if want model; then
  step first-step python3 benchmarks/first_step.py
  step gpt-fp8 python3 examples/gpt_fp8.py --blocks 4 --width 2048 --heads 16 --batch 8 --seq 2048 --steps 60 \
    --layers dense,fp8,fp8-fast,flax-fp8 --attention cudnn
fi
if want fp8; then
  step fp8-bound python3 benchmarks/fp8_bound.py --attention cudnn
  step fp8-layer python3 benchmarks/run.py --json "$logs/fp8-layer.json" --shapes 8192,14336,4096 8192,4096,14336 \
    --epilogues "$(python3 -c 'import jax_efc.bench as b; print(",".join(b.FP8_TRAIN_STEPS))')"
  step fp8-breakdown python3 benchmarks/breakdown.py --epilogues fp8train:bias+gelu_tanh --shapes 8192,14336,4096
  step gpt-breakdown python3 benchmarks/breakdown.py --gpt fp8,fp8-fast,flax-fp8 --attention cudnn --hlo "$logs/hlo"
fi
for f in "$logs"/*.log; do
  printf '\n===== %s\n' "$f"; tail -n 30 "$f"
done
printf '\n===== summary\n'
printf '%s\n' "${summary[@]}"
