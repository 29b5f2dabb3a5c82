"""Quantized matmul kernels against dense float32 and torch's int4/int8 kernels.

``python -m pagedllm.quant.kernel_bench [--threads 1]`` prints one markdown row
per (rows, matrix) at the default model's shapes: best-of-20 milliseconds of
dense float32 (oneDNN, packed weight), the native Q4 and Q8 kernels (g32), and
``torch.ops.aten._weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` on
bfloat16 activations (random codes: only the time is compared).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.quant import quantize_rtn

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (out, in)


def best_ms(fn, repeats: int = 20) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def row(rows: int, out_features: int, in_features: int) -> str:
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    dense = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    q4, q8 = quantize_rtn(w, 4, 32), quantize_rtn(w, 8, 32)
    native4, native8 = best_ms(lambda: q4.apply(x)), best_ms(lambda: q8.apply(x))
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zero = torch.randn(in_features // 32, out_features, 2).bfloat16()
    xb = x.bfloat16()
    torch4 = best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, 32, scale_zero))
    int8 = torch.randint(-127, 127, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features).bfloat16()
    torch8 = best_ms(lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, scales))
    cells = " | ".join(f"{v:.3f}" for v in (dense, native4, native8, torch4, torch8))
    return f"| {rows} | {out_features}x{in_features} | {cells} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for rows in (1, 64):
        for out_features, in_features in SHAPES:
            print(row(rows, out_features, in_features), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
