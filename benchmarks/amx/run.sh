#!/bin/bash
# The commands behind docs/benchmarks.md, "AMX tiles for many rows" (outputs in /tmp/amxrun).
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
V=/work/vllm-venv/bin/python
lscpu | grep "Model name" > /tmp/amxrun/cpu.txt
cat /proc/loadavg > /tmp/amxrun/load0.txt
$P/python -m pagedllm.quant.kernel_bench --threads 1 --rows 1,4,16,64,256 --paths avx512-vnni,avx512-amx > /tmp/amxrun/kernel.md 2>&1
cat /proc/loadavg > /tmp/amxrun/load1.txt
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V \
  --compare 'pagedllm[--quantization gguf],pagedllm[--quantization gguf --kv-cache-dtype int8],vllm' \
  --json /tmp/amxrun/w64_fp32.json > /tmp/amxrun/w64_fp32.log 2>&1
cat /proc/loadavg > /tmp/amxrun/load2.txt
$P/pagedllm bench throughput --workload $W --dtype bfloat16 --peer-python $V \
  --compare 'pagedllm[--quantization gguf --dtype float32],pagedllm[--quantization gguf --dtype float32 --kv-cache-dtype int8],pagedllm,vllm' \
  --json /tmp/amxrun/w64_bf16.json > /tmp/amxrun/w64_bf16.log 2>&1
cat /proc/loadavg > /tmp/amxrun/load3.txt
PAGEDLLM_QUANT_ISA=avx512-vnni $P/pagedllm bench throughput --workload $W --dtype float32 \
  --compare 'pagedllm[--quantization gguf],pagedllm[--quantization gguf --kv-cache-dtype int8]' \
  --json /tmp/amxrun/w64_vnni.json > /tmp/amxrun/w64_vnni.log 2>&1
cat /proc/loadavg > /tmp/amxrun/load4.txt
echo done > /tmp/amxrun/done
