#!/bin/bash
# batch-1 decode with gguf: read probe, then pagedllm vs llama.cpp on the same GGUF, three rounds
cd /tmp
export PYTHONPATH=/work/main PAGEDLLM_LLAMACPP_PYTHON=/work/llamacpp-venv/bin/python
P=/work/main/.venv/bin
for i in 1 2 3; do
  $P/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('read_gbs %.2f' % (x.numel() * 4 / best / 1e9))" > /tmp/b1/probe_$i.txt
  $P/python -m pagedllm.cli bench latency --quantization gguf --compare pagedllm,llamacpp --runs 3 \
     --input-len 128 --output-len 128 --json /tmp/b1/lat_$i.json > /tmp/b1/lat_$i.log 2>&1
  cat /proc/loadavg >> /tmp/b1/load.txt
done
echo done > /tmp/b1/done
