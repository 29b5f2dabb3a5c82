#!/bin/bash
# A round on the AMD Zen 5 class with bfloat16 attention on vdpbf16ps (code at */commit.txt): W64
# bfloat16 beside vLLM 0.32 in bfloat16 (two invocations), W64 float32 beside vLLM (two, one
# activation level as a third arm), one request 128 -> 128 beside llama.cpp (three invocations).
set -u
. /work/main/benchmarks/round_lib.sh
round_beside_peers /work/main/benchmarks/zen5_round4 'pagedllm,vllm,pagedllm[--quant-activations int8]'
