"""Time the native decode attention over int8 K/V: 64 sequences x context 340 (SmolLM2's heads).

    PYTHONPATH=CHECKOUT python benchmarks/attention_int8_decode.py CHECKOUT

Run it alternately from two checkouts to compare builds; prints the best of 30 calls.
"""

from __future__ import annotations

import sys
import time

import torch

tree = sys.argv[1]
sys.path.insert(0, tree + "/tests")
from attention_reference import make_paged_batch  # noqa: E402

from pagedllm.native import cpu_ops  # noqa: E402

torch.set_num_threads(2)
lib = cpu_ops.build_library(isa=cpu_ops.cpu_isa_paths()[-1])
b = make_paged_batch([(340, 1)] * 64, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                     dtype=torch.float32, seed=0)
md = b.metadata
shape = b.k_cache.shape
k, v = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
ks, vs = torch.zeros(shape[:-1], dtype=torch.float16), torch.zeros(shape[:-1], dtype=torch.float16)
slots = torch.arange(shape[0] * shape[1]) if len(shape) == 4 else torch.arange(shape[0])
keys = torch.randn(slots.numel(), shape[-2], shape[-1])
cpu_ops.write_kv_quantized(keys, torch.randn_like(keys), k, v, slots, ks, vs, library=lib)
tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, cpu_ops.tile_tokens(9, 3, 64))


def attend():
    return cpu_ops.paged_attention(b.query, k, v, md.block_tables, tiles, b.scale, library=lib,
                                   k_scale=ks, v_scale=vs)


attend()
best = float("inf")
for _ in range(30):
    start = time.perf_counter()
    attend()
    best = min(best, time.perf_counter() - start)
print(f"{lib.isa_name().decode()} int8 decode 64 x 340: {best * 1e3:.3f} ms")
