"""The 8-bit KV accuracy tool's int8 rows with the Hadamard rotation switched off: the int8
cache as it was before it stored rotated vectors, for the before/after table in
docs/benchmarks.md ("int8 KV stored Hadamard-rotated").

    python benchmarks/kv_int8_rotation_off.py --dtype float32 --workload ../shared/workloads/w64.json

Greedy: 16 prompts x 64 tokens against KV in the model's dtype (no control row); text:
next-token logits over tests/data/english_text.txt. The rows with the rotation on come
from ``python -m pagedllm.kv.accuracy`` itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedllm.kv import accuracy, kv_format


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--text", type=Path, default=Path(__file__).parents[1] / "tests/data/english_text.txt")
    args = parser.parse_args()
    kv_format.stores_rotated = lambda *_: False  # every int8 vector stored as it is
    for result in accuracy.compare(None, 16, 64, ["int8"], 2**30, args.workload, args.dtype, control=False):
        print(accuracy.format_row(result))
    for row in accuracy.compare_text(None, args.text.read_text(), ["int8"], args.dtype):
        print(f"| int8, not rotated | {row.num_positions} | {row.max_abs_logit_error:.3f} | {row.top1_agreement:.2%} "
              f"| {row.mean_kl:.2e} | {row.perplexity_reference:.3f} -> {row.perplexity_quantized:.3f} |")


if __name__ == "__main__":
    main()
