#!/usr/bin/env bash
# Every GPU check of the SMA kernels, on a machine with a CUDA GPU: < 5 minutes.
#   bash bench/gpu_checks.sh            (from the repository root)
# 1. every gpu-marked test (Triton compiled on the GPU vs the torch implementation, a fit with
#    kernel_backend="auto" picking Triton, CUDA streams, the memory estimate), 2. the bandwidth table for LeNet-5/ResNet-32/ResNet-50
#    sizes, m ∈ {1,2,4,8} (writes bench/runs/sma_kernel_cuda_*.json).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true
timeout 200 python -m pytest tests -m gpu -q -p no:cacheprovider  # every gpu-marked test
timeout 120 python bench/sma_kernel.py --device cuda --reps 5 --iters 50
