#!/usr/bin/env bash
# Decode attention timed in C over both KV layouts (cpu_ops.c KV_LAYOUT_TOKEN / KV_LAYOUT_HEAD),
# float32 and int8 caches, alternating, each round beside the 1 GiB read probe.
#   bash benchmarks/zen3_round3/attention.sh > benchmarks/zen3_round3/attention.log
set -euo pipefail
cd "$(dirname "$0")/.."
F="-O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11"
gcc $F -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' attention_decode_bench.c -o /tmp/attn_f32 -lm
gcc $F -DKV8=1 -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' attention_decode_bench.c -o /tmp/attn_i8 -lm
PY=../.venv/bin/python
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*\(avx[^ ]*\).*/&/' | cut -c1-200
echo "in L2, one thread:"
for L in token head; do
  LAYOUT=$L OMP_NUM_THREADS=1 /tmp/attn_f32 1 4 340 1500
  LAYOUT=$L OMP_NUM_THREADS=1 /tmp/attn_i8 1 4 340 1500
done
echo "streamed (30 layers x 64 sequences x 340 tokens), two threads:"
for round in 1 2 3 4 5 6; do
  $PY -c "import sys; sys.path.insert(0, '.'); from attention_kernel import read_bandwidth_gbs; print('probe %.1f GB/s' % read_bandwidth_gbs(5))"
  for L in token head; do
    LAYOUT=$L OMP_NUM_THREADS=2 /tmp/attn_f32 30 64 340 4
    LAYOUT=$L OMP_NUM_THREADS=2 /tmp/attn_i8 30 64 340 4
  done
done
