#!/bin/bash
# The session's round after the work sharing (the code at w64_final/commit.txt): W64 bfloat16 beside
# vLLM 0.32 in bfloat16, three invocations, a read probe before each (OUT=folder: another round).
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round7/${OUT:-w64_final}
lscpu > $O/lscpu.txt
w64_bf16_beside_vllm 3
echo done > $O/done
