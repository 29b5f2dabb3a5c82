"""Limits and validation at the boundary: every bad request is a 4xx naming its field
and the limit, before any work is done for it (the app over a fake engine, in
process), and the same limits in the offline API's parameter checks."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest
from server_fixture import FakeEngine

from pagedllm.engine.async_engine import MAX_UNREAD_OUTPUTS, AsyncLLMEngine
from pagedllm.errors import ConfigError, RequestError
from pagedllm.limits import INT64_MAX, RequestLimits, ServerLimits, check_token_ids
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.server import launcher
from pagedllm.server.app import build_app, check_json_value

VOCAB = 256  # the fake tokenizer's


def run(coro):
    return asyncio.run(coro)


async def call_app(calls, *, limits: ServerLimits | None = None, request_limits: RequestLimits | None = None,
                   engine_kwargs=None):
    """Runs ``calls(client, fake)`` against a fresh app over a fake engine; returns its result."""
    fake = FakeEngine(**(engine_kwargs or {}))
    if request_limits is not None:
        fake.limits = request_limits
    engine = AsyncLLMEngine(fake)
    app = build_app(engine, served_model_name="served", limits=limits)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await calls(client, fake)
    finally:
        await engine.shutdown(0)


def post_raw(path: str, body: bytes, **app_kwargs) -> httpx.Response:
    async def calls(client, fake):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        assert not fake.requests, "a refused request reached the engine"
        return r

    return run(call_app(calls, **app_kwargs))


def post(path: str, body: dict, **app_kwargs) -> httpx.Response:
    return post_raw(path, json.dumps(body).encode(), **app_kwargs)


# ---------------------------------------------------------------------------
# Each limit: 400 naming the field, and the limit in the message
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"n": 100_000}, "n", "128"),
        ({"n": 2, "best_of": 129}, "best_of", "128"),
        ({"use_beam_search": True, "n": 33}, "n", "32"),
        ({"stop": ["x"] * 17}, "stop", "16"),
        ({"stop": "x" * 257}, "stop", "256"),
        ({"stop_token_ids": list(range(200)) * 6}, "stop_token_ids", "1024"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    ],
)
def test_each_request_limit_is_400_naming_field_and_limit(fields, param, needle):
    r = post("/v1/completions", {"prompt": "x", **fields})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"] and error["type"] == "invalid_request_error"


def test_limits_are_configurable():
    limits = RequestLimits(max_n=4, max_stop=1)
    assert post("/v1/completions", {"prompt": "x", "n": 5}, request_limits=limits).json()["error"]["param"] == "n"
    assert post("/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 2}, request_limits=limits).status_code == 200
    r = post("/v1/completions", {"prompt": "x", "stop": ["a", "b"]}, request_limits=limits)
    assert r.json()["error"]["param"] == "stop" and "at most 1" in r.json()["error"]["message"]


def test_prompts_per_request_limit():
    r = post("/v1/completions", {"prompt": ["a"] * 5, "max_tokens": 1}, limits=ServerLimits(max_prompts=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 4" in r.json()["error"]["message"]
    ok = post("/v1/completions", {"prompt": ["a"] * 4, "max_tokens": 1}, limits=ServerLimits(max_prompts=4))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_body_over_the_limit_is_413_with_openai_error_object():
    big = json.dumps({"prompt": "a" * 2000}).encode()
    r = post_raw("/v1/completions", big, limits=ServerLimits(max_body_bytes=1000))
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "1000" in error["message"] and error["type"]


def test_body_without_content_length_is_cut_at_the_limit():
    async def chunks():
        for _ in range(100):
            yield b"[" * 100

    async def calls(client, fake):
        return await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})

    r = run(call_app(calls, limits=ServerLimits(max_body_bytes=1000)))
    assert r.status_code == 413 and "1000" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------
# Validation: types, ranges, text; never a 500
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"prompt": [-1, 5]}, "prompt"),
        ({"prompt": [VOCAB]}, "prompt"),
        ({"prompt": [[3], [10**25]]}, "prompt"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"temperature": "0.5"}, "temperature"),
        ({"n": True}, "n"),
        ({"n": 1.0}, "n"),
        ({"top_k": 2**64}, "top_k"),
        ({"stream": "yes"}, "stream"),
        ({"stop": [1, 2]}, "stop"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"stream_options": []}, "stream_options"),
    ],
)
def test_out_of_range_and_wrong_type_fields_are_400(fields, param):
    r = post("/v1/completions", {"prompt": "x", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"prompt": "\\ud800"}', "Unicode"),
        (b'{"prompt": ["ok", "\\udfff tail"]}', "Unicode"),
        (b'{"prompt": "x", "user": "\\ud83d"}', "Unicode"),
        (b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "Unicode"),
        (b'{"prompt": "x", "temperature": NaN}', "NaN"),
        (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
        (b'{"prompt": "x", "top_p": 1e999}', "range"),
        (b'{"prompt": "\xff"}', "JSON"),
        (b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}", "deeper"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper"),
        (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "JSON"),
        (b"[1, 2]", "object"),
        (b"", "JSON"),
    ],
)
def test_invalid_text_and_json_are_400_not_500(body, needle):
    r = post_raw("/v1/completions", body, limits=ServerLimits(max_body_bytes=1 << 20))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "wizard", "content": "hi"}, "messages"),
        ({"role": 3, "content": "hi"}, "messages"),
        ({"content": "hi"}, "messages"),
        ({"role": "user", "content": 5}, "messages"),
    ],
)
def test_chat_roles_and_content_are_checked(message, param):
    r = post("/v1/chat/completions", {"messages": [message]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_chat_limits_and_top_logprobs_range():
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                      "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_detokenize_checks_the_vocabulary():
    r = post("/detokenize", {"tokens": [VOCAB + 1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and str(VOCAB) in r.json()["error"]["message"]
    assert post("/detokenize", {"tokens": [-1]}).status_code == 400


def test_good_requests_still_pass_at_the_limits():
    r = post("/v1/completions", {"prompt": [1, 255], "n": 128, "max_tokens": 1, "seed": INT64_MAX,
                                 "logit_bias": {"255": 100, "0": -100}, "stop": ["s" * 256] * 16})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_check_json_value_is_iterative_and_names_the_field():
    nested: list = []
    for _ in range(10_000):
        nested = [nested]
    with pytest.raises(RequestError) as info:
        check_json_value({"prompt": "x", "stop": nested}, max_depth=32)
    assert info.value.param == "stop"
    check_json_value({"a": [[{"b": "ok"}]]}, max_depth=4)


# ---------------------------------------------------------------------------
# The OpenAPI document describes the real bodies
# ---------------------------------------------------------------------------


def test_openapi_describes_request_bodies_with_ranges():
    async def calls(client, fake):
        return (await client.get("/openapi.json")).json()

    doc = run(call_app(calls))
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert "prompt" in completion["required"]
    seed = next(s for s in completion["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert seed["maximum"] == INT64_MAX
    role = schemas["ChatMessageParam"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "developer", "user", "assistant", "tool", "function"}


# ---------------------------------------------------------------------------
# The offline API's parameter checks, the limit dataclasses, the flags
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(n=129), "n"),
        (SamplingParams(n=1, best_of=200), "best_of"),
        (SamplingParams(stop=["x"] * 17), "stop"),
        (SamplingParams(stop=["x" * 300]), "stop"),
        (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=100_000), "prompt_logprobs"),
        (BeamSearchParams(beam_width=33, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=2, max_tokens=4, stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_params_check_limits(params, param):
    with pytest.raises(RequestError) as info:
        params.check_limits(RequestLimits(), VOCAB)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"logit_bias": {1: 101}}, "logit_bias"),
     ({"max_tokens": 2**63}, "max_tokens"), ({"top_k": 2**70}, "top_k")],
)
def test_sampling_params_integer_and_bias_ranges(fields, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param


def test_check_token_ids_names_the_first_bad_id():
    with pytest.raises(RequestError, match="position 2"):
        check_token_ids([1, 2, 300], VOCAB, "prompt")
    with pytest.raises(RequestError):
        check_token_ids([True], VOCAB, "prompt")


def test_limit_dataclasses_reject_non_positive_values():
    with pytest.raises(ConfigError, match="max_n"):
        RequestLimits(max_n=0)
    with pytest.raises(ConfigError, match="stream_stall_timeout_s"):
        ServerLimits(stream_stall_timeout_s=float("nan"))
    assert ServerLimits(request_timeout_s=None).request_timeout_s is None


def test_serve_flags_build_the_limits():
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser, "serve")
    args = parser.parse_args(["--max-n", "8", "--max-body-bytes", "1MiB", "--stream-stall-timeout", "2.5",
                              "--max-connections", "10", "--request-timeout", "30"])
    request, server = launcher.limits_from_args(args)
    assert request == RequestLimits(max_n=8)
    assert (server.max_body_bytes, server.stream_stall_timeout_s, server.max_connections) == (2**20, 2.5, 10)
    assert server.request_timeout_s == 30.0
    defaults = launcher.limits_from_args(parser.parse_args([]))
    assert defaults == (RequestLimits(), ServerLimits())
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-n", "0"])


# ---------------------------------------------------------------------------
# A consumer that does not read holds a few outputs, not one per step
# ---------------------------------------------------------------------------


def _read_after_the_engine_ran(params_by_id: dict[str, SamplingParams], steps: int):
    """Submit the requests, let the fake engine run ``steps`` steps with nobody reading, then read."""
    async def main():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        try:
            streams = {rid: await engine.add_request(rid, "hi", params) for rid, params in params_by_id.items()}
            while fake.requests or fake.num_steps < steps:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the last hand-offs to the loop
            outputs = {}
            for rid, stream in streams.items():
                outputs[rid] = [output async for output in stream]
            return outputs
        finally:
            await engine.shutdown(0)

    return run(main())


def test_an_unread_stream_keeps_a_bounded_queue_and_loses_nothing():
    outputs = _read_after_the_engine_ran({
        "cumulative": SamplingParams(max_tokens=300),
        "delta": SamplingParams(max_tokens=300, output_kind=RequestOutputKind.DELTA),
        "final": SamplingParams(max_tokens=300, output_kind=RequestOutputKind.FINAL_ONLY),
    }, steps=300)
    cumulative, delta, final = outputs["cumulative"], outputs["delta"], outputs["final"]
    # 300 steps ran while nobody read: the first outputs queued one per step, the rest merged into the last
    assert len(cumulative) == MAX_UNREAD_OUTPUTS
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == [*range(1, MAX_UNREAD_OUTPUTS), 300]
    assert [o.finished for o in cumulative] == [False] * (MAX_UNREAD_OUTPUTS - 1) + [True]
    whole = cumulative[-1].outputs[0]
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * (MAX_UNREAD_OUTPUTS - 1) + [300 - MAX_UNREAD_OUTPUTS + 1]
    assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == whole.token_ids


def test_a_reader_a_few_steps_behind_gets_one_output_per_step():
    outputs = _read_after_the_engine_ran({"r": SamplingParams(max_tokens=MAX_UNREAD_OUTPUTS - 2)}, steps=1)
    assert [len(o.outputs[0].token_ids) for o in outputs["r"]] == list(range(1, MAX_UNREAD_OUTPUTS - 1))
