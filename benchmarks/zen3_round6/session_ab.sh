#!/bin/bash
# This session's kernels against the session's starting point (BEFORE, a checkout of c75025f),
# alternating: W64 float32 twice per arm, then one request 128 -> 128 twice per arm; the code at
# session_ab/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, probe, alternate_w64
BEFORE=${BEFORE:-/tmp/base}
begin_round /work/main/benchmarks/zen3_round6/session_ab
git -C $BEFORE rev-parse --short HEAD > $O/before_commit.txt
probe start
alternate_w64 w64
for i in 1 2; do
  for arm in before after; do
    if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
    $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
      --json $O/lat_${arm}_$i.json > $O/lat_${arm}_$i.log 2>&1
  done
done
probe end
echo done > $O/done
