#!/bin/bash
# One request 128 -> 128 beside llama.cpp (same GGUF, same threads), three invocations in a row,
# at the commit in latency/commit.txt (run from a worktree or the checkout).
set -u
O=/work/main/benchmarks/zen3_round2/latency
P=/work/main/.venv/bin
cd /tmp
git -C ${PYTHONPATH:-/work/main} rev-parse --short HEAD > $O/commit.txt
for i in 1 2 3; do
  $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
    --compare pagedllm,llamacpp --llamacpp-python /work/llamacpp-venv/bin/python \
    --json $O/latency_$i.json > $O/latency_$i.log 2>&1
done
echo done > $O/done
