#!/bin/bash
# Decode attention in C (float32, head layout, the default model's heads: 64 sequences x 340 tokens
# x 30 layers, streamed) against the 1 GiB read probe, ROUNDS rounds each between two probes; the
# log at attention_rounds.log (issue 16's 70% of the read bandwidth).
set -u
cd /work/main
gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11 -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' \
  benchmarks/attention_decode_bench.c -o /tmp/attn_f32 -lm
probe() {
  .venv/bin/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('probe %.1f GB/s' % (x.numel() * 4 / best / 1e9))"
}
for i in $(seq ${ROUNDS:-6}); do
  probe
  LAYOUT=head OMP_NUM_THREADS=2 /tmp/attn_f32 30 64 340 4
  probe
done
