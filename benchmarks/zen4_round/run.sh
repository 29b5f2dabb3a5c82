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
O=/tmp/z4
. /work/main/benchmarks/round_lib.sh  # probe
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
