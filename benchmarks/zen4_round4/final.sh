#!/bin/bash
# The last round of docs/benchmarks.md "Packed matmuls, many rows" (code at a876a8d or later):
# the default against int8 KV and vLLM 0.32's CPU build, one invocation, alternating.
set -u
O=${O:-/tmp/z4g}
mkdir -p $O
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
probe() {
  $P/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('$1 read_gbs %.2f' % (x.numel() * 4 / best / 1e9))" >> $O/probe.txt
  echo "$1 loadavg $(cat /proc/loadavg)" >> $O/probe.txt
}
git -C /work/main rev-parse --short HEAD > $O/commit.txt
probe start
$P/pagedllm bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--kv-cache-dtype int8],vllm,pagedllm,pagedllm[--kv-cache-dtype int8],pagedllm@avx2' \
  --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe end
echo done > $O/done
