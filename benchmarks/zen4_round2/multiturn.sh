#!/bin/bash
# The tiered prefix cache commands of docs/benchmarks.md ("The tiered prefix cache on AMD Zen 4",
# and on Sapphire Rapids through benchmarks/spr_round7/multiturn.sh), 4 and 8 turns (TURNS="8" runs
# one count); run from anywhere, writes the JSON into OUT (default: beside this script).
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
P=$PWD/.venv/bin
for T in ${TURNS:-4 8}; do
$P/pagedllm bench serve --multi-turn --turns $T --user-words 48 --output-len 32 --max-concurrency 8 \
    --conversations auto --pool-multiple 4 --dtype float32 \
    --arm 'off=--kv-cache-memory 256MiB' \
    --arm 'on=--kv-cache-memory 256MiB --kv-cache-dir {kv_dir}' \
    --arm 'unlimited=--kv-cache-memory 4GiB' --restart-arm on --kv-dir-root /var/tmp \
    --json "$OUT/multiturn_tiers_${T}turns.json"
done
