#!/bin/bash
# One request 128 -> 128 beside llama.cpp (same GGUF, same threads), three invocations, each between
# two read probes (1 GiB float32, both threads); the code at latency/commit.txt.
set -u
. /work/main/benchmarks/round_lib.sh  # begin_round, latency_beside_llamacpp
begin_round /work/main/benchmarks/zen3_round7/latency
latency_beside_llamacpp
