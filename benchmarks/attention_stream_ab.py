"""Streamed decode attention, two or more builds of cpu_ops.c alternating in one process.

    python benchmarks/attention_stream_ab.py [--layout shuffled|engine] ISA DTYPE A.c B.c [...]
    (ISA: avx512_bf16, avx512, avx2)

64 sequences of 340 tokens (the default model's heads, blocks of 16),
every one of 30 layers its own cache, so each call streams its K/V from memory
as in a W64 decode step. Six rounds, each build in turn; prints each build's
best ms per layer and GB/s of K/V read.

``--layout shuffled`` (the default) gives every sequence blocks drawn at random
from the pool. ``--layout engine`` lays them out as a fresh pool fills under a
W64-like run: each sequence's prompt blocks side by side (a fresh pool hands
out blocks in order), then the blocks that decode adds every 16 tokens taken in
turn by the 64 sequences.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from pagedllm.kv import kernel_bench
from pagedllm.native import cpu_ops

LAYERS, BATCH, CONTEXT, ROUNDS = 30, 64, 340, 6


def main() -> None:
    args = sys.argv[1:]
    layout = "shuffled"
    if args[0] == "--layout":
        layout, args = args[1], args[2:]
        if layout not in ("shuffled", "engine"):
            raise SystemExit(f"--layout takes shuffled or engine, not {layout!r}")
    isa, dtype, sources = args[0], getattr(torch, args[1]), args[2:]
    cpu_ops.available()
    libraries = []
    for source in sources:
        cpu_ops._SOURCE_PATH = Path(source)
        libraries.append(cpu_ops.build_library(isa=isa))
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        keys, values, tables, tiles = kernel_bench._decode_inputs(BATCH, CONTEXT, gen)
        if layout == "engine":
            tables = kernel_bench.engine_tables(*tables.shape)
        query = torch.randn(BATCH, kernel_bench.NUM_HEADS, kernel_bench.HEAD_DIM, generator=gen)
        layers.append((query.to(dtype), keys.to(dtype), values.to(dtype), tables, tiles))
    kv_bytes = 2 * BATCH * CONTEXT * kernel_bench.NUM_KV_HEADS * kernel_bench.HEAD_DIM * dtype.itemsize
    best = [float("inf")] * len(libraries)
    for _ in range(ROUNDS):
        for i, library in enumerate(libraries):
            start = time.perf_counter()
            for query, keys, values, tables, tiles in layers:
                cpu_ops.paged_attention(query, keys, values, tables, tiles, kernel_bench.HEAD_DIM**-0.5,
                                        library=library)
            best[i] = min(best[i], (time.perf_counter() - start) / LAYERS)
    for source, seconds in zip(sources, best, strict=True):
        print(f"{Path(source).name}: {seconds * 1e3:.3f} ms/layer, {kv_bytes / seconds / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
