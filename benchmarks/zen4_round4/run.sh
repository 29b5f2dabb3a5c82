#!/bin/bash
# The commands behind docs/benchmarks.md, "Packed matmuls, many rows: what the compiler made of the tile kernels".
# Outputs in /tmp/z4d. Run from a checkout at /work/main with vLLM's CPU build in /work/peer-vllm;
# BEFORE: a checkout of the commit before the change (git worktree add /tmp/exp/before b3e7e82).
set -u
O=${O:-/tmp/z4d}
BEFORE=${BEFORE:-/tmp/exp/before}
mkdir -p $O
cd /tmp   # not the checkout: python -m would put its directory ahead of PYTHONPATH
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
V=/work/peer-vllm/bin/python
. /work/main/benchmarks/round_lib.sh  # probe, alternate_w64
lscpu > $O/lscpu.txt
git -C /work/main rev-parse --short HEAD > $O/commit.txt
probe start
export PYTHONPATH=/work/main
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V \
  --compare 'pagedllm,pagedllm@avx2,vllm,pagedllm' --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe w64_fp32
alternate_w64 ab  # before / after, alternating, the default (packed) path
probe ab
echo done > $O/done
