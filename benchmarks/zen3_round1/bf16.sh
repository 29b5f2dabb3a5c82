#!/bin/bash
# bfloat16 over packed weights on Zen 3: the modules (7f780a2, /tmp/cur) against the layer stack
# (the commit in bf16/commit.txt, /tmp/bf), one request and W64, float32 beside them.
set -u
O=/work/main/benchmarks/zen3_round1/bf16
P=/work/main/.venv/bin
cd /tmp
git -C /tmp/bf rev-parse --short HEAD > $O/commit.txt
for arm in cur bf cur bf; do
  PYTHONPATH=/tmp/$arm $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 \
    --dtype bfloat16 --json $O/latency_bf16_$arm.json >> $O/latency_bf16_$arm.log 2>&1
done
PYTHONPATH=/tmp/bf $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
  --dtype float32 --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--dtype bfloat16],pagedllm,pagedllm[--dtype bfloat16]' \
  --json $O/w64.json > $O/w64.log 2>&1
echo done > $O/done
