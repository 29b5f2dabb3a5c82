#!/bin/bash
# Issue 16's and 18's AVX-512-class targets in one round, on the code at */commit.txt (AMD Zen 5
# class VM: AVX-512 with VNNI and bf16, no AMX): decode attention per path and KV layout against
# the read probe; W64 float32 beside vLLM 0.32 (two invocations, the AVX2 path forced and one
# activation level as arms of the same invocation); W64 bfloat16 beside vLLM in bfloat16; one
# request 128 -> 128 beside vLLM (float32) and beside llama.cpp on the same Q4_1 file (three).
set -u
. /work/main/benchmarks/round_lib.sh
R=/work/main/benchmarks/zen5_round1
begin_round $R/attention
lscpu > $O/lscpu.txt
probe start
$P/python /work/main/benchmarks/attention_kernel.py --paths avx512_bf16,avx512,avx2 --kv-layouts token,head \
  --json $O/attention.json > $O/attention.log 2>&1
probe end
begin_round $R/w64
for i in 1 2; do
  probe fp32_$i
  $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
    --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
    --compare 'pagedllm,vllm,pagedllm@avx2,pagedllm[--quant-activations int8]' \
    --json $O/fp32_$i.json > $O/fp32_$i.log 2>&1
done
probe bf16
$P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype bfloat16 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB --compare 'pagedllm,vllm,pagedllm@avx2' \
  --json $O/bf16.json > $O/bf16.log 2>&1
probe end
begin_round $R/latency_vllm
probe start
$P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
  --compare pagedllm,vllm --peer-python /work/peer-vllm/bin/python --json $O/run_1.json > $O/run_1.log 2>&1
probe end
begin_round $R/latency_llamacpp
latency_beside_llamacpp
echo done > $R/done
