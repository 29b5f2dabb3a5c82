#!/bin/bash
# A round on the AMD Zen 5 class with bfloat16 attention on vdpbf16ps (code at */commit.txt): W64
# bfloat16 beside vLLM 0.32 in bfloat16 (two invocations), W64 float32 beside vLLM (two, one
# activation level as a third arm), one request 128 -> 128 beside llama.cpp (three invocations).
set -u
. /work/main/benchmarks/round_lib.sh
R=/work/main/benchmarks/zen5_round4
begin_round $R/w64
lscpu > $O/lscpu.txt
w64_bf16_beside_vllm
w64_beside_vllm 'pagedllm,vllm,pagedllm[--quant-activations int8]'
begin_round $R/latency_llamacpp
latency_beside_llamacpp
echo done > $R/done
