"""Streamed decode attention with the KV pools on 4 KiB pages and on 2 MiB pages, alternating.

    python benchmarks/kv_huge_pages.py [--rounds 3] [--dtype float32] [--json FILE]

The decode shape of benchmarks/attention_kernel.py (SmolLM2-135M's heads, 64
sequences of 340 tokens, 30 layers' caches: more than the caches hold), each
layer's K and V copied into pools carved by pagedllm.native.host_memory the
way KVCache carves them, zero-filled first (as ``--kv-cache-prefault`` does),
once with ``huge=False`` and once with ``huge=True``. Prints GB/s of K/V read
per arm and round, and the AnonHugePages the process holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import attention_kernel as ak  # noqa: E402

from pagedllm.bench import report  # noqa: E402
from pagedllm.native import host_memory  # noqa: E402


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def arm(decode, huge: bool, repeats: int):
    """Calls over copies of every layer's caches in one buffer (``huge``: on 2 MiB pages)."""
    specs = [(t.shape, t.dtype) for b in decode for t in (b.k_cache, b.v_cache)]
    pools = host_memory.host_tensors(specs, zero=True, huge=huge)
    calls = []
    for i, b in enumerate(decode):
        k, v = pools[2 * i], pools[2 * i + 1]
        k.copy_(b.k_cache)
        v.copy_(b.v_cache)
        calls.append(ak.run_kernel(dataclasses.replace(b, k_cache=k, v_cache=v), True))

    def all_layers():
        for call in calls:
            call()

    all_layers()
    return ak.best_of(all_layers, repeats) / len(calls), pools


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    decode, kv_bytes = ak.decode_layers(dtype)
    rows = []
    for r in range(args.rounds):
        for huge in (False, True):
            seconds, pools = arm(decode, huge, args.repeats)
            row = {"round": r + 1, "huge_pages": huge, "dtype": args.dtype, "decode_gbs": kv_bytes / seconds / 1e9,
                   "ms_per_layer": seconds * 1e3, "anon_huge_kib": anon_huge_kib()}
            del pools
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        report.write_json(args.json, {"results": rows, "read_gbs": ak.read_bandwidth_gbs(args.repeats),
                                      "env": report.environment()})


if __name__ == "__main__":
    main()
