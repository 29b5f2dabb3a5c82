#!/bin/bash
# The round's end on AMD Zen 3 (AVX2): pagedllm beside llama.cpp and vLLM 0.32's CPU build in the
# same invocations, code at the commit in final/commit.txt (a worktree, so the checkout may change).
set -u
O=/work/main/benchmarks/zen3_round1/final
T=${T:-/tmp/final}
P=/work/main/.venv/bin
cd /tmp
export PYTHONPATH=$T
export PAGEDLLM_LLAMACPP_PYTHON=/work/llamacpp-venv/bin/python
. /work/main/benchmarks/round_lib.sh  # probe
git -C $T rev-parse --short HEAD > $O/commit.txt
probe start
$P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
  --peer-python /work/peer-vllm/bin/python --compare pagedllm,llamacpp,vllm \
  --json $O/latency_1.json > $O/latency_1.log 2>&1
probe latency
$P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--kv-cache-dtype int8],vllm,pagedllm[--dtype bfloat16],pagedllm,pagedllm[--kv-cache-dtype int8]' \
  --json $O/w64.json > $O/w64.log 2>&1
probe w64
for i in 2 3; do
  $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
    --compare pagedllm,llamacpp --json $O/latency_$i.json > $O/latency_$i.log 2>&1
done
probe end
echo done > $O/done
