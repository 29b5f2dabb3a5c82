#!/bin/bash
# The lane layout's round (code at */commit.txt): one request 128 -> 128 beside llama.cpp (three
# invocations between read probes: issue 18's 1.2x and batch-1 bandwidth), then W64 beside vLLM 0.32
# (two invocations, with one activation level as a third arm).
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen3_round8/final_latency
latency_beside_llamacpp
begin_round /work/main/benchmarks/zen3_round8/final_w64
w64_beside_vllm 'pagedllm,vllm,pagedllm[--quant-activations int8]'
