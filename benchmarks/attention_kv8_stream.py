"""Decode attention streamed from memory: bfloat16 caches against int8 codes, on each kernel.

    python benchmarks/attention_kv8_stream.py [--layout shuffled|engine] [--rounds 10] [--layers 30]
    python benchmarks/attention_kv8_stream.py --prefill [--rounds 30]

A W64 decode step's attention: 64 sequences of context 340, the default model's heads
(9 query / 3 KV heads of 64, block 16), 30 layers each with its own cache, so every call
streams its K/V from memory. The same keys and values, once as a bfloat16 cache and once
as int8 codes with their float16 scales (``kv_format.quantize_kv``), are read by:

- ``bf16 / bfloat16 / tiles``: bfloat16 queries over the bfloat16 cache on the AMX tiles;
- ``bf16 / int8 / tiles``: bfloat16 queries over the codes on the AMX tiles;
- ``bf16 / int8 / vector``: the same on the avx512_bf16 path's vector kernels;
- ``fp32 / int8 / vector``: float32 queries over the codes (what a bfloat16 model's
  int8 cache was read with before its queries stayed bfloat16).

Rounds are interleaved (each round times every case once over all layers; the figure is
the best round). Prints ms per layer and the cache bytes read per second (codes and scales).
``--layers 2`` keeps the caches in L3 (about 17 MB of codes): the kernels' arithmetic
without the memory. ``--prefill``: one call of 4 prompts x 512 tokens (causal, one layer)
over a bfloat16 cache and over int8 codes, on the tiles.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernel import to_engine_layout  # noqa: E402
from attention_reference import make_paged_batch  # noqa: E402

from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.kv import kv_format  # noqa: E402
from pagedllm.native import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BATCH, CONTEXT, LAYERS = 9, 3, 64, 16, 64, 340, 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("shuffled", "engine"), default="shuffled")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--prefill", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    library = cpu_ops.build_library(isa="avx512_bf16")
    assert library.attention_amx(), "this CPU has no AMX-BF16 tiles"
    if args.prefill:
        prefill(library, args.rounds)
        return
    layers = []
    for layer in range(args.layers):
        b = make_paged_batch([(CONTEXT - 1, 1)] * BATCH, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, dtype=torch.bfloat16, seed=layer)
        md = b.metadata
        TorchAttentionBackend().write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, md.slot_mapping)
        if args.layout == "engine":
            to_engine_layout(b)
        k, ks = kv_format.quantize_kv(b.k_cache, torch.int8)
        v, vs = kv_format.quantize_kv(b.v_cache, torch.int8)
        tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, cpu_ops.tile_tokens(HEADS, KV_HEADS, HEAD_DIM))
        layers.append((b, k, v, ks, vs, tiles, b.query.float()))
    tokens = BATCH * CONTEXT * KV_HEADS
    cases = {
        "bf16 / bfloat16 / tiles": (True, lambda b, k, v, ks, vs, t, q32: cpu_ops.paged_attention(
            b.query, b.k_cache, b.v_cache, b.metadata.block_tables, t, b.scale, library=library),
            2 * tokens * HEAD_DIM * 2),
        "bf16 / int8 / tiles": (True, lambda b, k, v, ks, vs, t, q32: cpu_ops.paged_attention(
            b.query, k, v, b.metadata.block_tables, t, b.scale, library=library, k_scale=ks, v_scale=vs),
            2 * tokens * (HEAD_DIM + 2)),
        "bf16 / int8 / vector": (False, lambda b, k, v, ks, vs, t, q32: cpu_ops.paged_attention(
            b.query, k, v, b.metadata.block_tables, t, b.scale, library=library, k_scale=ks, v_scale=vs),
            2 * tokens * (HEAD_DIM + 2)),
        "fp32 / int8 / vector": (False, lambda b, k, v, ks, vs, t, q32: cpu_ops.paged_attention(
            q32, k, v, b.metadata.block_tables, t, b.scale, library=library, k_scale=ks, v_scale=vs),
            2 * tokens * (HEAD_DIM + 2)),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.rounds):
        for name, (amx, call, _) in cases.items():
            with cpu_ops.attention_amx_set(amx, library):
                start = time.perf_counter()
                for layer in layers:
                    call(*layer)
                best[name] = min(best[name], (time.perf_counter() - start) / len(layers))
    print(f"machine: {cpu_ops.cpu_model()}, {torch.get_num_threads()} threads, layout {args.layout}; "
          f"{len(layers)} layers x {BATCH} sequences x {CONTEXT} tokens, best of {args.rounds} rounds")
    print("| queries / cache / kernel | ms per layer | cache GB/s |")
    print("|---|---|---|")
    for name, (_, _, nbytes) in cases.items():
        print(f"| {name} | {best[name] * 1e3:.3f} | {nbytes / best[name] / 1e9:.1f} |")


def prefill(library, rounds: int) -> None:
    b = make_paged_batch([(0, 512)] * 4, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.bfloat16, seed=1)
    md = b.metadata
    TorchAttentionBackend().write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, md.slot_mapping)
    k, ks = kv_format.quantize_kv(b.k_cache, torch.int8)
    v, vs = kv_format.quantize_kv(b.v_cache, torch.int8)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, cpu_ops.tile_tokens(HEADS, KV_HEADS, HEAD_DIM))
    cases = {"bfloat16": (b.k_cache, b.v_cache, {}), "int8": (k, v, {"k_scale": ks, "v_scale": vs})}
    best = dict.fromkeys(cases, float("inf"))
    with cpu_ops.attention_amx_set(True, library):
        for _ in range(rounds):
            for name, (kc, vc, scales) in cases.items():
                start = time.perf_counter()
                cpu_ops.paged_attention(b.query, kc, vc, md.block_tables, tiles, b.scale, library=library, **scales)
                best[name] = min(best[name], time.perf_counter() - start)
    print(f"machine: {cpu_ops.cpu_model()}, {torch.get_num_threads()} threads; prefill 4 x 512 tokens on the tiles, "
          f"best of {rounds} rounds")
    print("| cache | ms |")
    print("|---|---|")
    for name in cases:
        print(f"| {name} | {best[name] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
