#!/bin/bash
# Every AVX2-class target of issue 16 in one round, on the code at issue16/commit.txt:
# decode attention against the read probe (6 rounds), W64 float32 beside vLLM 0.32 (two invocations,
# with bfloat16 as a third arm of the same invocation: "no cliff"), one request 128 -> 128 in float32
# beside vLLM (two invocations). Logs and JSON under issue16/.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen3_round8/issue16
( cd /work/main/benchmarks && attention_against_probe ) > $O/attention_rounds.log 2>&1
for i in 1 2; do
  probe w64_$i
  $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
    --dtype float32 --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
    --compare 'pagedllm,vllm,pagedllm[--dtype bfloat16]' --json $O/w64_$i.json > $O/w64_$i.log 2>&1
done
for i in 1 2; do
  probe latency_$i
  $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
    --compare pagedllm,vllm --peer-python /work/peer-vllm/bin/python \
    --json $O/latency_$i.json > $O/latency_$i.log 2>&1
done
probe end
echo done > $O/done
