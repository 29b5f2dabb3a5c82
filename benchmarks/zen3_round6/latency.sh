#!/bin/bash
# One request 128 -> 128 beside llama.cpp (same GGUF, same threads), three invocations, each between
# two read probes (1 GiB float32, both threads); the code at latency/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, probe
begin_round /work/main/benchmarks/zen3_round6/latency
for i in 1 2 3; do
  probe before_$i
  $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
    --compare pagedllm,llamacpp --llamacpp-python /work/llamacpp-venv/bin/python \
    --json $O/run_$i.json > $O/run_$i.log 2>&1
  probe after_$i
done
echo done > $O/done
