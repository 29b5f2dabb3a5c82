#!/bin/bash
# W64 (float32, 2 GiB of KV) over the two CPU KV layouts and beside vLLM 0.32's CPU build:
# invocations alternate PAGEDLLM_KV_LAYOUT (unset: the avx2 path's default, head; token: the
# layout before), the code at the commit in w64/commit.txt.
set -u
O=/work/main/benchmarks/zen3_round3/w64
P=/work/main/.venv/bin
mkdir -p $O
cd /tmp
. /work/main/benchmarks/round_lib.sh  # probe
git -C /work/main rev-parse --short HEAD > $O/commit.txt
run() {  # run NAME LAYOUT COMPARE
  probe $1
  env ${2:+PAGEDLLM_KV_LAYOUT=$2} $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
    --dtype float32 --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB --compare "$3" \
    --json $O/$1.json > $O/$1.log 2>&1
}
run head_1 "" 'pagedllm,vllm,pagedllm,pagedllm[--kv-cache-dtype int8]'
run token_1 token 'pagedllm,pagedllm,pagedllm[--kv-cache-dtype int8]'
run head_2 "" 'pagedllm,vllm,pagedllm'
probe end
echo done > $O/done
