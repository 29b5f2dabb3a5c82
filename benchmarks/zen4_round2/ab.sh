#!/bin/bash
# Before (the parent of the decode-attention change, 25ec7fd^) and after, alternating, two rounds:
# the attention kernel microbenchmark, then W64 dense float32 and bfloat16. Outputs in /tmp/z4ab.
# Needs a checkout of the "before" commit at /tmp/base (git worktree add /tmp/base 25ec7fd^).
set -u
O=/tmp/z4ab
mkdir -p $O
cd /tmp   # not a checkout: python -m would put its directory ahead of PYTHONPATH
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then T=/tmp/base; else T=/work/main; fi
    PYTHONPATH=$T $P/python -c "import pagedllm; print('$tree imports', pagedllm.__file__)" >> $O/imports.txt
    PYTHONPATH=$T $P/python $T/benchmarks/attention_kernel.py --paths avx512_bf16,avx2 --repeats 5 \
      --json $O/attention_${tree}_$round.json > $O/attention_${tree}_$round.log 2>&1
  done
done
for round in 1 2; do
  for dtype in float32 bfloat16; do
    for tree in before after; do
      if [ $tree = before ]; then T=/tmp/base; else T=/work/main; fi
      PYTHONPATH=$T $P/python -m pagedllm.cli bench throughput --workload $W --dtype $dtype --quantization none \
        --json $O/w64_${dtype}_${tree}_$round.json > $O/w64_${dtype}_${tree}_$round.log 2>&1
      echo "$dtype $tree $round $(grep '^pagedllm ' $O/w64_${dtype}_${tree}_$round.log | awk '{print $7}') load $(cut -d' ' -f1 /proc/loadavg)" >> $O/w64.txt
    done
  done
done
echo done > $O/done
