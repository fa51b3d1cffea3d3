#!/usr/bin/env bash
# Run a command with NVIDIA MPS on (the CUDA processes of this host share one GPU context: no time-slicing
# between them), then stop MPS again:   bash scripts/gpu/with_mps.sh python3 scripts/gpu/transfer_bench.py
# Needs nvidia-cuda-mps-control on PATH and the right to start its daemon (root on the lent GPU machine).
set -uo pipefail
command -v nvidia-cuda-mps-control >/dev/null || { echo "with_mps: no nvidia-cuda-mps-control here"; exit 3; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/xpyd-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/xpyd-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "with_mps: the MPS daemon did not start"; exit 3; }
trap 'echo quit | nvidia-cuda-mps-control' EXIT
echo "with_mps: MPS on ($CUDA_MPS_PIPE_DIRECTORY)"
"$@"
