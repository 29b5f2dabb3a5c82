"""Decode attention A/B: two builds of cpu_ops.c, interleaved, at batch x context 1 x 192, 1 x 2048, 64 x 340.

    python benchmarks/attention_kernel_ab.py ISA OLD.c NEW.c     (ISA: avx512_bf16, avx512, avx2, scalar)

float32 K/V of the default model's heads; best of 7 rounds of 20 calls per
build, and the largest difference between the two builds' outputs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from pagedllm.kv import kernel_bench
from pagedllm.native import cpu_ops


def main() -> None:
    isa, sources = sys.argv[1], {"old": sys.argv[2], "new": sys.argv[3]}
    cpu_ops.available()
    libraries = {}
    for name, source in sources.items():
        cpu_ops._SOURCE_PATH = Path(source)
        libraries[name] = cpu_ops.build_library(isa=isa)
    gen = torch.Generator().manual_seed(0)
    for batch, context in ((1, 192), (1, 2048), (64, 340)):
        keys, values, tables, tiles = kernel_bench._decode_inputs(batch, context, gen)
        query = torch.randn(batch, kernel_bench.NUM_HEADS, kernel_bench.HEAD_DIM, generator=gen)
        best, outs = dict.fromkeys(libraries, float("inf")), {}
        for _ in range(7):
            for name, library in libraries.items():
                start = time.perf_counter()
                for _ in range(20):
                    outs[name] = cpu_ops.paged_attention(query, keys, values, tables, tiles,
                                                         kernel_bench.HEAD_DIM**-0.5, library=library)
                best[name] = min(best[name], (time.perf_counter() - start) / 20)
        diff = (outs["old"] - outs["new"]).abs().max().item()
        print(f"{isa} batch {batch} context {context}: old {best['old'] * 1e3:.3f} ms, new {best['new'] * 1e3:.3f} ms "
              f"(new / old {best['new'] / best['old']:.2f}), largest difference {diff:.1e}")


if __name__ == "__main__":
    main()
