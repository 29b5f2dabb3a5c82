#!/bin/bash
# W64 bfloat16 beside vLLM 0.32 in bfloat16 on the AMD Zen 5 class after dense bfloat16 weights
# moved to VDPBF16PS and the native layer stack (code at w64/commit.txt): three invocations.
set -u
. /work/main/benchmarks/round_lib.sh
R=/work/main/benchmarks/zen5_round5
begin_round $R/w64
lscpu > $O/lscpu.txt
w64_bf16_beside_vllm 3
echo done > $R/done
