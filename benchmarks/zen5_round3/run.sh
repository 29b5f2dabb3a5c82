#!/bin/bash
# Two more W64 float32 invocations beside vLLM 0.32 on the session's final code (*/commit.txt), for
# issue 18's 1.5x: the same command as zen5_round2's.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round3/w64
w64_beside_vllm 'pagedllm,vllm,pagedllm[--quant-activations int8]'
