#!/bin/bash
# The session's code (*/commit.txt) beside the peers: W64 bfloat16 beside vLLM 0.32 in bfloat16 (two
# invocations), W64 float32 beside vLLM (two), one request 128 -> 128 beside llama.cpp on the same
# Q4_1 file (three), a read probe around each. The round of 2026-12-08 ran the same steps from a
# copy of zen5_round8/final.sh (its marker file was final_done, now done).
set -u
. /work/main/benchmarks/round_lib.sh
round_beside_peers /work/main/benchmarks/zen5_round9 'pagedllm,vllm'
