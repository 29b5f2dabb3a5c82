#!/bin/bash
cd /tmp
P=/work/main/.venv/bin
W=/work/shared/workloads/w64.json
for i in 1 2; do
  PYTHONPATH=/tmp/old3795 $P/python -c "import pagedllm,sys; print(pagedllm.__file__, file=sys.stderr)" 2>> /tmp/ab/which.txt
  PYTHONPATH=/tmp/old3795 $P/python -m pagedllm.cli bench throughput --workload $W --dtype float32 --json /tmp/ab/old_$i.json > /tmp/ab/old_$i.log 2>&1
  PYTHONPATH=/work/main $P/python -c "import pagedllm,sys; print(pagedllm.__file__, file=sys.stderr)" 2>> /tmp/ab/which.txt
  PYTHONPATH=/work/main $P/python -m pagedllm.cli bench throughput --workload $W --dtype float32 --quantization none --json /tmp/ab/new_$i.json > /tmp/ab/new_$i.log 2>&1
done
echo done > /tmp/ab/done
