"""One request decoding in the engine, in one process: decode tok/s of the default model (float32).

    python benchmarks/batch1_engine.py [REPEATS]                # 128-token prompt, 256 new tokens, REPEATS (4) timed
    PAGEDLLM_QUANT_LANES=0 python benchmarks/batch1_engine.py   # 4-bit codes kept in rows
    ASYNC=1 python benchmarks/batch1_engine.py                  # async_scheduling=True

Warms up on one request, then times REPEATS greedy requests one after another (prefill
included in the wall time) and prints the tokens per second. For A/Bs on a noisy machine,
alternate the settings between processes.
"""

from __future__ import annotations

import os
import sys
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    llm = LLM(dtype="float32", async_scheduling=os.environ.get("ASYNC") == "1")
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    start = time.perf_counter()
    for _ in range(repeats):
        llm.generate([prompt], params, use_tqdm=False)
    print(f"tok/s incl prefill {256 * repeats / (time.perf_counter() - start):.1f}")


if __name__ == "__main__":
    main()
