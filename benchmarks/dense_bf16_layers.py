"""Dense bfloat16 matmuls as a model meets them: oneDNN against the AMX-BF16 kernel over 30 layers.

    python benchmarks/dense_bf16_layers.py [ROWS ...]      (default rows: 1 64 2048)

Thirty layers of the default model's four matrix shapes (random bfloat16 weights), each called
in layer order, so every weight comes from memory or L3 rather than from the cache a repeated
single matmul leaves it in. Per shape: milliseconds summed over the 30 layers, mean of 3 passes;
oneDNN (``_PackedMatmul``, the weight in its blocked layout) and ``AmxBf16Matmul`` alternate
twice in one process. Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import sys
import time

import torch

from pagedllm.layers.linear import AmxBf16Matmul, _PackedMatmul
from pagedllm.native import quant_ops

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    assert quant_ops.dense_bf16_available(), "needs the kernels and AMX-BF16"
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) * 0.05).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    print("| rows | kernel | " + " | ".join(f"{n}x{k}" for n, k in SHAPES) + " | all (ms per 30 layers) |")
    print("|---|---|" + "---|" * (len(SHAPES) + 1))
    for rows in [int(a) for a in sys.argv[1:]] or [1, 64, 2048]:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
        for name, kind in (("oneDNN", _PackedMatmul), ("AMX-BF16", AmxBf16Matmul)) * 2:
            matmuls = [[kind(w) for w in layer] for layer in weights]
            spent = [0.0] * len(SHAPES)
            for _ in range(3):
                for layer, mms in zip(weights, matmuls):
                    for i, ((_, k), w, mm) in enumerate(zip(SHAPES, layer, mms)):
                        start = time.perf_counter()
                        mm(xs[k], w, None)
                        spent[i] += time.perf_counter() - start
            ms = [s / 3 * 1e3 for s in spent]
            print(f"| {rows} | {name} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {sum(ms):.1f} |")


if __name__ == "__main__":
    main()
