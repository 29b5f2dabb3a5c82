#!/bin/bash
# Sapphire Rapids (AMX) round, docs/benchmarks.md "AMX for two activation levels": W64 with the
# packed default on the VNNI path forced (what two-level activations ran before the AMX kernel
# took them) and on the default path, alternating; then one invocation against vLLM's CPU build
# in float32 and in bfloat16, and one request 128 -> 128. Outputs in $O (default /tmp/spr).
set -u
O=${O:-/tmp/spr}
mkdir -p $O
cd /tmp
export PYTHONPATH=/work/main
P=/work/main/.venv/bin
V=/work/peer-vllm/bin/python
W=/work/shared/workloads/w64.json
. /work/main/benchmarks/round_lib.sh  # probe
git -C /work/main rev-parse --short HEAD > $O/commit.txt
lscpu > $O/lscpu.txt
probe start
for i in 1 2; do
  PAGEDLLM_QUANT_ISA=avx512-vnni $P/pagedllm bench throughput --workload $W --dtype float32 --compare pagedllm \
    --json $O/w64_vnni_$i.json > $O/w64_vnni_$i.log 2>&1
  $P/pagedllm bench throughput --workload $W --dtype float32 --compare pagedllm \
    --json $O/w64_amx_$i.json > $O/w64_amx_$i.log 2>&1
done
probe ab
$P/pagedllm bench throughput --workload $W --dtype float32 --peer-python $V --kv-cache-memory 2GiB \
  --compare 'pagedllm,pagedllm[--kv-cache-dtype int8],vllm,pagedllm,pagedllm[--kv-cache-dtype int8]' \
  --json $O/w64_fp32.json > $O/w64_fp32.log 2>&1
probe fp32
$P/pagedllm bench throughput --workload $W --dtype bfloat16 --peer-python $V --kv-cache-memory 2GiB \
  --compare 'pagedllm,vllm,pagedllm' --json $O/w64_bf16.json > $O/w64_bf16.log 2>&1
probe bf16
$P/pagedllm bench latency --compare pagedllm,vllm --peer-python $V --input-len 128 --output-len 128 --runs 3 \
  --dtype float32 --json $O/latency_fp32.json > $O/latency_fp32.log 2>&1
probe end
echo done > $O/done
