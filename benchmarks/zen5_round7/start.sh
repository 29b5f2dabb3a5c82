#!/bin/bash
# A new session's first look on the AMD Zen 5 class (the code at w64_start/commit.txt): W64 bfloat16
# beside vLLM 0.32 in bfloat16, three invocations, a read probe before each.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round7/w64_start
lscpu > $O/lscpu.txt
w64_bf16_beside_vllm 3
echo done > $O/done
