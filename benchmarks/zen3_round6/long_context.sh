#!/bin/bash
# One request with a long prompt (2048 and 4096 tokens -> 128 new), float32 KV, before the key
# segments (BEFORE, a checkout of the commit before them) and with them (/work/main), alternating
# twice per length; the code at long_context/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, probe
BEFORE=${BEFORE:-/tmp/old}
begin_round /work/main/benchmarks/zen3_round6/long_context
git -C $BEFORE rev-parse --short HEAD > $O/before_commit.txt
for len in 2048 4096; do
  for i in 1 2; do
    for arm in before after; do
      if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
      probe ${arm}_${len}_$i
      $P/python -m pagedllm.cli bench latency --runs 3 --input-len $len --output-len 128 --dtype float32 \
        --max-model-len 8192 --json $O/${arm}_${len}_$i.json > $O/${arm}_${len}_$i.log 2>&1
    done
  done
done
echo done > $O/done
