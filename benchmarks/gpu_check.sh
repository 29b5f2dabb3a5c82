#!/usr/bin/env bash
# One CUDA check run: kernels vs the dense oracle, decode bandwidth, engine greedy
# agreement and W64 throughput. Usage: benchmarks/gpu_check.sh [out.json] [extra args...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The script skips parts past its own 280 s budget; the hard limit only guards a hang.
exec timeout 330 "${PYTHON:-python}" benchmarks/gpu_check.py --out "$out" "$@"
