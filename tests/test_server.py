"""End to end: ``pagedllm serve`` in a subprocess on the default model, driven by
the official ``openai`` client (and raw HTTP where the client hides details)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from server_fixture import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
# Small KV pools keep start-up quick; they are ample for these tests. The main
# server overlaps its steps (the CUDA default, off by default on the CPU), so
# streaming, aborts and disconnects are checked on that path too; the second
# server takes the ordinary one.
ENGINE_ARGS = ("--num-kv-blocks", "1024", "--max-num-seqs", "64", "--async-scheduling")


@pytest.fixture(scope="module")
def servers():
    """The main server, and a second one with an API key and room for one request."""
    main = ServerProcess(*ENGINE_ARGS)
    secured = ServerProcess(
        "--num-kv-blocks", "256", "--api-key", "sekret", "--max-num-seqs", "1", "--max-waiting", "0",
        "--served-model-name", "guarded",
    )
    try:
        yield main.wait_ready(), secured.wait_ready()
    finally:
        codes = (main.stop(), secured.stop())
    assert codes == (0, 0), f"servers exited with {codes}:\n{main.log()}\n{secured.log()}"


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def secured(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def tokenize(server: ServerProcess, text: str) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_completion_and_usage(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(tokenize(server, PROMPT))
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    message = r.choices[0].message
    assert message.role == "assistant" and message.content
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 8


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_samples(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    assert 3 <= r.usage.completion_tokens <= 15


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely token
    assert lp.text_offset[0] == 0


def test_chat_top_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_stop_string(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[: free.index(stop)]


def test_bad_words_are_not_generated(client):
    """A word of the greedy text, then a phrase of it, as vLLM's bad_words (extra_body): the
    model writes around them (the server overlaps its steps, so a phrase's ban must see the
    tokens just generated)."""
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 4, free
    for bad in (words[0], " ".join(words[1:3])):
        text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"bad_words": [bad]}).choices[0].text
        assert bad not in text and text != free, (bad, text)


def test_allowed_token_ids_are_the_only_tokens_sampled(server, client):
    allowed = tokenize(server, " yes no maybe")
    pieces = {httpx.post(f"{server.base_url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                  logprobs=0, extra_body={"allowed_token_ids": allowed})
    tokens = r.choices[0].logprobs.tokens
    assert len(tokens) == 12 and set(tokens) <= pieces, (tokens, pieces)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"allowed_token_ids": [10**9]})
    assert info.value.body["param"] == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2,
                                  extra_body={"bad_words": ["x"], "use_beam_search": True})
    assert info.value.body["param"] == "bad_words"


def test_a_requests_own_chat_template_is_refused_unless_the_server_trusts_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages[0].content }}"})
    assert info.value.body["param"] == "chat_template" and "--trust-request-chat-template" in info.value.body["message"]


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, paged world!"
    tok = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 10_000_000}, "max_tokens"),
    ],
)
def test_invalid_parameters_are_400_with_param(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"


def test_context_overflow_message_states_the_limits(server, client):
    limit = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit)
    assert str(limit) in info.value.body["message"]


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"


def test_api_key(secured):
    url = f"{secured.base_url}/v1"
    for key in ("wrong",):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key=key, max_retries=0).models.list()
    assert httpx.get(f"{url}/models").status_code == 401
    assert httpx.get(f"{secured.base_url}/health").status_code == 200
    good = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["guarded"]
    r = good.completions.create(model="guarded", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_queue_full_is_503(secured):
    """--max-num-seqs 1 --max-waiting 0: a second concurrent request is refused."""
    headers = {"Authorization": "Bearer sekret"}
    body = {"model": "guarded", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=secured.base_url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the connection
            assert next(lines).startswith("data: {")
            second = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert second.status_code == 503, second.text
            assert "capacity" in second.json()["error"]["message"]
    assert secured.wait_idle()["pagedllm:kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------------------
# Load, disconnects, metrics
# ---------------------------------------------------------------------------


def test_64_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i} and", max_tokens=8, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        assert finish in ("length", "stop")
        return "".join(parts)

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=170)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert len(texts) == 64 and all(texts)
    metrics = server.wait_idle()
    assert metrics["pagedllm:num_requests_running"] == 0
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            # keep the iterator: httpx closes the response (hangs up) once its line iterator is dropped
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.metrics()["pagedllm:kv_cache_usage_perc"] > 0
    closed = time.monotonic()
    metrics = server.wait_idle(timeout=15)
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:num_requests_running"] == 0
    assert time.monotonic() - closed < 15  # 2000 tokens would take far longer: it was aborted


def test_disconnect_during_non_streaming_request_aborts_it(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.5)
    closed = time.monotonic()
    metrics = server.wait_idle(timeout=15)
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:num_requests_running"] == 0
    assert time.monotonic() - closed < 15


def test_metrics_names(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "num_requests_running", "num_requests_running_peak", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
        "prompt_tokens_total", "generation_tokens_total",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket", "kv_shared_blocks", "kv_slots_holding_tokens_ratio",
    ):
        assert f"pagedllm:{name}" in text, name
    metrics = server.metrics()
    assert metrics["pagedllm:generation_tokens_total"] > 0 and metrics["pagedllm:prompt_tokens_total"] > 0


def test_sigterm_drains_in_flight_stream_and_exits_zero():
    """SIGTERM with a stream in flight: the stream still completes, then the process exits 0."""
    server = ServerProcess("--num-kv-blocks", "128", "--drain-timeout", "60").wait_ready()
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finals = [json.loads(line[6:]) for line in rest[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.kill()
