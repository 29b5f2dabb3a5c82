#!/bin/bash
# The commands behind docs/benchmarks.md, "AMD Zen 4, packed matmuls' tile kernel (2026-12-03)".
# Outputs in /tmp/z4d. Run from a checkout at /work/main with vLLM's CPU build in /work/peer-vllm;
# BEFORE: a checkout of the commit before the change (git worktree add /tmp/exp/before b3e7e82).
set -u
O=${O:-/tmp/z4d}
BEFORE=${BEFORE:-/tmp/exp/before}
mkdir -p $O
cd /tmp   # not the checkout: python -m would put its directory ahead of PYTHONPATH
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
V=/work/peer-vllm/bin/python
probe() {  # a 1 GiB float32 read on every thread, best of 5, and the load
  $P/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('$1 read_gbs %.2f' % (x.numel() * 4 / best / 1e9))" >> $O/probe.txt
  echo "$1 loadavg $(cat /proc/loadavg)" >> $O/probe.txt
}
lscpu > $O/lscpu.txt
git -C /work/main rev-parse --short HEAD > $O/commit.txt
probe start
export PYTHONPATH=/work/main
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V \
  --compare 'pagedllm,pagedllm@avx2,vllm,pagedllm' --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe w64_fp32
for i in 1 2; do  # before / after, alternating, the default (packed) path
  for arm in before after; do
    if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
    $P/python -m pagedllm.cli bench throughput --workload $W --dtype float32 --compare pagedllm \
      --json $O/ab_${arm}_$i.json > $O/ab_${arm}_$i.log 2>&1
  done
done
probe ab
echo done > $O/done
