#!/bin/bash
# docs/benchmarks.md, "The tiered prefix cache on Sapphire Rapids with today's code": the commands
# of benchmarks/zen4_round2/multiturn.sh with the JSON written beside this script (TURNS="8": one count).
OUT="$(dirname "$0")" exec "$(dirname "$0")/../zen4_round2/multiturn.sh"
