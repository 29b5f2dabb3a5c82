#!/bin/bash
# One request 128 -> 128 (float32, packed default), the code before the lane layout ($BEFORE, a
# worktree of the previous commit) against this tree, alternating, ROUNDS rounds; into lanes_ab/.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen3_round8/lanes_ab
BEFORE=${BEFORE:-/tmp/ab_before}
git -C $BEFORE rev-parse --short HEAD > $O/before_commit.txt
for i in $(seq ${ROUNDS:-2}); do
  for arm in before after; do
    if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
    probe ${arm}_$i
    $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
      --json $O/${arm}_$i.json > $O/${arm}_$i.log 2>&1
  done
done
probe end
echo done > $O/done
