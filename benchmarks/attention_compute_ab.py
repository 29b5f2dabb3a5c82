"""The native attention kernels where their K/V stay in the caches: one 300-token prefill (causal, GFLOP/s)
and one request's decode step over 340 / 2,000 cached tokens (GB/s of K/V), per ISA path and pool layout.

    PYTHONPATH=CHECKOUT python benchmarks/attention_compute_ab.py [--paths avx512_bf16,avx2] [--repeats 200]

Run it on two checkouts in turn (PYTHONPATH) to compare kernel builds; the arithmetic, not the memory,
bounds these shapes, so they move little with the VM's read bandwidth."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_reference import make_paged_batch  # noqa: E402

from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.kv.kv_cache import in_layout  # noqa: E402
from pagedllm.native import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def case(specs, kv_layout: str):
    b = make_paged_batch(specs, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         dtype=torch.float32, seed=5)
    md = b.metadata
    TorchAttentionBackend().write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, md.slot_mapping)
    k, v = in_layout(b.k_cache, kv_layout, values=False), in_layout(b.v_cache, kv_layout, values=True)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, cpu_ops.tile_tokens(HEADS, KV_HEADS, HEAD_DIM))
    return b, k, v, tiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", default=",".join(cpu_ops.cpu_isa_paths()))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    assert cpu_ops.available()
    torch.set_grad_enabled(False)
    for path in args.paths.split(","):
        with cpu_ops.using_isa(path) as library:
            for kv_layout in ("token", "head"):
                row = {"path": path, "kv_layout": kv_layout}
                for name, specs in (("prefill_300", [(0, 300)]), ("decode_340", [(339, 1)]),
                                    ("decode_2000", [(1999, 1)])):
                    b, k, v, tiles = case(specs, kv_layout)
                    call = functools.partial(cpu_ops.paged_attention, b.query, k, v, b.metadata.block_tables,
                                             tiles, b.scale, library=library)
                    seconds = best_seconds(call, args.repeats if name != "prefill_300" else args.repeats // 10)
                    n = specs[0][0] + specs[0][1]
                    if name.startswith("prefill"):
                        row[name + "_gflops"] = round(4 * HEAD_DIM * HEADS * n * (n + 1) / 2 / seconds / 1e9, 1)
                    else:
                        row[name + "_gbs"] = round(2 * n * KV_HEADS * HEAD_DIM * 4 / seconds / 1e9, 1)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
