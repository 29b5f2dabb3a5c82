#!/bin/bash
# W64 on the forced AVX2 class (PAGEDLLM_CPU_ISA=avx2, PAGEDLLM_QUANT_ISA=avx2), the default
# packed path, before (a checkout of 0178cb1 at $BEFORE) and after 84b5961, alternating.
set -u
O=${O:-/tmp/z4f}
BEFORE=${BEFORE:-/tmp/exp/before2}
P=/work/main/.venv/bin
mkdir -p $O
cd /tmp
. /work/main/benchmarks/round_lib.sh  # alternate_w64
export PAGEDLLM_CPU_ISA=avx2 PAGEDLLM_QUANT_ISA=avx2
alternate_w64 avx2
echo done > $O/done
