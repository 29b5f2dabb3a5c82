#!/bin/bash
# One request 128 -> 128 against vLLM, twice: dense float32 (the issue-16 pairing), then the
# default (the GGUF served packed). Outputs in /tmp/z4. (bench latency --compare takes no variants.)
set -u
mkdir -p /tmp/z4
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
V=/work/peer-vllm/bin/python
$P/pagedllm bench latency --dtype float32 --quantization none --peer-python $V --runs 5 --input-len 128 \
  --output-len 128 --compare pagedllm,vllm --json /tmp/z4/lat_fp32_dense.json > /tmp/z4/lat_fp32_dense.log 2>&1
echo "lat_dense loadavg $(cat /proc/loadavg)" >> /tmp/z4/probe.txt
$P/pagedllm bench latency --dtype float32 --peer-python $V --runs 5 --input-len 128 \
  --output-len 128 --compare pagedllm,vllm --json /tmp/z4/lat_fp32_default.json > /tmp/z4/lat_fp32_default.log 2>&1
echo "lat_default loadavg $(cat /proc/loadavg)" >> /tmp/z4/probe.txt
echo done > /tmp/z4/lat_done
