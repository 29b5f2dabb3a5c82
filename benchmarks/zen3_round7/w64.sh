#!/bin/bash
# W64 (float32, 2 GiB of KV) beside vLLM 0.32's CPU build: the packed default (two int8 activation
# levels) and one activation level (--quant-activations int8), two invocations; the code at
# w64/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, w64_beside_vllm
begin_round /work/main/benchmarks/zen3_round7/w64
w64_beside_vllm 'pagedllm,vllm,pagedllm[--quant-activations int8]'
