"""The activation quantization (two levels) on each x86 path, one thread: 2048 rows of 576 and of
1536 floats, the medians of 15 alternating calls (the wrapper's allocations included).

    python benchmarks/activation_quant_bench.py
"""

import statistics
import time

import torch

from pagedllm.native import quant_ops

torch.set_num_threads(1)
quant_ops.available()
for K in (576, 1536):
    x = torch.randn(2048, K)
    res = {1: [], 2: []}
    for _ in range(15):
        for isa in (1, 2):
            start = time.perf_counter()
            quant_ops.quantize_activations(x, K, isa_override=isa, levels=2)
            res[isa].append(time.perf_counter() - start)
    print(K, {quant_ops.ISA_NAMES[i]: f"{statistics.median(v)*1e3:.3f} ms" for i, v in res.items()})
