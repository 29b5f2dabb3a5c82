"""bfloat16 activations times packed weights: the AMX-BF16 kernels against oneDNN's dense bfloat16
matmul and the integer (int16-activation) kernel, at the default model's shapes.

    python benchmarks/quant_bf16_amx.py [ROWS ...]      (default rows: 16 32 64 256)

Best-of-N wall milliseconds on all torch threads, every figure of a line from the same process:
oneDNN on the dense bfloat16 weights (``dequantize().bfloat16()``, packed into its blocked layout),
the dense AMX-BF16 kernel on the same weights (what the layers run on such a CPU), the AMX-BF16
kernel on Q4 and Q8 (g32) codes, and the Q4 integer kernel on the
activations cast to float32 (what a bfloat16 packed matmul ran before; the cast is outside the timing). Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch

from pagedllm.layers.linear import AmxBf16Matmul, _PackedMatmul
from pagedllm.native import host_memory, quant_ops
from pagedllm.quant import quantize_rtn

SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))  # (out, in)


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    assert quant_ops.available() and quant_ops.amx_bf16_available(), "needs the kernels and AMX-BF16"
    host_memory.tune_malloc()  # as a CPU worker runs
    rows_list = [int(a) for a in sys.argv[1:]] or [16, 32, 64, 256]
    torch.manual_seed(0)
    print("| rows | matrix | oneDNN dense bf16 | dense AMX-BF16 | Q4 AMX-BF16 | Q8 AMX-BF16 | Q4 int16 (float32 activations) |")
    print("|---|---|---|---|---|---|---|")
    for rows in rows_list:
        for n, k in SHAPES:
            w = torch.randn(n, k)
            q4, q8 = quantize_rtn(w, 4, 32), quantize_rtn(w, 8, 32)
            x = torch.randn(rows, k).bfloat16()
            dense_w = q4.dequantize().bfloat16()
            onednn, amx = _PackedMatmul(dense_w), AmxBf16Matmul(dense_w)
            repeats = 5 if n > 10000 else 30
            xf = x.float()
            times = [best_ms(partial(onednn, x, dense_w, None), repeats),
                     best_ms(partial(amx, x, dense_w, None), repeats),
                     best_ms(partial(quant_ops.gemm_bf16, x, *q4._kernel_args()), repeats),
                     best_ms(partial(quant_ops.gemm_bf16, x, *q8._kernel_args()), repeats),
                     best_ms(partial(quant_ops.gemm, xf, *q4._kernel_args()), repeats)]
            print(f"| {rows} | {n}x{k} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
