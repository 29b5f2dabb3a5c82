#!/bin/bash
# The commands behind docs/benchmarks.md, "Machine class: AMD Zen 4 (2026-12-02 round)".
# Outputs in /tmp/z4. Run from a checkout at /work/main with vLLM's CPU build in /work/peer-vllm.
set -u
mkdir -p /tmp/z4
cd /tmp   # not the checkout: python -m would put its directory ahead of PYTHONPATH
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
V=/work/peer-vllm/bin/python
probe() {  # a 1 GiB float32 read on every thread, best of 5, and the load
  $P/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('$1 read_gbs %.2f' % (x.numel() * 4 / best / 1e9))" >> /tmp/z4/probe.txt
  echo "$1 loadavg $(cat /proc/loadavg)" >> /tmp/z4/probe.txt
}
lscpu > /tmp/z4/lscpu.txt
probe start
$P/python -m pagedllm.quant.kernel_bench --threads 1 --rows 1,4,16,64 --activations int16,int8 --clock cpu \
  > /tmp/z4/kernel.md 2>&1
probe kernel
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V \
  --compare 'pagedllm,pagedllm[--quant-activations int8],pagedllm[--quantization none],vllm' \
  --json /tmp/z4/w64_fp32.json > /tmp/z4/w64_fp32.log 2>&1
probe w64_fp32
$P/pagedllm bench throughput --workload $W --dtype bfloat16 --peer-python $V \
  --compare 'pagedllm,vllm' --json /tmp/z4/w64_bf16.json > /tmp/z4/w64_bf16.log 2>&1
probe w64_bf16
$P/python /work/main/benchmarks/attention_kernel.py --json /tmp/z4/attention.json > /tmp/z4/attention.log 2>&1
probe attention
echo done > /tmp/z4/done
bash /work/main/benchmarks/zen4_round/latency.sh  # bench latency --compare takes no variants: two invocations
