#!/usr/bin/env bash
# Run a command as an MPS client limited to PERCENT of the GPU's SMs: the CUDA device then
# reports that many SMs (132 at 87% gives 114, an H100 PCIe's count), so the tile heuristic,
# the persistent grid and autotuning's records see another SM count on the same GPU.
#   usage: benchmarks/fewer_sms.sh PERCENT COMMAND...
# Starts an MPS control daemon of its own (pipe and log folders under a temporary directory)
# and stops it when the command ends.
set -uo pipefail
percent=$1; shift
dir=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "fewer_sms: could not start an MPS daemon" >&2; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$dir"' EXIT
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$percent
python3 -c "import jax; d = jax.devices()[0]; print(f'{d.device_kind}: {d.core_count} SMs at $percent%')"
"$@"
