#!/bin/bash
# The commands behind docs/benchmarks.md, "Machine class: AMD Zen 4 (2026-12-03 round)".
# Outputs in /tmp/z4b. Run from a checkout at /work/main with vLLM's CPU build in /work/peer-vllm.
set -u
O=/tmp/z4b
mkdir -p $O
cd /tmp   # not the checkout: python -m would put its directory ahead of PYTHONPATH
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
V=/work/peer-vllm/bin/python
. /work/main/benchmarks/round_lib.sh  # probe
lscpu > $O/lscpu.txt
git -C /work/main rev-parse --short HEAD > $O/commit.txt
probe start
$P/python /work/main/benchmarks/attention_kernel.py --paths avx512_bf16,avx512,avx2 --json $O/attention.json \
  > $O/attention.log 2>&1
probe attention
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V \
  --compare 'pagedllm,pagedllm[--quant-activations int8],pagedllm[--quantization none],pagedllm@avx2[--quantization none],vllm' \
  --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe w64_fp32
$P/pagedllm bench throughput --workload $W --dtype bfloat16 --peer-python $V \
  --compare 'pagedllm,pagedllm@avx2,vllm' --json $O/w64_bf16.json > $O/w64_bf16.log 2>&1
probe w64_bf16
$P/pagedllm bench latency --dtype float32 --quantization none --peer-python $V --runs 5 --input-len 128 \
  --output-len 128 --compare pagedllm,vllm --json $O/lat_fp32_dense.json > $O/lat_fp32_dense.log 2>&1
probe lat_dense
$P/pagedllm bench latency --dtype float32 --peer-python $V --runs 5 --input-len 128 \
  --output-len 128 --compare pagedllm,vllm --json $O/lat_fp32_default.json > $O/lat_fp32_default.log 2>&1
probe lat_default
echo done > $O/done
