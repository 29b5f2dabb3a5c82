#!/bin/bash
# One request 128 -> 128 beside llama.cpp (same GGUF, same threads), invocations alternating the
# CPU KV layout (PAGEDLLM_KV_LAYOUT unset: head, the avx2 default; token: the layout before),
# at the commit in latency/commit.txt.
set -u
O=/work/main/benchmarks/zen3_round3/latency
P=/work/main/.venv/bin
mkdir -p $O
cd /tmp
git -C /work/main rev-parse --short HEAD > $O/commit.txt
for i in 1 2; do
  for layout in head token; do
    env $([ $layout = token ] && echo PAGEDLLM_KV_LAYOUT=token) $P/python -m pagedllm.cli bench latency --runs 3 \
      --input-len 128 --output-len 128 --dtype float32 --compare pagedllm,llamacpp \
      --llamacpp-python /work/llamacpp-venv/bin/python --json $O/${layout}_$i.json > $O/${layout}_$i.log 2>&1
  done
done
echo done > $O/done
