#!/bin/bash
# The session's last round on the AMD Zen 5 class (code at */commit.txt: float32 KV in the head
# layout on the AVX-512 paths, VNNI's lane kernel and row-scale tables): W64 float32 beside vLLM
# 0.32 (two invocations, one activation level as a third arm), W64 bfloat16 beside vLLM in
# bfloat16, one request 128 -> 128 beside llama.cpp (three invocations) and beside vLLM (one).
set -u
. /work/main/benchmarks/round_lib.sh
R=/work/main/benchmarks/zen5_round2
begin_round $R/w64
lscpu > $O/lscpu.txt
w64_beside_vllm 'pagedllm,vllm,pagedllm[--quant-activations int8]'
probe bf16
$P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype bfloat16 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB --compare 'pagedllm,vllm' \
  --json $O/bf16.json > $O/bf16.log 2>&1
probe bf16_end
begin_round $R/latency_llamacpp
latency_beside_llamacpp
begin_round $R/latency_vllm
probe start
$P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
  --compare pagedllm,vllm --peer-python /work/peer-vllm/bin/python --json $O/run_1.json > $O/run_1.log 2>&1
probe end
echo done > $R/done
