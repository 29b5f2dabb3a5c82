#!/bin/bash
# W64, TP=1 and TP=2 (packed GGUF, float32) in one invocation, twice, with the shared-memory
# collectives (PAGEDLLM_TP_ALL_REDUCE=shm) and once with gloo (the default); at tp2/commit.txt.
O=/work/main/benchmarks/zen3_round4/tp2
cd /tmp
git -C /work/main rev-parse --short HEAD > $O/commit.txt
for i in 1 2; do
  PAGEDLLM_TP_ALL_REDUCE=shm /work/main/.venv/bin/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
    --dtype float32 --compare "pagedllm,pagedllm[--tensor-parallel-size 2]" --json $O/final_shm_$i.json > $O/final_shm_$i.log 2>&1
done
/work/main/.venv/bin/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
  --dtype float32 --compare "pagedllm,pagedllm[--tensor-parallel-size 2]" --json $O/final_gloo.json > $O/final_gloo.log 2>&1
echo done > $O/final_done
