"""The tiers' block moves (kv.tiers.read_blocks / write_blocks) over both CPU KV layouts.

    python benchmarks/kv_layout_moves.py [--blocks 64] [--repeats 20] [--dtype float32]

The default model's pools (30 layers, blocks of 16 slots, 3 KV heads of 64), one block's
slices moved out to raw blocks and back. A raw block holds each slice in token-major order
whatever the pool's layout, so the head layout's keys are transposed on the way (cpu_ops.c
move_slice). Prints ms per call and MB/s of raw block bytes, native and the torch reference.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from pagedllm.kv import tiers
from pagedllm.kv.kv_cache import KVCache


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int8"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    ids = list(range(1, 2 * args.blocks, 2))
    for layout in ("token", "head"):
        cache = KVCache(num_layers=30, num_blocks=2 * args.blocks + 1, block_size=16, num_kv_heads=3,
                        head_dim=64, dtype=dtype, device="cpu", layout=layout, prefault=True)
        tensors = cache.block_tensors()
        raws = tiers.read_blocks(tensors, ids)
        nbytes = sum(r.numel() for r in raws)
        for name, read, write in (("native", tiers.read_blocks, tiers.write_blocks),
                                  ("reference", tiers.read_blocks_reference, tiers.write_blocks_reference)):
            read_ms = best_ms(functools.partial(read, tensors, ids), args.repeats)
            write_ms = best_ms(functools.partial(write, tensors, ids, raws), args.repeats)
            print(f"{args.dtype} {layout:5s} {name:9s}: read {read_ms:7.2f} ms ({nbytes / read_ms / 1e3:7.0f} MB/s), "
                  f"write {write_ms:7.2f} ms ({nbytes / write_ms / 1e3:7.0f} MB/s), {len(ids)} blocks", flush=True)


if __name__ == "__main__":
    main()
