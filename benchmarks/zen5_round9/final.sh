#!/bin/bash
# The session's final code (*/commit.txt) beside the peers: W64 bfloat16 beside vLLM 0.32 in bfloat16
# (two invocations), W64 float32 beside vLLM (two), one request 128 -> 128 beside llama.cpp on the
# same Q4_1 file (three), a read probe around each.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round9/w64
lscpu > $O/lscpu.txt
w64_bf16_beside_vllm 2
w64_beside_vllm 'pagedllm,vllm'
begin_round /work/main/benchmarks/zen5_round9/latency_llamacpp
latency_beside_llamacpp
echo done > /work/main/benchmarks/zen5_round9/final_done
