#!/bin/bash
# docs/benchmarks.md, "Disk-tier loads without polling, batched, and copied natively": the `on`
# arm of benchmarks/zen4_round2/multiturn.sh (4 turns, 61 conversations) and its restart, alone;
# the JSON goes to OUT (default: beside this script) as restart_only_<LABEL>.json.
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
.venv/bin/pagedllm bench serve --multi-turn --turns 4 --user-words 48 --output-len 32 --max-concurrency 8 \
    --conversations 61 --dtype float32 \
    --arm 'on=--kv-cache-memory 256MiB --kv-cache-dir {kv_dir}' \
    --restart-arm on --target-arms on,on,on --kv-dir-root /var/tmp \
    --json "$OUT/restart_only_${LABEL:-run}.json"
