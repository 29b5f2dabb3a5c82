"""A SwiGLU's packed gate | up product on the tiled kernels, then silu_mul, against the two in one
pass (quant_ops.gemm_glu), on the default model's shape (576 -> 2 x 1536, Q4_1 codes in the CPU's
layout), both threads; medians of alternating calls.

    python benchmarks/glu_fusion_bench.py [ROWS ...]     # default: 64 1024 2048
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from pagedllm.native import cpu_ops, quant_ops
from pagedllm.quant import quantize_rtn


def main() -> None:
    assert quant_ops.available() and cpu_ops.available()
    gen = torch.Generator().manual_seed(0)
    weight = quantize_rtn(torch.randn(2 * 1536, 576, generator=gen), 4, 32)
    weight.native_codes()
    args = weight._kernel_args()
    glu = ctypes.cast(cpu_ops._library.silu_mul_f32_serial, ctypes.c_void_p).value
    print(f"path {quant_ops.ISA_NAMES[quant_ops.isa()]}, {torch.get_num_threads()} threads")
    for rows in [int(a) for a in sys.argv[1:]] or [64, 1024, 2048]:
        x = torch.randn(rows, 576, generator=gen)
        times: dict[str, list[float]] = {"product then silu_mul": [], "one pass": []}
        for _ in range(25):
            start = time.perf_counter()
            want = cpu_ops.silu_mul(quant_ops.gemm(x, *args, tiled=True))
            times["product then silu_mul"].append(time.perf_counter() - start)
            start = time.perf_counter()
            got = quant_ops.gemm_glu(x, *args, glu, tiled=True)
            times["one pass"].append(time.perf_counter() - start)
            assert torch.equal(got, want)
        print(f"rows {rows}: " + ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
