#!/bin/bash
# One request 128 -> 128 beside llama.cpp (same GGUF, same threads), invocations alternating the
# AVX2 per-row kernel's scale source: row-scale tables (PAGEDLLM_QUANT_ROW_TABLES unset, the default)
# and the per-call transpose (=0), at the commit in latency/commit.txt.
set -u
O=/work/main/benchmarks/zen3_round4/latency
P=/work/main/.venv/bin
mkdir -p $O
cd /tmp
git -C /work/main rev-parse --short HEAD > $O/commit.txt
for i in 1 2 3; do
  for arm in tables transpose; do
    env $([ $arm = transpose ] && echo PAGEDLLM_QUANT_ROW_TABLES=0) $P/python -m pagedllm.cli bench latency --runs 3 \
      --input-len 128 --output-len 128 --dtype float32 --compare pagedllm,llamacpp \
      --llamacpp-python /work/llamacpp-venv/bin/python --json $O/${arm}_$i.json > $O/${arm}_$i.log 2>&1
  done
done
echo done > $O/done
