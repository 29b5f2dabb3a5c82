"""W64 in one process, every engine step timed: where a run's time goes between prefill and decode.

    python benchmarks/w64_steps.py [--dtype bfloat16|float32] [--kv-cache-dtype auto|int8|...] [--lazy]

Builds ``LLM(dtype=..., kv_cache_dtype=..., kv_cache_prefault=not --lazy)``, warms it up on two prompts, then runs
W64's 64 greedy requests (../shared/workloads/w64.json, 128 output tokens each) with the engine's
``step`` wrapped in a timer. Prints output tok/s, the time of the steps over 80 ms (the prefill
chunks of about 2,048 tokens) and of the rest (decode), and every step's milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

W64_PATH = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w64.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--lazy", action="store_true", help="touch the KV pools lazily (no prefault)")
    args = parser.parse_args()
    work = json.loads(W64_PATH.read_text())
    prompts = [{"prompt_token_ids": p} for p in work["prompt_token_ids"]]
    llm = LLM(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_prefault=not args.lazy)
    engine = llm.llm_engine
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    times: list[float] = []
    step = engine.step

    def timed_step():
        started = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - started)
        return result

    engine.step = timed_step
    params = SamplingParams(max_tokens=work["output_len"], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    long = [t for t in times if t > 0.08]
    print(f"wall {wall:.2f} s, {produced / wall:.1f} output tok/s, {len(times)} steps")
    print(f"steps over 80 ms: {len(long)}, {sum(long):.2f} s; the rest: {len(times) - len(long)}, "
          f"{sum(times) - sum(long):.2f} s")
    print(" ".join(f"{t * 1e3:.0f}" for t in times))


if __name__ == "__main__":
    main()
