"""Tool-call parsing, tool_choice resolution and the request-side constraint conversions (no engine)."""

from __future__ import annotations

import json

import pytest

from pagedllm.errors import RequestError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.server import protocol as p
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.tools import (
    ToolChoice,
    calls_from_constrained,
    held_back_len,
    parse_tool_calls,
    parse_tools,
    render_tools_into_messages,
    resolve_tool_choice,
    tool_constraint,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
SPECS = parse_tools(TOOLS)


def _chat(**body) -> p.ChatCompletionRequest:
    return p.parse_request(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body})


def test_hermes_calls_are_parsed_with_the_text_around_them():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, SPECS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}')  # the last one left open
    content, calls = parse_tool_calls(two, SPECS)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_text_that_is_not_a_known_call_stays_content():
    for text in ("no calls here", "<tool_call>{not json}</tool_call>",
                 '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'):
        assert parse_tool_calls(text, SPECS) == (text, [])


def test_streamed_text_is_held_back_where_a_tag_may_start():
    assert held_back_len("Hello") == 0
    assert held_back_len("Hello <tool") == len("<tool")
    assert held_back_len("Hello <") == 1
    assert held_back_len('a <tool_call>{"na') == len('<tool_call>{"na')
    assert held_back_len("a < b") == 0


def test_tool_choice_resolution_and_errors():
    assert resolve_tool_choice(SPECS, None) == ToolChoice("auto")
    assert resolve_tool_choice([], None) == ToolChoice("none")
    assert resolve_tool_choice(SPECS, {"type": "function", "function": {"name": "get_time"}}) == ToolChoice("named", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"function": 3}):
        with pytest.raises(RequestError) as info:
            resolve_tool_choice(SPECS, bad)
        assert info.value.param == "tool_choice"
    with pytest.raises(RequestError):
        resolve_tool_choice([], "required")
    with pytest.raises(RequestError) as info:
        parse_tools([{"type": "function", "function": {"parameters": {}}}])
    assert info.value.param == "tools"


def test_required_and_named_constraints_and_their_outputs():
    named = tool_constraint(SPECS, ToolChoice("named", "get_weather"))
    assert named.json == SPECS[0].parameters
    required = tool_constraint(SPECS, ToolChoice("required"))
    names = [option["properties"]["name"]["const"] for option in required.json["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert tool_constraint(SPECS, ToolChoice("auto")) is None
    (call,) = calls_from_constrained('{"city": "Oslo"}', ToolChoice("named", "get_weather"))
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    (call,) = calls_from_constrained('{"name": "get_time", "arguments": {}}', ToolChoice("required"))
    assert call.name == "get_time"
    assert calls_from_constrained('{"city": "Os', ToolChoice("named", "get_weather")) == []  # cut by max_tokens


def test_tools_are_described_in_the_system_message_for_a_plain_template():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    rendered = render_tools_into_messages(messages, SPECS)
    assert rendered[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert rendered[3]["content"] == "<tool_response>\n12 C\n</tool_response>" and "tool_call_id" not in rendered[3]


def test_response_format_and_extra_body_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    params = req.to_params(5, 100)
    assert isinstance(params, SamplingParams) and params.structured_outputs.json == schema
    assert _chat(response_format={"type": "json_object"}).to_params(5, 100).structured_outputs.json_object is True
    assert _chat(response_format={"type": "text"}).to_params(5, 100).structured_outputs is None
    assert _chat(structured_outputs={"regex": "a+"}).constraint()[0].regex == "a+"
    assert _chat(guided_choice=["x", "y"]).constraint() == (StructuredOutputsParams(choice=["x", "y"]), "guided_choice")
    beam = _chat(use_beam_search=True, n=2, guided_regex="b+").to_params(5, 100)
    assert isinstance(beam, BeamSearchParams) and beam.structured_outputs.regex == "b+"
    completion = p.parse_request(p.CompletionRequest, {"prompt": "x", "guided_json": schema})
    assert completion.to_params(1, 100).structured_outputs.json == schema
    tool_req = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_req.constraint() == (StructuredOutputsParams(json=SPECS[0].parameters), "tool_choice")
    assert _chat(tools=TOOLS, tool_choice="none").template_tools() is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format"),
    ],
)
def test_conflicting_or_malformed_constraints_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        _chat(**body).to_params(5, 100)
    assert info.value.param == param


def test_the_default_chat_template_receives_the_tools():
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = tokenizer.apply_chat_template(messages)
    with_tools = tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert "get_weather" not in plain
    assert with_tools.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in with_tools and with_tools.endswith("<|im_start|>assistant\n")


def test_a_tool_without_parameters_is_called_with_an_empty_object():
    """OpenAI: omitting parameters means an empty parameter list, so the named call is exactly {}."""
    (ping,) = parse_tools([{"type": "function", "function": {"name": "ping"}}])
    params = tool_constraint([ping], ToolChoice("named", "ping"))
    schema = json.loads(params.spec().text)
    assert schema["properties"] == {} and schema["additionalProperties"] is False
