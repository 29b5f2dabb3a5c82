"""Structured outputs and tool calls through a real ``pagedllm serve`` on the default model,
with the official openai client."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_fixture import ServerProcess

from pagedllm.models.paths import default_model_path
from pagedllm.structured.tools import TOOL_CALL_OPEN, parse_tool_calls, parse_tools
from pagedllm.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                                    "required": ["zone"]}},
}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--num-kv-blocks", "512", "--max-num-seqs", "16", "--async-scheduling", "--served-model-name", "default")
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
    assert code == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="default", messages=_chat("Tell me about Paris as JSON."), response_format=City,
        temperature=0, max_tokens=80,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


def test_json_object_mode_gives_parseable_json(client):
    for prompt in ("List two fruits as JSON.", "Describe a dog as JSON.", "hello"):
        response = client.chat.completions.create(
            model="default", messages=_chat(prompt), response_format={"type": "json_object"},
            temperature=0, max_tokens=80
        )
        text = response.choices[0].message.content
        if response.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.lstrip().startswith("{")  # cut by max_tokens, still JSON so far


def test_regex_and_choice_on_completions_and_chat(client):
    completion = client.completions.create(
        model="default", prompt="The year the Berlin wall fell:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"regex": r" (19|20)[0-9]{2}"}},
    )
    assert re.fullmatch(r" (19|20)[0-9]{2}", completion.choices[0].text)
    chat = client.chat.completions.create(
        model="default", messages=_chat("Is the sky blue? Answer yes or no."), max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")


def test_named_tool_call_arguments_validate_and_stream_equals_non_stream(client):
    request = dict(
        model="default", messages=_chat("What is the weather in Tokyo?"), tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=60,
    )
    response = client.chat.completions.create(**request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
    assert arguments["unit"] in ("celsius", "fahrenheit")
    streamed_name, streamed_args, finish = "", "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed_name += delta_call.function.name or ""
            streamed_args += delta_call.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert (streamed_name, streamed_args, finish) == ("get_weather", call.function.arguments, "tool_calls")


def test_required_tool_choice_calls_a_listed_tool(client):
    response = client.chat.completions.create(
        model="default", messages=_chat("What time is it in UTC?"), tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required", temperature=0, max_tokens=60,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)



def _weather_turn(index: int, city: str, result: str, answer: str) -> list[dict]:
    """One earlier exchange: the user asks, the assistant calls get_weather, the tool answers."""
    call = {"id": f"call_{index}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{index}", "content": result},
        {"role": "assistant", "content": answer},
    ]


# Two worked examples: with them the 135M model answers a weather question with a call.
FEW_SHOT = (_weather_turn(1, "Paris", '{"temperature": 18, "sky": "cloudy"}', "It is 18 degrees and cloudy in Paris.")
            + _weather_turn(2, "Berlin", '{"temperature": 12, "sky": "sunny"}', "It is 12 degrees and sunny in Berlin."))
AUTO_REQUEST = dict(model="default", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="auto", temperature=0, max_tokens=80)


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


def test_auto_tool_choice_calls_the_tool_with_schema_valid_arguments(client):
    response = client.chat.completions.create(messages=FEW_SHOT + _chat("What is the weather in Tokyo?"), **AUTO_REQUEST)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Tokyo", "unit": "celsius"})]
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"


def test_streamed_auto_tool_call_equals_the_non_streamed_one(client):
    messages = FEW_SHOT + _chat("What is the weather in Tokyo?")
    whole = client.chat.completions.create(messages=messages, **AUTO_REQUEST).choices[0].message.tool_calls
    content, finish = "", None
    pieces: dict[int, dict] = {}  # tool call index -> its name and argument text, concatenated
    for chunk in client.chat.completions.create(messages=messages, stream=True, **AUTO_REQUEST):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            piece = pieces.setdefault(call.index, {"name": "", "arguments": "", "id": None})
            piece["name"] += call.function.name or ""
            piece["arguments"] += call.function.arguments or ""
            piece["id"] = piece["id"] or call.id
        finish = chunk.choices[0].finish_reason or finish
    assert TOOL_CALL_OPEN not in content and "tool_call" not in content and not content.strip()
    assert finish == "tool_calls" and all(piece["id"] for piece in pieces.values())
    streamed = [(pieces[i]["name"], json.loads(pieces[i]["arguments"])) for i in sorted(pieces)]
    assert streamed == _calls(whole) and streamed


def test_auto_without_a_tool_question_answers_in_text(client):
    messages = FEW_SHOT + _chat("Tell me a joke.")
    choice = client.chat.completions.create(messages=messages, **AUTO_REQUEST).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content and TOOL_CALL_OPEN not in choice.message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(messages=messages, stream=True, **AUTO_REQUEST) if chunk.choices)
    assert streamed == choice.message.content


def test_auto_calls_are_what_the_raw_completion_says(client):
    """Oracle for the parser: the same prompt through /v1/completions (no tool handling) gives
    the raw Hermes text, and parsing it gives the calls the chat endpoint returned."""
    messages = FEW_SHOT + _chat("What is the weather in Tokyo?")
    tokenizer = Tokenizer.load(default_model_path())
    server_messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as the server dumps them
    text = tokenizer.apply_chat_template(server_messages, tools=AUTO_REQUEST["tools"])
    raw = client.completions.create(
        model="default", prompt=tokenizer.encode(text, add_special_tokens=False), temperature=0, max_tokens=80,
    ).choices[0].text
    assert TOOL_CALL_OPEN in raw, raw
    content, raw_calls = parse_tool_calls(raw, parse_tools(AUTO_REQUEST["tools"]))
    chat = client.chat.completions.create(messages=messages, **AUTO_REQUEST).choices[0].message
    assert [(c.name, json.loads(c.arguments)) for c in raw_calls] == _calls(chat.tool_calls)
    assert content == chat.content


def test_a_finished_grammar_ends_before_min_tokens(client):
    """min_tokens cannot outlast a choice: the answer ends as the grammar does (200, "stop"),
    streamed or not, rather than failing late."""
    request = dict(model="default", prompt="Is the sky blue? Answer:", max_tokens=20, temperature=0,
                   extra_body={"min_tokens": 10, "structured_outputs": {"choice": ["yes", "no"]}})
    choice = client.completions.create(**request).choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    chunks = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"

@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"structured_outputs": {"regex": r"[^\s\S]"}}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=_chat("hi"), max_tokens=5, **body)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_a_schema_too_costly_to_compile_is_a_400_within_the_servers_limit(client, server):
    # xgrammar would take minutes on this pattern; the server's limit (10 s by default) stops it.
    costly = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^[a-z]{50000}$"}}}
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=_chat("hi"), max_tokens=5, response_format=costly)
    assert time.monotonic() - start < 40
    assert info.value.body["param"] == "response_format" and "too costly to compile" in info.value.body["message"]
    # The server goes on: constrained and plain requests right after are answered.
    response = client.chat.completions.create(model="default", messages=_chat("A fruit as JSON."), max_tokens=40,
                                              temperature=0, response_format={"type": "json_object"})
    assert response.choices[0].message.content.strip().startswith("{")
    metrics = server.wait_idle()
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:num_requests_running"] == 0


def test_top_logprobs_of_a_constrained_answer_are_finite(client):
    """Tokens the grammar forbids are not listed as alternatives (they were -inf: a 500)."""
    response = client.chat.completions.create(
        model="default", messages=_chat("Tell me about Paris as JSON."), temperature=0, max_tokens=40,
        logprobs=True, top_logprobs=5, response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": City.model_json_schema()}},
    )
    choice = response.choices[0]
    assert len(choice.logprobs.content) == response.usage.completion_tokens
    tops = [top for entry in choice.logprobs.content for top in entry.top_logprobs]
    assert tops and all(top.logprob > -1e9 for top in tops)
    assert any(len(entry.top_logprobs) < 5 for entry in choice.logprobs.content)  # forced tokens stand alone


DEAD_END = r"a[^\s\S]"  # "a", then nothing may follow, and "a" is no complete match


def _assert_dead_end_error(error, param: str) -> None:
    assert error.body["param"] == param and error.body["code"] == "grammar_dead_end", error.body
    assert error.body["type"] == "invalid_request_error" and "dead end" in error.body["message"]
    assert error.body["message"].startswith(f"{param}: ") and "'a'" in error.body["message"]


def test_a_grammar_that_dead_ends_mid_answer_is_a_400_or_an_error_event(client, server):
    """Never a 500: the answer so far cannot be finished, which is the grammar's fault."""
    request = dict(model="default", prompt="Say a:", max_tokens=10, temperature=0,
                   extra_body={"structured_outputs": {"regex": DEAD_END}})
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    _assert_dead_end_error(info.value, "structured_outputs.regex")
    assert server.wait_idle()["pagedllm:kv_cache_usage_perc"] == 0
    with pytest.raises(openai.APIError) as info:  # headers went out: the error comes as an event
        list(client.completions.create(**request, stream=True))
    _assert_dead_end_error(info.value, "structured_outputs.regex")
    assert server.wait_idle()["pagedllm:kv_cache_usage_perc"] == 0
    chat = dict(model="default", messages=_chat("Say a."), max_tokens=10, temperature=0,
                extra_body={"guided_regex": DEAD_END})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat)
    _assert_dead_end_error(info.value, "guided_regex")
    with pytest.raises(openai.APIError) as info:
        list(client.chat.completions.create(**chat, stream=True))
    _assert_dead_end_error(info.value, "guided_regex")
    metrics = server.wait_idle()
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:num_requests_running"] == 0


def test_a_dead_end_in_one_of_n_choices_fails_the_request_and_frees_it(client, server):
    request = dict(model="default", prompt="Say a:", max_tokens=50, temperature=1.0, n=3, seed=1,
                   extra_body={"structured_outputs": {"regex": r"(a[^\s\S]|b+)"}})
    # Whatever the draws: each choice is a run of b's, or the whole answer is the dead end's 400.
    for stream in (False, True):
        try:
            if stream:
                chunks = list(client.completions.create(**request, stream=True))
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert len(finishes) == 3 and "error" not in finishes
            else:
                choices = client.completions.create(**request).choices
                assert all(re.fullmatch("b+", c.text) for c in choices) and len(choices) == 3
        except openai.APIError as error:
            _assert_dead_end_error(error, "structured_outputs.regex")
    request["extra_body"] = {"structured_outputs": {"regex": DEAD_END}}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    _assert_dead_end_error(info.value, "structured_outputs.regex")
    metrics = server.wait_idle()
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:num_requests_running"] == 0


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "broken", "parameters": parameters}}


@pytest.mark.parametrize("parameters", [{"type": "foo"}, {"type": "object", "properties": 5}])
@pytest.mark.parametrize("tool_choice", ["auto", "none", "required", {"type": "function", "function": {"name": "broken"}}])
def test_a_tool_schema_that_is_no_json_schema_is_a_400_for_every_tool_choice(client, parameters, tool_choice):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=_chat("hi"), max_tokens=5,
                                       tools=[WEATHER_TOOL, _tool(parameters)], tool_choice=tool_choice)
    body = info.value.body
    assert body["param"] == "tools" and "tools[1]" in body["message"] and "'broken'" in body["message"], body
    assert "not a valid JSON Schema" in body["message"]


def test_auto_accepts_a_valid_tool_schema_the_grammar_could_not_enforce(client):
    """auto does not constrain the call, so a keyword no grammar enforces is no reason to refuse."""
    tool = _tool({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    response = client.chat.completions.create(model="default", messages=_chat("hi"), max_tokens=5, temperature=0,
                                              tools=[tool], tool_choice="auto")
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": 5}}}}, "response_format", "at #/properties: 5 is not of type 'object'"),
        ({"extra_body": {"structured_outputs": {"json": {"type": "foo"}}}}, "structured_outputs.json",
         "at #/type: 'foo' is not valid"),
        ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"minLength": "3"}}}}}, "guided_json",
         "at #/properties/a/minLength"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "minProperties": 2}}}}, "response_format", "at #: 'minProperties' 2 cannot be met"),
        ({"extra_body": {"structured_outputs": {"json": {"type": "object", "properties": {"inner": {
            "type": "object", "properties": {"k": {"type": "integer"}}, "minProperties": 2}}}}}},
         "structured_outputs.json", "at #/properties/inner: 'minProperties' 2 cannot be met"),
    ],
)
def test_schemas_are_checked_against_the_metaschema_and_errors_say_where(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=_chat("hi"), max_tokens=5, **body)
    assert info.value.body["param"] == param and words in info.value.body["message"], info.value.body
