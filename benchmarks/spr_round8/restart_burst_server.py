"""The burst of restart_burst.py against a running ``pagedllm serve``: three waves of eight
streamed ``/v1/completions`` requests at once (token-id prompts), each wave's TTFTs printed.

    python benchmarks/spr_round8/restart_burst.py --reuse      # fills /var/tmp/pagedllm-restart-burst
    pagedllm serve --dtype float32 --max-model-len 768 --max-num-batched-tokens 2048 \\
        --kv-cache-memory 256MiB --kv-cache-dir /var/tmp/pagedllm-restart-burst --port 8811 &
    python benchmarks/spr_round8/restart_burst_server.py 8811
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import httpx

NUM_PROMPTS, PREFIX_LEN, NEW_LEN, WAVE = 61, 368, 75, 8  # as restart_burst.py


async def one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.monotonic()
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"text"' in line:
                return (time.monotonic() - start) * 1000
    raise RuntimeError("the stream ended without a token")


async def main(port: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)] for _ in range(NUM_PROMPTS)]
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        for wave in range(3):
            batch = [prompts[wave * WAVE + j] + [rng.randrange(100, 40000) for _ in range(NEW_LEN)]
                     for j in range(WAVE)]
            ttft = await asyncio.gather(*(one(client, url, p) for p in batch))
            print(f"wave {wave}: TTFT ms {[round(t) for t in ttft]} (mean {sum(ttft) / len(ttft):.0f})")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
