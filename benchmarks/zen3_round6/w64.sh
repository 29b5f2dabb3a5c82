#!/bin/bash
# W64 (float32, 2 GiB of KV) beside vLLM 0.32's CPU build: the packed default (two int8 activation
# levels) and one activation level (--quant-activations int8), two invocations; the code at
# w64/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, probe
begin_round /work/main/benchmarks/zen3_round6/w64
for i in 1 2; do
  probe run_$i
  $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
    --dtype float32 --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
    --compare 'pagedllm,vllm,pagedllm[--quant-activations int8]' \
    --json $O/run_$i.json > $O/run_$i.log 2>&1
done
probe end
echo done > $O/done
