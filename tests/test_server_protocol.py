"""Fast tests of the OpenAI layer: request validation and conversion, response
shapes, and the async engine and app driven by a fake engine (no model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_fixture import FakeEngine

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineOverloadedError
from pagedllm.errors import RequestError
from pagedllm.outputs import CompletionOutput, DeltaTracker, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.server import protocol as p
from pagedllm.server.app import build_app

# ---------------------------------------------------------------------------
# Request parsing and conversion
# ---------------------------------------------------------------------------


def completion(**fields) -> p.CompletionRequest:
    return p.parse_request(p.CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> p.ChatCompletionRequest:
    return p.parse_request(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abc", ["abc"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompt_is_rejected(prompt):
    with pytest.raises(RequestError) as info:
        completion(prompt=prompt).prompts()
    assert info.value.param == "prompt"


def test_completion_defaults_follow_openai():
    params = completion().to_params(num_prompt_tokens=2, max_model_len=100)
    assert isinstance(params, SamplingParams)
    assert params.max_tokens == 16
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.logprobs is None and params.prompt_logprobs is None


def test_completion_fields_reach_sampling_params():
    req = completion(
        max_tokens=5, temperature=0.5, top_p=0.9, n=2, best_of=3, stop="x", seed=7,
        presence_penalty=0.1, frequency_penalty=0.2, logprobs=2, echo=True, logit_bias={"5": 1.5},
        top_k=4, min_p=0.05, repetition_penalty=1.1, stop_token_ids=[9], ignore_eos=True, min_tokens=1,
        include_stop_str_in_output=True, skip_special_tokens=False,
    )
    sp = req.to_params(2, 100)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.best_of) == (5, 0.5, 0.9, 2, 3)
    assert sp.stop == ["x"] and sp.seed == 7 and sp.logit_bias == {5: 1.5}
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (sp.top_k, sp.min_p, sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == (4, 0.05, [9], True, 1)
    assert sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert sp.logprobs == 2 and sp.prompt_logprobs == 2  # echo + logprobs scores the prompt too


def test_beam_search_request_becomes_beam_params():
    bp = completion(use_beam_search=True, n=2, best_of=4, max_tokens=6, length_penalty=0.5).to_params(2, 100)
    assert isinstance(bp, BeamSearchParams)
    assert (bp.beam_width, bp.max_tokens, bp.length_penalty, bp.temperature) == (4, 6, 0.5, 0.0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"logprobs": 50}, "logprobs"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_invalid_completion_fields_name_the_param(fields, param):
    with pytest.raises(RequestError) as info:
        completion(**fields).to_params(2, 100)
    assert info.value.param == param


def test_wrong_types_are_request_errors_with_param():
    with pytest.raises(RequestError) as info:
        completion(max_tokens="lots")
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        p.parse_request(p.CompletionRequest, {"model": "m"})
    assert info.value.param == "prompt"
    with pytest.raises(RequestError):
        p.parse_request(p.CompletionRequest, ["not", "an", "object"])


def test_context_length_error_states_the_limits():
    with pytest.raises(RequestError) as info:
        completion(max_tokens=90).to_params(num_prompt_tokens=20, max_model_len=100)
    assert info.value.param == "max_tokens"
    message = str(info.value)
    assert "100" in message and "110" in message and "20" in message and "90" in message
    with pytest.raises(RequestError) as info:
        completion(max_tokens=1).to_params(num_prompt_tokens=100, max_model_len=100)
    assert info.value.param == "prompt"


def test_chat_max_tokens_defaults_to_rest_of_context_capped():
    assert chat().to_params(num_prompt_tokens=10, max_model_len=100).max_tokens == 90
    assert chat().to_params(num_prompt_tokens=10, max_model_len=100_000).max_tokens == p.DEFAULT_CHAT_MAX_TOKENS_CAP
    assert chat(max_tokens=7).to_params(10, 100).max_tokens == 7
    assert chat(max_tokens=7, max_completion_tokens=5).to_params(10, 100).max_tokens == 5
    with pytest.raises(RequestError) as info:
        chat(max_completion_tokens=0).to_params(10, 100)
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(RequestError) as info:
        chat().to_params(num_prompt_tokens=100, max_model_len=100)
    assert info.value.param == "messages"


def test_chat_logprobs_conversion():
    assert chat(logprobs=True, top_logprobs=3).to_params(1, 100).logprobs == 3
    assert chat(logprobs=True).to_params(1, 100).logprobs == 0
    assert chat().to_params(1, 100).logprobs is None
    with pytest.raises(RequestError) as info:
        chat(top_logprobs=2).to_params(1, 100)
    assert info.value.param == "top_logprobs"


def test_chat_messages_accept_text_parts():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert req.message_dicts() == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


# ---------------------------------------------------------------------------
# Response pieces
# ---------------------------------------------------------------------------


def output(texts: list[str], finished=True, prompt_ids=(1, 2, 3), cached=0, logprobs=None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=list(prompt_ids),
        outputs=[
            CompletionOutput(index=i, text=t, token_ids=[ord(c) for c in t], logprobs=logprobs,
                             finish_reason="length" if finished else None)
            for i, t in enumerate(texts)
        ],
        finished=finished,
        num_cached_tokens=cached,
    )


def test_usage_counts_prompt_once_and_every_sample():
    usage = p.usage_for([output(["ab", "cde"], cached=2), output(["f"], prompt_ids=(1,))])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 6, 10)
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_completion_logprobs_shape_and_offsets():
    positions = [
        {104: Logprob(-0.1, 1), 105: Logprob(-2.0, 2)},
        {106: Logprob(-0.3, 2), 105: Logprob(-0.2, 1)},
    ]
    lp = p.completion_logprobs([104, 106], positions, 2, chr, text_offset=3)
    assert lp.tokens == ["h", "j"]
    assert lp.text_offset == [3, 4]
    assert lp.token_logprobs == [-0.1, -0.3]
    assert lp.top_logprobs == [{"h": -0.1, "i": -2.0}, {"i": -0.2, "j": -0.3}]
    assert list(lp.top_logprobs[1]) == ["i", "j"]  # best first


def test_completion_logprobs_without_scores_are_null():
    lp = p.completion_logprobs([104], [None], 2, chr)
    assert lp.token_logprobs == [None] and lp.top_logprobs == [None]


def test_chat_logprobs_shape():
    positions = [{104: Logprob(-0.1, 1), 105: Logprob(-2.0, 2)}]
    content = p.chat_logprobs([104], positions, 1, chr).model_dump()["content"]
    assert content == [
        {"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": [{"token": "h", "logprob": -0.1, "bytes": [104]}]}
    ]


def test_delta_tracker_yields_only_new_text_and_positions():
    tracker = DeltaTracker()
    assert tracker.take(output(["ab"]).outputs[0]) == ("ab", 0, 2)
    assert tracker.take(output(["abcd"]).outputs[0]) == ("cd", 2, 4)
    assert tracker.take(output(["abcd"]).outputs[0]) == ("", 4, 4)


def test_delta_message_leaves_out_unset_fields():
    chunk = p.ChatStreamChoice(index=0, delta=p.DeltaMessage(content="x")).model_dump()
    assert chunk["delta"] == {"content": "x"}
    assert chunk["finish_reason"] is None and "logprobs" in chunk


def test_error_object_shape():
    body = p.ErrorResponse(error=p.ErrorInfo(message="m", type="invalid_request_error", param="n")).model_dump()
    assert body == {"error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}}


# ---------------------------------------------------------------------------
# AsyncLLMEngine over the fake engine
# ---------------------------------------------------------------------------


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_generate_yields_cumulative_outputs_until_finished():
    async def main():
        engine = AsyncLLMEngine(FakeEngine())
        outs = [o async for o in engine.generate("r1", "hello", SamplingParams(max_tokens=4))]
        await engine.shutdown(0)
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].text == "abcd"
    assert all(not o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_request_errors_surface_on_submit_and_fail_only_that_request():
    async def main():
        engine = AsyncLLMEngine(FakeEngine())
        with pytest.raises(RequestError):
            await engine.add_request("bad", "", SamplingParams())
        with pytest.raises(RuntimeError, match="boom"):
            await engine.add_request("boom", "EXPLODE", SamplingParams())
        outs = [o async for o in engine.generate("ok", "fine", SamplingParams(max_tokens=2))]
        assert engine.num_unfinished_requests == 0
        await engine.shutdown(0)
        return outs

    assert run(main())[-1].outputs[0].text == "ab"


async def _until_no_requests(fake, timeout_s: float = 5.0) -> None:
    """Wait (up to ``timeout_s``) until the fake engine holds no request."""
    deadline = time.monotonic() + timeout_s
    while fake.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_closing_a_stream_aborts_the_request():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = AsyncLLMEngine(fake)
        stream = await engine.add_request("r", "hello", SamplingParams(max_tokens=1000))
        await stream.__anext__()
        stream.close()
        await _until_no_requests(fake)
        assert engine.num_unfinished_requests == 0
        await engine.shutdown(0)
        return fake

    fake = run(main())
    assert fake.aborted == ["r"] and not fake.requests


def test_cancelled_consumer_aborts_the_request():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = AsyncLLMEngine(fake)

        async def consume():
            async for _ in engine.generate("r", "hello", SamplingParams(max_tokens=1000)):
                pass

        task = asyncio.create_task(consume())
        while not fake.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_no_requests(fake)
        await engine.shutdown(0)
        return fake

    assert run(main()).aborted == ["r"]


def test_step_failure_fails_in_flight_requests_and_keeps_serving():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = AsyncLLMEngine(fake)
        stream = await engine.add_request("r", "hello", SamplingParams(max_tokens=1000))
        await stream.__anext__()
        fake.fail_step = True
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].error and "crashed" in outs[-1].error
        assert outs[-1].outputs[0].finish_reason == "error"
        assert outs[-1].outputs[0].text.startswith("a")  # the text so far is kept
        later = [o async for o in engine.generate("r2", "again", SamplingParams(max_tokens=2))]
        assert later[-1].outputs[0].text == "ab" and engine.is_running
        await engine.shutdown(0)

    run(main())


def test_queue_bound_refuses_excess_requests():
    async def main():
        fake = FakeEngine(max_num_seqs=1, step_delay=0.01)
        engine = AsyncLLMEngine(fake, max_waiting=1)
        a = await engine.add_request("a", "x", SamplingParams(max_tokens=1000))
        b = await engine.add_request("b", "x", SamplingParams(max_tokens=1000))
        with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
            await engine.add_request("c", "x", SamplingParams(max_tokens=1000))
        a.close()
        c = await engine.add_request("c", "x", SamplingParams(max_tokens=1))
        assert (await c.__anext__()).finished
        b.close()
        await engine.shutdown(0)

    run(main())


def test_shutdown_drains_then_aborts():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = AsyncLLMEngine(fake)
        short = await engine.add_request("short", "x", SamplingParams(max_tokens=3))
        long = await engine.add_request("long", "x", SamplingParams(max_tokens=100_000))
        await engine.shutdown(drain_timeout=0.3)
        short_outs = [o async for o in short]
        long_outs = [o async for o in long]
        assert short_outs[-1].outputs[0].finish_reason == "length"
        assert long_outs[-1].finished and long_outs[-1].outputs[0].finish_reason == "abort"
        assert not engine.is_running
        with pytest.raises(EngineOverloadedError):
            await engine.add_request("late", "x", SamplingParams())

    run(main())


def test_idle_engine_thread_does_not_step():
    async def main():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        await asyncio.sleep(0.2)
        assert fake.num_steps == 0
        await engine.shutdown(0)

    run(main())


# ---------------------------------------------------------------------------
# The app over the fake engine, in process
# ---------------------------------------------------------------------------


async def call_app(calls, *, api_key=None, max_waiting=8, engine_kwargs=None):
    """Runs ``calls(client, fake)`` against a fresh app; returns its result."""
    fake = FakeEngine(**(engine_kwargs or {}))
    engine = AsyncLLMEngine(fake)
    app = build_app(engine, served_model_name="served", api_key=api_key, max_waiting=max_waiting)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await calls(client, fake)
    finally:
        await engine.shutdown(0)


def sse_events(body: str) -> list:
    events = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_app_completion_response_shape():
    async def calls(client, fake):
        r = await client.post("/v1/completions", json={"model": "served", "prompt": "hey", "max_tokens": 3, "n": 2})
        return r.status_code, r.json()

    status, body = run(call_app(calls))
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "served"
    assert [c["text"] for c in body["choices"]] == ["abc", "bcd"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_app_multiple_prompts_and_echo():
    async def calls(client, fake):
        r = await client.post("/v1/completions", json={"prompt": ["x", "yy"], "max_tokens": 2, "echo": True})
        return r.json()

    body = run(call_app(calls))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "xab"), (1, "yyab")]
    assert body["usage"]["prompt_tokens"] == 3


def test_app_stream_matches_non_stream_and_ends_with_done():
    async def calls(client, fake):
        payload = {"prompt": "hey", "max_tokens": 4, "logprobs": 1}
        whole = (await client.post("/v1/completions", json=payload)).json()
        r = await client.post("/v1/completions", json={**payload, "stream": True, "stream_options": {"include_usage": True}})
        return whole, r

    whole, r = run(call_app(calls))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])


def test_app_chat_stream_role_first_then_content():
    async def calls(client, fake):
        payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        whole = (await client.post("/v1/chat/completions", json=payload)).json()
        r = await client.post("/v1/chat/completions", json={**payload, "stream": True})
        return whole, sse_events(r.text)

    whole, events = run(call_app(calls))
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "max_tokens": 1_000_000}, 400, "max_tokens"),
        ({"prompt": "x", "model": "other"}, 404, "model"),
        ({"prompt": "EXPLODE", "max_tokens": 2}, 500, None),
    ],
)
def test_app_errors_use_openai_error_object(payload, status, param):
    async def calls(client, fake):
        return await client.post("/v1/completions", json=payload)

    r = run(call_app(calls))
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_app_malformed_json_is_400():
    async def calls(client, fake):
        return await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})

    r = run(call_app(calls))
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_app_api_key_guards_v1_only():
    async def calls(client, fake):
        return [
            (await client.get("/v1/models")).status_code,
            (await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code,
            (await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code,
            (await client.get("/health")).status_code,
        ]

    assert run(call_app(calls, api_key="sekret")) == [401, 401, 200, 200]


def test_app_queue_full_is_503():
    async def calls(client, fake):
        first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 60}))
        while not fake.requests:
            await asyncio.sleep(0.01)
        second = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        await first
        return second

    r = run(call_app(calls, max_waiting=0, engine_kwargs={"max_num_seqs": 1, "step_delay": 0.01}))
    assert r.status_code == 503 and "capacity" in r.json()["error"]["message"]


def test_app_step_failure_is_500_and_server_survives():
    async def calls(client, fake):
        fake.fail_step = True
        failed = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        return failed, ok

    failed, ok = run(call_app(calls))
    assert failed.status_code == 500 and "crashed" in failed.json()["error"]["message"]
    assert ok.status_code == 200


def test_app_small_endpoints_and_metrics():
    async def calls(client, fake):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        return (
            (await client.get("/v1/models")).json(),
            (await client.post("/tokenize", json={"prompt": "hey"})).json(),
            (await client.post("/detokenize", json={"tokens": [104, 105]})).json(),
            (await client.get("/version")).json(),
            (await client.get("/metrics")).text,
        )

    models, tok, detok, version, metrics = run(call_app(calls))
    assert models["object"] == "list" and models["data"][0]["id"] == "served"
    assert tok == {"count": 3, "max_model_len": 200_000, "tokens": [104, 101, 121]}
    assert detok == {"prompt": "hi"}
    assert "version" in version
    for name in ("num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count", "kv_shared_blocks", "kv_slots_holding_tokens_ratio"):
        assert f"pagedllm:{name}" in metrics
    assert 'pagedllm:e2e_request_latency_seconds_count{model_name="fake-model"} 1.0' in metrics
