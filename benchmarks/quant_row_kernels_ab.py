"""A/B in one process: one batch-1 decode step's quantized matmuls through two builds of quant_ops.c.

    python benchmarks/quant_row_kernels_ab.py ISA OLD.c NEW.c     (ISA: 2 = AVX-512 VNNI, 1 = AVX2)

30 layers x the default model's four matmul shapes, int4 with per-32 scales
and mins (as Q4_1), one activation row at two levels (the default int16
activations), the builds called through ctypes in alternating passes (40
each); prints the median, first quartile and best. Both builds need quant_linear's signature
with the row-scale table pointers (passed NULL here: the per-call transpose).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import torch

from pagedllm.quant import quantize_rtn

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ARGTYPES = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
            ctypes.c_int, ctypes.c_int32, ctypes.c_void_p]


def load(source: str, index: int):
    library = f"/tmp/quant_row_kernels_ab_{index}.so"
    subprocess.run(["gcc", "-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-o", library, source], check=True)
    kernel = ctypes.CDLL(library).quant_linear
    kernel.restype, kernel.argtypes = ctypes.c_int, ARGTYPES
    return kernel


def main() -> None:
    isa, sources = int(sys.argv[1]), sys.argv[2:4]
    kernels = [load(source, i) for i, source in enumerate(sources)]
    torch.manual_seed(0)
    weights = {shape: quantize_rtn(torch.randn(*shape), 4, 32) for shape in SHAPES}
    matrices = [(shape, weights[shape], weights[shape].qweight.clone(), weights[shape].scales.clone(),
                 weights[shape].mins.clone()) for _ in range(30) for shape in SHAPES]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    ys = {n: torch.empty(1, n) for n in (960, 576, 3072)}

    def one_pass(kernel) -> float:
        start = time.perf_counter()
        for (n, k), w, q, d, m in matrices:
            kernel(isa, 3, 2, xs[k].data_ptr(), 1, k, q.data_ptr(), d.data_ptr(), m.data_ptr(), None, None, n, w.padded_in, 4,
                   w.group_size // 32, w.zero, ys[n].data_ptr())
        return time.perf_counter() - start

    for kernel in kernels:
        one_pass(kernel)
    times = [[], []]
    for _ in range(40):
        for i, kernel in enumerate(kernels):
            times[i].append(one_pass(kernel))
    for source, t in zip(sources, times, strict=True):
        t.sort()
        print(f"isa {isa} {source}: median {t[len(t) // 2] * 1e3:.2f} ms, p25 {t[len(t) // 4] * 1e3:.2f}, "
              f"best {t[0] * 1e3:.2f}")


if __name__ == "__main__":
    main()
