"""200 requests at once against a real ``pagedllm serve`` on a tiny model: good ones
(streamed and not, completions and chat) mixed with bad bodies. Every good request
succeeds, every bad one is a 4xx in OpenAI's error object, /health answers 200
throughout, and no KV block is held at the end."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from server_fixture import serving
from test_server_fuzz import make_tiny_llama

NUM_REQUESTS = 200
USER = [{"role": "user", "content": "t5 t6 t7"}]

GOOD = [
    ("/v1/completions", {"prompt": "t5 t6 t7", "max_tokens": 8, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "t5 t6 t7", "max_tokens": 8, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 4, "n": 2, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": "t5 t6 t7 t8", "max_tokens": 3, "prompt_logprobs": 1,
                         "truncate_prompt_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                              "stream": True}),
]
BAD = [
    ("/v1/completions", b'{"prompt": "t5", "max_tokens": '),
    ("/v1/completions", {"prompt": "t5", "max_tokens": "8"}),
    ("/v1/completions", {"prompt": "t5", "n": 100_000}),
    ("/v1/completions", {"prompt": [5, 100_000]}),
    ("/v1/completions", {"prompt": "t5", "temperature": -1}),
    ("/v1/completions", {"prompt": "   "}),
    ("/v1/completions", {"prompt": "t5", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "t5", "truncate_prompt_tokens": 0}),
    ("/v1/completions", {"prompt": "t5", "logit_bias": {"1_0": 1}}),
    ("/v1/completions", {"prompt": "t5", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "t5", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "t5", "max_tokens": 10**9}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "tool", "content": "t6"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": "t5"}),
    ("/v1/chat/completions", [1, 2, 3]),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-burst")
    make_tiny_llama(directory)
    with serving("--model", str(directory), "--dtype", "float32", "--device", "cpu",
                 "--num-kv-blocks", "256", "--block-size", "8", "--max-num-seqs", "16") as proc:
        yield proc


async def _send(client: httpx.AsyncClient, path: str, body) -> tuple[int, list[str] | dict]:
    """(status, the SSE data lines of a stream or the JSON body)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = client.build_request("POST", path, content=content, headers={"content-type": "application/json"})
    response = await client.send(request, stream=True)
    try:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status_code, [line async for line in response.aiter_lines() if line.startswith("data:")]
        return response.status_code, json.loads(await response.aread())
    finally:
        await response.aclose()


def _check_good(path: str, body: dict, status: int, result) -> None:
    assert status == 200, (path, body, result)
    if body.get("stream"):
        assert result[-1] == "data: [DONE]", result
        events = [json.loads(line[5:]) for line in result[:-1]]
        assert not any("error" in event for event in events), events
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        # one finish; "stop" only where the body lets the model end at its EOS (random weights sample it)
        assert finishes in ([["length"]] if body.get("ignore_eos") else [["length"], ["stop"]]), events
        return
    choices = result["choices"]
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    assert len(choices) == n and all(c["finish_reason"] in ("length", "stop") for c in choices), result
    if "prompt_logprobs" in body:
        assert len(choices[0]["prompt_logprobs"]) == result["usage"]["prompt_tokens"] == 2


def test_a_burst_of_good_and_bad_requests(server):
    rng = random.Random(0)
    kinds = [("good", *rng.choice(GOOD)) if i % 2 == 0 else ("bad", *rng.choice(BAD)) for i in range(NUM_REQUESTS)]
    rng.shuffle(kinds)
    health: list[int] = []

    async def burst():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            done = asyncio.Event()

            async def probe():
                async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as prober:
                    while not done.is_set():
                        health.append((await prober.get("/health")).status_code)
                        await asyncio.sleep(0.05)

            prober = asyncio.create_task(probe())
            try:
                return await asyncio.gather(*(_send(client, path, body) for _, path, body in kinds))
            finally:
                done.set()
                await prober

    start = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - start
    for (kind, path, body), (status, result) in zip(kinds, results):
        if kind == "good":
            _check_good(path, body, status, result)
        else:
            assert 400 <= status < 500, (path, body, status, result)
            error = result["error"]
            assert error["type"] == "invalid_request_error" and error["message"], result
    assert health and set(health) == {200}, health
    m = server.wait_idle(timeout=30)
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0
    log = server.log(tail=None)
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert elapsed < 60, elapsed
