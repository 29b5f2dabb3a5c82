#!/bin/bash
# Batch-1 decode, the round's start (fadee08) against the AVX2 per-row kernel changes (c67592a),
# alternating, llama.cpp in every invocation.
set -u
O=/work/main/benchmarks/zen3_round1/batch1b
P=/work/main/.venv/bin
cd /tmp
for i in 1 2; do
  for arm in before now; do
    PYTHONPATH=/tmp/$arm $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 \
      --dtype float32 --compare pagedllm,llamacpp --llamacpp-python /work/llamacpp-venv/bin/python \
      --json $O/${arm}_$i.json > $O/${arm}_$i.log 2>&1
  done
done
echo done > $O/done
