#!/bin/bash
# The session's code (*/commit.txt) beside the other peers: W64 float32 beside vLLM 0.32 (two
# invocations), one request 128 -> 128 beside llama.cpp on the same Q4_1 file (three).
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round7/w64_fp32
w64_beside_vllm 'pagedllm,vllm'
begin_round /work/main/benchmarks/zen5_round7/latency_llamacpp
latency_beside_llamacpp
echo done > /work/main/benchmarks/zen5_round7/peers_done
