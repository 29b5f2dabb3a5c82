"""Inputs the fuzzer rarely draws, against a real ``pagedllm serve`` (a tiny random Llama
whose word-level tokenizer has no token for whitespace): each gets a 4xx naming what to
fix, or works as documented, and leaves /health green and no KV block held. The same
values through the offline API raise RequestError, never a deeper exception."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixture import serving
from test_server_fuzz import make_tiny_llama

from pagedllm.errors import RequestError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-bad-inputs")
    make_tiny_llama(directory)
    return directory


@pytest.fixture(scope="module")
def server(tiny_dir):
    with serving("--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu",
                 "--num-kv-blocks", "128", "--block-size", "8", "--max-num-seqs", "8") as proc:
        yield proc


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kwargs)
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    return r


def assert_4xx(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for needle in needles:
        assert needle in error["message"], error["message"]


def test_a_prompt_with_no_tokens_is_400_not_a_hang(server):
    # The tiny tokenizer splits on whitespace and adds no BOS: "   " has no token at all.
    r = post(server, "/v1/completions", {"prompt": "   ", "max_tokens": 2})
    assert_4xx(r, 400, "prompt", "no tokens")
    r = post(server, "/v1/completions", {"prompt": ["t5", " \n "], "max_tokens": 2})
    assert_4xx(r, 400, "prompt", "no tokens")
    m = server.wait_idle()
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("key", [" 1", "1_0", "+1", "\uff11", "\u0663", "1.0", ""])
def test_logit_bias_keys_are_decimal_digits_only(server, key):
    # int() would read each of these as a token id.
    r = post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 1, "logit_bias": {key: 1}})
    assert_4xx(r, 400, "logit_bias", "decimal digits", repr(key))


@pytest.mark.parametrize(("field", "value"), [("top_p", 1e-300), ("repetition_penalty", 1e-320),
                                              ("temperature", 1e300), ("min_p", 1e-40)])
def test_sampling_floats_must_survive_float32(server, field, value):
    # top_p 1e-300 is 0 in float32 and kept no token, so the sampler fell back to token 0.
    r = post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 1, field: value})
    assert_4xx(r, 400, field, "32-bit float")


def test_null_optional_fields_take_their_defaults(server):
    body = {"prompt": "t5 t6", "max_tokens": 2, "n": None, "presence_penalty": None, "frequency_penalty": None,
            "min_p": None, "repetition_penalty": None, "logprobs": None, "stream": None, "echo": None,
            "stop": None, "seed": None, "min_tokens": None, "ignore_eos": None}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2,
                                              "logprobs": None, "n": None, "top_logprobs": None})
    assert r.status_code == 200, r.text
    # A required field stays required.
    assert_4xx(post(server, "/v1/completions", {"prompt": None}), 400, "prompt")


def test_type_errors_say_what_was_sent(server):
    r = post(server, "/v1/completions", {"prompt": "t5", "max_tokens": True})
    assert_4xx(r, 400, "max_tokens", "valid integer", "got true")
    r = post(server, "/v1/completions", {"prompt": "t5", "n": 2.0})
    assert_4xx(r, 400, "n", "got 2.0")


def test_content_encoding_is_415_and_huge_integers_are_400(server):
    r = post(server, "/v1/completions", content=b'{"prompt": "t5"}',
              headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_4xx(r, 415, None, "gzip", "uncompressed")
    r = post(server, "/v1/completions", content=b'{"prompt": "t5", "max_tokens": ' + b"9" * 5000 + b"}",
              headers={"content-type": "application/json"})
    assert_4xx(r, 400, None, "too many digits")
    assert "set_int_max_str_digits" not in r.text


def test_head_is_served_wherever_get_is(server):
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        assert httpx.head(f"{server.base_url}{path}", timeout=10).status_code == 200, path


def test_chat_parts_and_roles_name_the_problem(server):
    url = "/v1/chat/completions"
    r = post(server, url, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert_4xx(r, 400, "messages", "messages[0].content[0]", "'image_url'")
    r = post(server, url, {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert_4xx(r, 400, "messages", "messages[0].content[0].text must be a string")


def test_continue_final_message_continues_the_assistant_message(server):
    url = "/v1/chat/completions"
    messages = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t7 t8"}]
    r = post(server, url, {"messages": messages, "continue_final_message": True, "max_tokens": 2})
    assert_4xx(r, 400, "continue_final_message", "add_generation_prompt")
    r = post(server, url, {"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False})
    assert_4xx(r, 400, "continue_final_message", "assistant")
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False},
                        timeout=30).json()["count"]
    r = post(server, url, {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
                           "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    # The prompt ends right after "t7 t8" (the cut newline has no token of its own here).
    assert r.json()["usage"]["prompt_tokens"] == tokens


def test_the_openai_client_gets_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="t5", max_tokens=1, logit_bias={"1_0": 1})
    assert info.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="  ", max_tokens=1)
    assert info.value.body["param"] == "prompt"


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"t5\"}"}}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def _with_call(**changes) -> dict:
    return {**CALL, **changes}


# Each message list with the field its error names and a word of the message; the server
# and LLM.chat refuse them alike.
BAD_MESSAGES = [
        ([{"role": "user"}], "messages[0].content", "required"),
        ([{"role": "user", "content": None}], "messages[0].content", "null"),
        ([{"role": "system", "content": None}, {"role": "user", "content": "t5"}], "messages[0].content", "null"),
        ([{"role": "developer"}, {"role": "user", "content": "t5"}], "messages[0].content", "required"),
        ([{"role": "user", "content": "t5"}, {"role": "assistant"}], "messages[1].content", "tool_calls"),
        ([{"role": "user", "content": "t5"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "content": "t6"}], "messages[2].tool_call_id", "required"),
        ([{"role": "user", "content": "t5"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "content": "t6", "tool_call_id": 1}], "messages[2].tool_call_id", "string"),
        ([{"role": "user", "content": "t5"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content", "required"),
        ([{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}], "messages[0].tool_calls", "list"),
        ([{"role": "assistant", "content": None, "tool_calls": ["call_1"]}], "messages[0].tool_calls[0]", "object"),
        ([{"role": "assistant", "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}],
         "messages[0].tool_calls[0].id", "required"),
        ([{"role": "assistant", "tool_calls": [_with_call(id=7)]}], "messages[0].tool_calls[0].id", "string"),
        ([{"role": "assistant", "tool_calls": [{k: v for k, v in CALL.items() if k != "type"}]}],
         "messages[0].tool_calls[0].type", "required"),
        ([{"role": "assistant", "tool_calls": [_with_call(type="code")]}], "messages[0].tool_calls[0].type",
         "'function'"),
        ([{"role": "assistant", "tool_calls": [_with_call(function=None)]}], "messages[0].tool_calls[0].function",
         "required"),
        ([{"role": "assistant", "tool_calls": [_with_call(function={"arguments": "{}"})]}],
         "messages[0].tool_calls[0].function.name", "required"),
        ([{"role": "assistant", "tool_calls": [_with_call(function={"name": "lookup"})]}],
         "messages[0].tool_calls[0].function.arguments", "required"),
        ([{"role": "assistant", "tool_calls": [_with_call(function={"name": "lookup", "arguments": {"q": 1}})]}],
         "messages[0].tool_calls[0].function.arguments", "string"),
        ([{"role": "user", "content": "t5", "tool_calls": [CALL]}], "messages[0].tool_calls", "assistant"),
        ([{"role": "function", "content": "t5"}], "messages[0].name", "required"),
]


@pytest.mark.parametrize(("messages", "param", "needle"), BAD_MESSAGES)
def test_chat_messages_are_checked_by_role(server, messages, param, needle):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = post(server, path, {"messages": messages, "max_tokens": 2})
        assert_4xx(r, 400, param, param + ":", needle)


def test_tool_calls_and_their_answers_stay_accepted(server):
    client, model = _client(server)
    messages = [
        {"role": "system", "content": "t3"},
        {"role": "user", "content": [{"type": "text", "text": "t5"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "t6 t7"},
        {"role": "assistant", "content": "t8"},
        {"role": "user", "content": ""},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[TOOL], tool_choice="none",
                                           max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages[:3] + [{"role": "tool", "content": "t6"}],
                                       max_tokens=2)
    assert info.value.body["param"] == "messages[3].tool_call_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, tools=[TOOL, TOOL], max_tokens=2)
    assert info.value.body["param"] == "tools" and "tools[1].function.name" in info.value.body["message"]
    assert "unique" in info.value.body["message"]


def _client(server) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client, client.models.list().data[0].id


PROMPT = "t5 t9 t44 t3 t66 t9"
PROMPT_IDS = [5, 9, 44, 3, 66, 9]


def test_prompt_logprobs_come_back_in_vllms_format(server):
    client, model = _client(server)
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"] == PROMPT_IDS
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    (choice,) = first.choices
    plp = choice.model_extra["prompt_logprobs"]
    assert len(plp) == len(PROMPT_IDS) == first.usage.prompt_tokens and plp[0] is None
    for token_id, position in zip(PROMPT_IDS[1:], plp[1:]):
        chosen = position[str(token_id)]
        assert chosen["decoded_token"] == f"t{token_id}" and chosen["logprob"] <= 0 and chosen["rank"] >= 1
        by_rank = sorted(position.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in by_rank][:2] == [1, 2] and len(position) == (2 if chosen["rank"] <= 2 else 3)
        assert by_rank[0]["logprob"] >= by_rank[1]["logprob"]
        assert all(e["decoded_token"] == f"t{k}" for k, e in position.items())
    # The same numbers as echo's logprobs, and again once the prompt is in the prefix cache.
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2)
    token_logprobs = echo.choices[0].logprobs.token_logprobs[: len(PROMPT_IDS)]
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx([p[str(t)]["logprob"] for t, p in zip(PROMPT_IDS[1:], plp[1:])],
                                               abs=1e-5)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    again_plp = again.choices[0].model_extra["prompt_logprobs"]
    assert [sorted(p) if p else p for p in again_plp] == [sorted(p) if p else p for p in plp]
    # 0: the prompt token alone; not asked for: no field.
    zero = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert [list(p) if p else p for p in zero.choices[0].model_extra["prompt_logprobs"]] == \
        [None] + [[str(t)] for t in PROMPT_IDS[1:]]
    assert "prompt_logprobs" not in client.completions.create(model=model, prompt=PROMPT, max_tokens=1).choices[0].model_extra
    # Chat: one list for the prompt, at the top of the response (as vLLM).
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 1})
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert len(chat_plp) == chat.usage.prompt_tokens and chat_plp[0] is None and all(chat_plp[1:])


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"prompt_logprobs": 21}, "[0, 20]"), ({"prompt_logprobs": -1}, "whole vocabulary"),
     ({"prompt_logprobs": -2}, "greater than or equal to -1"), ({"prompt_logprobs": "2"}, "valid integer"),
     ({"prompt_logprobs": 1, "stream": True}, "stream"),
     ({"prompt_logprobs": 1, "use_beam_search": True, "n": 2}, "beam")],
)
def test_prompt_logprobs_are_capped(server, fields, needle):
    client, model = _client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body=fields)
    assert info.value.body["param"] == "prompt_logprobs" and needle in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "t5"}], max_tokens=1,
                                       extra_body=fields)
    assert info.value.body["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    client, model = _client(server)
    greedy = {"model": model, "max_tokens": 4, "temperature": 0}

    def extra(**fields) -> dict:
        return {"extra_body": {"ignore_eos": True, **fields}}

    cut = client.completions.create(prompt=PROMPT, echo=True, **greedy, **extra(truncate_prompt_tokens=2))
    assert cut.usage.prompt_tokens == 2
    tail = client.completions.create(prompt="t66 t9", echo=True, **greedy, **extra())
    assert cut.choices[0].text == tail.choices[0].text and cut.choices[0].text.startswith("t66 t9")
    ids = client.completions.create(prompt=PROMPT_IDS, **greedy, **extra(truncate_prompt_tokens=3))
    assert ids.usage.prompt_tokens == 3
    for keep in (6, 100, -1):  # no shorter than the prompt: all of it
        whole = client.completions.create(prompt=PROMPT, **greedy, **extra(truncate_prompt_tokens=keep))
        assert whole.usage.prompt_tokens == len(PROMPT_IDS)
    with_logprobs = client.completions.create(prompt=PROMPT, **greedy,
                                              **extra(truncate_prompt_tokens=4, prompt_logprobs=1))
    assert len(with_logprobs.choices[0].model_extra["prompt_logprobs"]) == 4
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(messages=messages, **greedy, **extra()).usage.prompt_tokens
    chat = client.chat.completions.create(messages=messages, **greedy, **extra(truncate_prompt_tokens=3))
    assert full > 3 and chat.usage.prompt_tokens == 3
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    for bad, needle in ((0, ">= 1"), (-2, "greater than or equal to -1"), (max_model_len + 1, str(max_model_len)),
                        (2.0, "valid integer")):
        for create, body in ((client.completions.create, {"prompt": PROMPT}),
                             (client.chat.completions.create, {"messages": messages})):
            with pytest.raises(openai.BadRequestError) as info:
                create(**body, **greedy, **extra(truncate_prompt_tokens=bad))
            assert info.value.body["param"] == "truncate_prompt_tokens" and needle in info.value.body["message"]


def test_no_block_is_held_at_the_end(server):
    m = server.wait_idle(timeout=30)
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:kv_cache_usage_perc"] == 0
    assert "Traceback" not in server.log(), server.log()


# ---------------------------------------------------------------------------
# The offline API: the same values raise RequestError
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"include_stop_str_in_output": 1.5}, "include_stop_str_in_output"),
        ({"detokenize": "x"}, "detokenize"),
        ({"logit_bias": {"1_0": 1.0}}, "logit_bias"),
        ({"logit_bias": {" 1": 1.0}}, "logit_bias"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: True}}, "logit_bias"),
        ({"logit_bias": {1: "2"}}, "logit_bias"),
        ({"top_p": 1e-300}, "top_p"),
        ({"repetition_penalty": 1e-320}, "repetition_penalty"),
        ({"temperature": 1e300}, "temperature"),
    ],
)
def test_sampling_params_refuse_what_would_break_deeper(fields, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param


def test_beam_search_params_check_their_flags():
    with pytest.raises(RequestError) as info:
        BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos="x")
    assert info.value.param == "ignore_eos"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from pagedllm import LLM

    return LLM(str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=32, block_size=8)


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda llm: llm.generate("   ", SamplingParams(max_tokens=2), use_tqdm=False), "prompt"),
        (lambda llm: llm.generate({"prompt_token_ids": 5}, SamplingParams(max_tokens=2), use_tqdm=False),
         "prompt_token_ids"),
        (lambda llm: llm.generate({"prompt_token_ids": None}, use_tqdm=False), "prompt_token_ids"),
        (lambda llm: llm.generate(None, use_tqdm=False), "prompts"),
        (lambda llm: llm.generate(5, use_tqdm=False), "prompts"),
        (lambda llm: llm.generate("t5", 5, use_tqdm=False), "sampling_params"),
        (lambda llm: llm.generate("t5", {"max_tokens": 3}, use_tqdm=False), "sampling_params"),
        (lambda llm: llm.chat(None, use_tqdm=False), "messages"),
        (lambda llm: llm.chat([{"role": "bogus", "content": "t5"}], use_tqdm=False), "messages"),
    ],
)
def test_offline_api_raises_request_error(llm, call, param):
    with pytest.raises(RequestError) as info:
        call(llm)
    assert info.value.param == param
    assert llm.kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize(("messages", "param", "needle"), BAD_MESSAGES)
def test_offline_chat_checks_messages_by_role_as_the_server(llm, messages, param, needle):
    with pytest.raises(RequestError) as info:
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert info.value.param == param
    assert str(info.value).startswith(param + ":") and needle in str(info.value), str(info.value)
    assert llm.kv_cache_stats().num_used_blocks == 0


def test_offline_chat_takes_a_tool_call_and_its_answer(llm):
    messages = [
        {"role": "system", "content": "t3"},
        {"role": "user", "content": [{"type": "text", "text": "t5"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "t2 t6 t7"},
        {"role": "assistant", "content": "t2 t8"},
        {"role": "user", "content": ""},
    ]
    # (the template glues a role tag to the first word of each message, unknown to this tokenizer)
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 2
    ids = out.prompt_token_ids
    assert any(ids[i:i + 2] == [6, 7] for i in range(len(ids))) and 8 in ids, ids
    with pytest.raises(RequestError) as info:
        llm.chat(messages[:3] + [{"role": "tool", "content": "t6"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert info.value.param == "messages[3].tool_call_id"


def test_offline_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    def greedy(**fields) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, **fields)

    (cut,) = llm.generate(PROMPT, greedy(truncate_prompt_tokens=2), use_tqdm=False)
    (tail,) = llm.generate("t66 t9", greedy(), use_tqdm=False)
    assert cut.prompt_token_ids == PROMPT_IDS[-2:] == tail.prompt_token_ids
    assert cut.prompt == "t66 t9"
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids and cut.outputs[0].text == tail.outputs[0].text
    (ids,) = llm.generate({"prompt_token_ids": PROMPT_IDS}, greedy(truncate_prompt_tokens=3), use_tqdm=False)
    assert ids.prompt_token_ids == PROMPT_IDS[-3:]
    for keep in (6, 100, -1):  # no shorter than the prompt: all of it
        (whole,) = llm.generate(PROMPT, greedy(truncate_prompt_tokens=keep), use_tqdm=False)
        assert whole.prompt_token_ids == PROMPT_IDS and whole.prompt == PROMPT
    messages = [{"role": "user", "content": PROMPT}]
    (full,) = llm.chat(messages, greedy(), use_tqdm=False)
    (chat,) = llm.chat(messages, greedy(truncate_prompt_tokens=3), use_tqdm=False)
    assert len(full.prompt_token_ids) > 3 and chat.prompt_token_ids == full.prompt_token_ids[-3:]
    assert llm.kv_cache_stats().num_used_blocks == 0


def test_offline_truncate_prompt_tokens_refuses_bad_values(llm):
    for bad, needle in ((0, ">= 1"), (-2, ">= 1"), (2.0, "integer"), (True, "integer"), (2**63, "64 bits")):
        with pytest.raises(RequestError) as info:
            SamplingParams(truncate_prompt_tokens=bad)
        assert info.value.param == "truncate_prompt_tokens" and needle in str(info.value), str(info.value)
    max_model_len = llm.llm_engine.max_model_len
    too_many = SamplingParams(max_tokens=2, truncate_prompt_tokens=max_model_len + 1)
    for call in (lambda: llm.generate(PROMPT, too_many, use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "t5"}], too_many, use_tqdm=False)):
        with pytest.raises(RequestError) as info:
            call()
        assert info.value.param == "truncate_prompt_tokens" and str(max_model_len) in str(info.value)
    assert llm.kv_cache_stats().num_used_blocks == 0
