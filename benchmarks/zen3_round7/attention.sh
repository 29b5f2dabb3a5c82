#!/bin/bash
# Decode attention in C (float32, head layout, the default model's heads: 64 sequences x 340 tokens
# x 30 layers, streamed) against the 1 GiB read probe, ROUNDS rounds each between two probes; the
# log at attention_rounds.log (issue 16's 70% of the read bandwidth).
set -u
P=/work/main/.venv/bin
. /work/main/benchmarks/round_lib.sh  # read_gbs, attention_against_probe
cd /work/main/benchmarks
attention_against_probe
