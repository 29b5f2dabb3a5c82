#!/bin/bash
# The last round of docs/benchmarks.md "Packed matmuls, many rows" (code at a876a8d or later):
# the default against int8 KV and vLLM 0.32's CPU build, one invocation, alternating.
set -u
O=${O:-/tmp/z4g}
mkdir -p $O
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
. /work/main/benchmarks/round_lib.sh  # probe
git -C /work/main rev-parse --short HEAD > $O/commit.txt
probe start
$P/pagedllm bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--kv-cache-dtype int8],vllm,pagedllm,pagedllm[--kv-cache-dtype int8],pagedllm@avx2' \
  --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe end
echo done > $O/done
