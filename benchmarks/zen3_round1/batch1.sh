#!/bin/bash
# Batch-1 decode before / after the AVX2 scale transpose fix, alternating, with llama.cpp in the after runs.
set -u
O=/work/main/benchmarks/zen3_round1/batch1
P=/work/main/.venv/bin
cd /tmp
for i in 1 2; do
  PYTHONPATH=/tmp/before $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 \
    --dtype float32 --json $O/before_$i.json > $O/before_$i.log 2>&1
  PYTHONPATH=/tmp/after $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 \
    --dtype float32 --compare pagedllm,llamacpp --llamacpp-python /work/llamacpp-venv/bin/python \
    --json $O/after_$i.json > $O/after_$i.log 2>&1
done
echo done > $O/done
