#!/bin/bash
# W64 on the forced AVX2 class (PAGEDLLM_CPU_ISA=avx2, PAGEDLLM_QUANT_ISA=avx2), the default
# packed path, before (a checkout of 0178cb1 at $BEFORE) and after 84b5961, alternating.
set -u
O=${O:-/tmp/z4f}
BEFORE=${BEFORE:-/tmp/exp/before2}
mkdir -p $O
cd /tmp
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
export PAGEDLLM_CPU_ISA=avx2 PAGEDLLM_QUANT_ISA=avx2
for i in 1 2; do
  for arm in before after; do
    if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
    $P/python -m pagedllm.cli bench throughput --workload $W --dtype float32 --compare pagedllm \
      --json $O/avx2_${arm}_$i.json > $O/avx2_${arm}_$i.log 2>&1
  done
done
echo done > $O/done
