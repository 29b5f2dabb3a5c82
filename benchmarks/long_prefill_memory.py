"""Peak memory of one chunked-prefill attention call deep into a long prompt.

The last 2,048-token chunk of a prompt of ``--context`` tokens (SmolLM2's
shape: 9 query heads, 3 KV heads, head_dim 64, float32, 16-token blocks in a
shuffled block table) goes through the torch backend's reference path and
the native kernel; each in a fresh process, whose resident memory is sampled
every 5 ms around the call. A score matrix for the chunk would take
9 x 2048 x context x 4 bytes (2.4 GB at 32k); the whole prompt's [T, T] one
9 x T x T x 4 (38.7 GB at 32k).

    python benchmarks/long_prefill_memory.py --context 32768 --json benchmarks/long_prefill_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK = 9, 3, 64, 16, 2048


def one_call(context: int, native: bool) -> dict:
    import torch

    from pagedllm.attention.base import AttentionMetadata
    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.bench.beam import PeakRSS

    torch.manual_seed(0)
    num_blocks = context // BLOCK_SIZE + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    table = torch.randperm(num_blocks - 1)[: context // BLOCK_SIZE].to(torch.int32) + 1
    query = torch.randn(CHUNK, NUM_HEADS, HEAD_DIM)
    positions = torch.arange(context - CHUNK, context)
    md = AttentionMetadata(
        slot_mapping=table.long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        block_tables=table[None, :],
        seq_lens=torch.tensor([context], dtype=torch.int32),
        query_start_loc=torch.tensor([0, CHUNK], dtype=torch.int32),
        max_query_len=CHUNK, max_seq_len=context, seq_lens_host=[context], query_lens_host=[CHUNK],
    )
    backend = TorchAttentionBackend(use_native=None if native else False)
    with PeakRSS(interval_s=0.005) as rss:
        time.sleep(0.05)
        before = rss.read()
        start = time.perf_counter()
        backend.forward(query, k_cache, v_cache, md, HEAD_DIM**-0.5)
        seconds = time.perf_counter() - start
        time.sleep(0.05)
    return {"context": context, "path": "native" if native else "torch", "seconds": seconds,
            "extra_peak_bytes": rss.peak - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[32768])
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("CONTEXT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_call(int(args.child[0]), args.child[1] == "native")))
        return 0
    rows = []
    for context in args.context:
        for path in ("torch", "native"):
            done = subprocess.run([sys.executable, __file__, "--child", str(context), path],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"context {context:6d}  {path:6s}  {r['seconds']:7.2f} s  "
                  f"extra peak RSS {r['extra_peak_bytes'] / 2**20:8.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg_1m": os.getloadavg()[0], "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
