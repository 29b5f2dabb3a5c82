#!/bin/bash
# Batch-1 decode attention in C (float32, head layout, the default model's heads, one sequence,
# split_heads as the engine sets it), streamed from memory: the kernel before the key segments
# (commit a3ac051) and the shipped one, alternating, three rounds per context length. Log:
# attention_segments.log.
set -u
cd /work/main
git show a3ac051:pagedllm/native/cpu_ops.c > /tmp/cpu_ops_before_segments.c
for arm in before after; do
  src=$([ $arm = before ] && echo /tmp/cpu_ops_before_segments.c || echo /work/main/pagedllm/native/cpu_ops.c)
  gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11 -DKERNEL_SOURCE="\"$src\"" \
    benchmarks/attention_decode_bench.c -o /tmp/attn_$arm -lm
done
for ctx in 1024 2200 4096; do
  for i in 1 2 3; do
    for arm in before after; do
      echo -n "$arm "
      LAYOUT=head SPLIT=1 OMP_NUM_THREADS=2 /tmp/attn_$arm $((60 * 1024 / ctx)) 1 $ctx 20
    done
  done
done
