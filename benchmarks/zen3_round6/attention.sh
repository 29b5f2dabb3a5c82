#!/bin/bash
# Decode attention in C (float32, head layout, the default model's heads: 64 sequences x 340 tokens
# x 30 layers, streamed) against the 1 GiB read probe, ROUNDS rounds each between two probes; the
# log at attention_rounds.log (issue 16's 70% of the read bandwidth).
set -u
P=/work/main/.venv/bin
. /work/main/benchmarks/round_lib.sh  # read_gbs
cd /work/main
gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11 -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' \
  benchmarks/attention_decode_bench.c -o /tmp/attn_f32 -lm
for i in $(seq ${ROUNDS:-6}); do
  echo "probe $(read_gbs) GB/s"
  LAYOUT=head OMP_NUM_THREADS=2 /tmp/attn_f32 30 64 340 4
  echo "probe $(read_gbs) GB/s"
done
