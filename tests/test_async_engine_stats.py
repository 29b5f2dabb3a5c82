"""The served engine's stats snapshot is never older than an output a client has read.

A client that reads a streamed chunk and then scrapes /metrics must see the
engine as of that chunk's step or later (the request running, its KV blocks
in use), not the state from before the step. The real engine runs a tiny
model; its get_stats is slowed down so that a snapshot taken after the
outputs are posted would lose the race every time.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_server_fuzz import make_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory)
    return LLM(model=str(directory), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32)


def test_stats_read_after_an_output_include_that_step(tiny_llm, monkeypatch):
    engine = tiny_llm.llm_engine
    real_get_stats = engine.get_stats

    def slow_get_stats():
        time.sleep(0.05)
        return real_get_stats()

    monkeypatch.setattr(engine, "get_stats", slow_get_stats)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        served = AsyncLLMEngine(engine)
        seen = []
        for i in range(3):
            stream = served.generate(f"r{i}", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
            first = await stream.__anext__()
            stats = served.get_stats()
            seen.append((len(first.outputs[0].token_ids), stats.num_running_reqs, stats.kv.num_used_blocks))
            await stream.aclose()  # the client goes away: the request is aborted
            deadline = time.monotonic() + 10
            while served.get_stats().num_running_reqs and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            idle = served.get_stats()
            assert idle.num_running_reqs == 0 and idle.kv.num_used_blocks == 0
        await served.shutdown(0)
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 60))
    for num_tokens, num_running, num_used_blocks in seen:
        assert num_tokens >= 1
        assert num_running == 1 and num_used_blocks >= 1, seen
