#!/bin/bash
# The session's last round on the AMD Zen 5 class (code at */commit.txt: bfloat16 attention and
# dense bfloat16 weights on VDPBF16PS): W64 bfloat16 and float32 beside vLLM 0.32 (two invocations
# each), one request 128 -> 128 beside llama.cpp (three).
set -u
. /work/main/benchmarks/round_lib.sh
round_beside_peers /work/main/benchmarks/zen5_round6 'pagedllm,vllm'
