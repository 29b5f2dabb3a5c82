#!/bin/bash
# W64 (packed GGUF, float32), TP=1 and TP=2 in one invocation, with the shared-memory collectives
# (PAGEDLLM_TP_ALL_REDUCE=shm): the straddling KV head's rows split between the ranks (the
# default) and whole KV heads per rank (PAGEDLLM_TP_SHARED_HEADS=0), alternating, twice each;
# the code at tp2/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, probe
begin_round /work/main/benchmarks/zen3_round5/tp2
for i in ${ROUNDS:-1 2}; do
  for arm in shared whole; do
    probe ${arm}_$i
    if [ $arm = shared ]; then heads=1; else heads=0; fi
    PAGEDLLM_TP_SHARED_HEADS=$heads PAGEDLLM_TP_ALL_REDUCE=shm $P/python -m pagedllm.cli bench throughput \
      --workload /work/shared/workloads/w64.json --dtype float32 \
      --compare "pagedllm,pagedllm[--tensor-parallel-size 2]" --json $O/${arm}_$i.json > $O/${arm}_$i.log 2>&1
  done
done
probe end
echo done > $O/done
