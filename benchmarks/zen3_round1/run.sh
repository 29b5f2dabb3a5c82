#!/bin/bash
# AMD EPYC Zen 3 (AVX2 + FMA, no AVX-512, no native bf16), 2 cores: issue 16's and 18's
# AVX2-class targets in one round, each engine beside its peer in the same invocation.
set -u
O=${O:-/work/main/benchmarks/zen3_round1}
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
export PAGEDLLM_LLAMACPP_PYTHON=/work/llamacpp-venv/bin/python
. /work/main/benchmarks/round_lib.sh  # probe
git -C /work/main rev-parse --short HEAD > $O/commit.txt
lscpu | grep -E 'Model name|CPU family|^Model:|Flags' > $O/lscpu.txt
probe start
$P/python /work/main/benchmarks/attention_kernel.py --paths avx2,torch --repeats 3 \
  --json $O/attention_kernel.json > $O/attention_kernel.log 2>&1
probe attention
$P/pagedllm bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
  --peer-python /work/peer-vllm/bin/python \
  --compare pagedllm,llamacpp,vllm --json $O/latency_fp32.json > $O/latency_fp32.log 2>&1
$P/pagedllm bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 --quantization none \
  --json $O/latency_fp32_dense.json > $O/latency_fp32_dense.log 2>&1
probe latency
$P/pagedllm bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
  --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--kv-cache-dtype int8],vllm,pagedllm[--dtype bfloat16],pagedllm,pagedllm[--kv-cache-dtype int8]' \
  --json $O/w64.json > $O/w64.log 2>&1
probe w64
echo done > $O/done
