"""Time to read one KV block back from the disk tier (file read, checks, tensor views).

    python benchmarks/disk_tier_read.py [--dir /var/tmp]

64 blocks of the default model's fp32 layout (30 layers x K and V, 16 tokens,
3 KV heads, head_dim 64: 737,280 bytes each) are written through
``DiskTier`` (unthreaded), then read back three times; the figure is ms per
block, with the files in the OS page cache. Run it once per checkout to
compare two versions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from pagedllm.kv.prefix_cache import BlockContent, hash_content
from pagedllm.kv.tiers import DiskTier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()
    layout = tuple(((16, 3, 64), torch.float32) for _ in range(60))
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        tier = DiskTier(root, {"model": "bench"}, layout, 1 << 30, threaded=False)
        blocks = []
        for i in range(64):
            content = BlockContent(None, tuple(range(i, i + 16)), ())
            block_hash = hash_content(content)
            tier.submit_write(tier.plan_write(block_hash, content), [torch.randn(16, 3, 64) for _ in range(60)])
            blocks.append((block_hash, content))
        for _ in range(2):  # warm: files in the page cache
            [tier._read_file(h, c) for h, c in blocks]
        start = time.perf_counter()
        for _ in range(3):
            read = [tier._read_file(h, c) for h, c in blocks]
        per_block = (time.perf_counter() - start) / (3 * len(blocks))
        assert all(r is not None for r in read)
    print(json.dumps({"block_bytes": tier.block_nbytes, "ms_per_block": per_block * 1e3}))


if __name__ == "__main__":
    main()
