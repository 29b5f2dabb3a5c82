"""Eight requests at once after a restart: the disk tier's loads on the critical path.

Fills a ``--kv-cache-dir`` (in a child process) with 61 prompts of 368 random token ids (fp32, the default model,
a 256 MiB pool, so most blocks go to disk), starts a new engine on it in this process, then sends three waves
of eight prompts at once, each one of the filled prompts plus 75 new tokens, and prints each
wave's time to first token. In-process
(``LLMEngine``), so that the figures are the engine's, not the HTTP server's.

    python benchmarks/spr_round8/restart_burst.py [--dir /var/tmp/pagedllm-restart-burst] [--reuse]

With ``--reuse`` a second run skips the fill: on the Sapphire Rapids VM every step ran
slower for a while after the fill had written its 1 GiB of files (sync or not), so the
waves of a run that fills are the slower figures.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

NUM_PROMPTS, PREFIX_LEN, NEW_LEN, WAVE = 61, 368, 75, 8


def config(directory: str) -> EngineConfig:
    return EngineConfig(dtype="float32", max_model_len=768, kv_cache_memory=256 << 20, kv_cache_dir=directory,
                        max_num_batched_tokens=2048)


def fill(directory: str, prompts: list[list[int]]) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    engine = LLMEngine(config(directory))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"fill{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/var/tmp/pagedllm-restart-burst")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the directory afterwards, and skip the fill when it is there already")
    parser.add_argument("--fill-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)] for _ in range(NUM_PROMPTS)]
    if args.fill_only:
        fill(args.dir, prompts)
        return
    if not (args.reuse and os.path.isdir(args.dir)):
        # The first engine runs in a process of its own, as a server before its restart does.
        subprocess.run([sys.executable, __file__, "--fill-only", "--dir", args.dir], check=True)
        os.sync()  # the files' dirty pages written back now, not by the kernel during the waves

    engine = LLMEngine(config(args.dir))  # the restart
    for wave in range(3):
        start = time.monotonic()
        for j in range(WAVE):
            i = wave * WAVE + j
            engine.add_request(f"w{i}", prompts[i] + [rng.randrange(100, 40000) for _ in range(NEW_LEN)],
                               SamplingParams(max_tokens=32, temperature=0))
        first: dict[str, float] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids:
                    first.setdefault(out.request_id, (time.monotonic() - start) * 1000)
        ttft = sorted(first.values())
        print(f"wave {wave}: TTFT ms {[round(t) for t in ttft]} (mean {sum(ttft) / len(ttft):.0f})")
    disk = engine.disk_tier.counters
    print(f"disk tier: {disk.num_read_bytes / 2**20:.0f} MiB read in {disk.read_seconds:.2f} s of reader time")
    engine.shutdown()
    if not args.reuse:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
