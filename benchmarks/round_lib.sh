# Shared by the benchmark round scripts (source it after setting O, the output folder, and P,
# the virtualenv's bin folder, or call begin_round).

begin_round() {  # begin_round DIR: O=DIR (made), P the main virtualenv's bin, the commit in DIR/commit.txt, cd /tmp
  O=$1
  P=${P:-/work/main/.venv/bin}
  mkdir -p $O
  git -C /work/main rev-parse --short HEAD > $O/commit.txt
  cd /tmp
}

read_gbs() {  # read_gbs: a 1 GiB float32 read on every thread, best of 5, in GB/s
  $P/python -c "
import torch, time
x = torch.ones(256 * 1024 * 1024); x.sum()
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print('%.2f' % (x.numel() * 4 / best / 1e9))"
}

probe() {  # probe NAME: read_gbs and the load, into $O/probe.txt
  echo "$1 read_gbs $(read_gbs)" >> $O/probe.txt
  echo "$1 loadavg $(cat /proc/loadavg)" >> $O/probe.txt
}

alternate_w64() {  # alternate_w64 PREFIX: W64 float32 on $BEFORE's and /work/main's code, twice each, alternating
  local i arm
  for i in 1 2; do
    for arm in before after; do
      if [ $arm = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=/work/main; fi
      $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json --dtype float32 \
        --compare pagedllm --json $O/$1_${arm}_$i.json > $O/$1_${arm}_$i.log 2>&1
    done
  done
}

w64_runs() {  # w64_runs DTYPE PREFIX COMPARE [N]: W64 in DTYPE (2 GiB of KV) beside the peers in COMPARE (vLLM
  local i    # in DTYPE too), N times (default 2), into $O/PREFIX_i.json, a read probe before each and after all
  for i in $(seq ${4:-2}); do
    probe ${2}_$i
    $P/python -m pagedllm.cli bench throughput --workload /work/shared/workloads/w64.json \
      --dtype $1 --peer-python /work/peer-vllm/bin/python --kv-cache-memory 2GiB \
      --compare "$3" --json $O/${2}_$i.json > $O/${2}_$i.log 2>&1
  done
  probe ${2}_end
}

w64_beside_vllm() {  # w64_beside_vllm COMPARE: W64 float32 with vLLM's CPU build in --compare, twice, into $O/run_*
  w64_runs float32 run "$1"
  echo done > $O/done
}

w64_bf16_beside_vllm() {  # w64_bf16_beside_vllm [N]: W64 bfloat16 beside vLLM in bfloat16, N times (2), into $O/bf16_*
  w64_runs bfloat16 bf16 pagedllm,vllm ${1:-2}
}

round_beside_peers() {  # round_beside_peers DIR COMPARE: W64 bfloat16 beside vLLM in bfloat16, W64 float32 beside
  begin_round $1/w64    # the peers of COMPARE (w64_beside_vllm), one request beside llama.cpp, into DIR/w64 and
  lscpu > $O/lscpu.txt  # DIR/latency_llamacpp (each with its commit.txt)
  w64_bf16_beside_vllm
  w64_beside_vllm "$2"
  begin_round $1/latency_llamacpp
  latency_beside_llamacpp
  echo done > $1/done
}

latency_beside_llamacpp() {  # one request 128 -> 128 beside llama.cpp, three invocations between read probes, into $O
  local i
  for i in 1 2 3; do
    probe before_$i
    $P/python -m pagedllm.cli bench latency --runs 3 --input-len 128 --output-len 128 --dtype float32 \
      --compare pagedllm,llamacpp --llamacpp-python /work/llamacpp-venv/bin/python \
      --json $O/run_$i.json > $O/run_$i.log 2>&1
    probe after_$i
  done
  echo done > $O/done
}

attention_against_probe() {  # decode attention in C (attention_decode_bench.c, head layout, 64 x 340 x 30 layers),
  local i                    # ROUNDS rounds (default 6), each between two read probes, to stdout
  gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=gnu11 -DKERNEL_SOURCE='"../pagedllm/native/cpu_ops.c"' \
    /work/main/benchmarks/attention_decode_bench.c -o /tmp/attn_f32 -lm
  for i in $(seq ${ROUNDS:-6}); do
    echo "probe $(read_gbs) GB/s"
    LAYOUT=head OMP_NUM_THREADS=2 /tmp/attn_f32 30 64 340 4
    echo "probe $(read_gbs) GB/s"
  done
}
