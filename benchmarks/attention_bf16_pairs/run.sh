#!/bin/bash
cd /tmp
P=/work/main/.venv/bin
for i in 1 2 3; do
  for tree in /work/wt/attA /work/main; do
    PYTHONPATH=$tree $P/python $tree/benchmarks/attention_kernel.py --paths avx512_bf16 --dtypes bfloat16 --repeats 5 \
      --json /tmp/abf/attn_$(basename $tree)_$i.json > /tmp/abf/attn_$(basename $tree)_$i.log 2>&1
  done
done
for i in 1 2; do
  for tree in /work/wt/attA /work/main; do
    PYTHONPATH=$tree $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype bfloat16 \
      --json /tmp/abf/w64_$(basename $tree)_$i.json > /tmp/abf/w64_$(basename $tree)_$i.log 2>&1
  done
done
cat /proc/loadavg > /tmp/abf/load.txt
echo done > /tmp/abf/done
