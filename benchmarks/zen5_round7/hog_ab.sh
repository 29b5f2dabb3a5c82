#!/bin/bash
# W64 bfloat16 with another process spinning on one of the two cores (a busy neighbour), the commit
# before the work sharing ($BEFORE, a worktree) against it (/work/main), alternating, twice each.
set -u
. /work/main/benchmarks/round_lib.sh
begin_round /work/main/benchmarks/zen5_round7/hog_ab
BEFORE=${BEFORE:-/tmp/base}
for i in 1 2; do
  for arm in before after; do
    if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
    taskset -c 1 python3 -c "import time; t = time.time()
while time.time() - t < 600: pass" &
    hog=$!
    $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype bfloat16 \
      --kv-cache-memory 2GiB --compare pagedllm --json $O/${arm}_$i.json > $O/${arm}_$i.log 2>&1
    kill $hog
  done
done
echo done > $O/done
