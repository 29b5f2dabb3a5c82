"""Tool calling: the constraint a ``tool_choice`` implies, and reading calls back out of the text.

Modes, as in OpenAI's API:

- ``none``: tools are ignored for generation; the text is the answer.
- ``auto``: the model decides; calls are parsed from the Hermes / ChatML
  format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``required``: the output is constrained to one call of any listed tool,
  the JSON ``{"name": <one of the names>, "arguments": <its parameters>}``.
- named: the output is constrained to the named tool's arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.schema import check_json_schema, prepare_schema

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# OpenAI: "omitting parameters defines a function with an empty parameter list".
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A call read from the output; ``arguments`` is JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str

    @classmethod
    def new(cls, name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolChoice:
    """The resolved ``tool_choice``: ``mode`` is none, auto, required or named (then ``name`` is set)."""

    mode: str
    name: str | None = None


def resolve_tool_choice(tools: list[ToolSpec], tool_choice: Any) -> ToolChoice:
    """Checks ``tool_choice`` against the tools; RequestError(param="tool_choice") when it cannot apply."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(
                f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                param="tool_choice",
            )
        if tool_choice != "none" and not tools:
            raise RequestError(f"tool_choice: {tool_choice!r} needs a non-empty tools list", param="tool_choice")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise RequestError(
            "tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice",
        )
    known = [tool.name for tool in tools]
    if name not in known:
        raise RequestError(
            f"tool_choice: no tool named {name!r} in tools (have: {', '.join(known) or 'none'})",
            param="tool_choice",
        )
    return ToolChoice("named", name)


def tool_constraint(tools: list[ToolSpec], choice: ToolChoice) -> StructuredOutputsParams | None:
    """The grammar that enforces ``required`` / named choices; None for none and auto."""
    if choice.mode == "named":
        index, tool = next((i, t) for i, t in enumerate(tools) if t.name == choice.name)
        return StructuredOutputsParams(json=_enforced_parameters(index, tool))
    if choice.mode == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": _enforced_parameters(i, t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutputsParams(json=schema)
    return None


def _enforced_parameters(index: int, tool: ToolSpec) -> Any:
    """The tool's parameter schema as the grammar enforces it; RequestError(param="tools") when it cannot."""
    try:
        return prepare_schema(tool.parameters, f"tools[{index}].function.parameters")
    except RequestError as exc:
        raise RequestError(str(exc), param="tools") from None


def parse_tools(raw_tools: list[dict] | None) -> list[ToolSpec]:
    """OpenAI's ``tools`` list to ToolSpecs; RequestError(param="tools") for a malformed entry."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw_tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name: must be a non-empty string", param="tools")
        earlier = next((j for j, spec in enumerate(specs) if spec.name == name), None)
        if earlier is not None:
            raise RequestError(f"tools[{i}].function.name: {name!r} is also the name of tools[{earlier}]; "
                               "tool names must be unique", param="tools")
        parameters = function.get("parameters") or _NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters: must be a JSON schema object", param="tools")
        # Whatever tool_choice is: auto and none enforce nothing, but a broken schema is still an error.
        check_json_schema(parameters, f"tools[{i}].function.parameters (tool {name!r})", param="tools")
        specs.append(ToolSpec(name, parameters, function.get("description")))
    return specs


def calls_from_constrained(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The call a ``required`` / named output encodes (the grammar guarantees its shape when complete)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens: no complete call
    if choice.mode == "named":
        return [ToolCall.new(choice.name, value)]
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return [ToolCall.new(value["name"], value.get("arguments", {}))]
    return []


def parse_tool_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls or None, calls) from Hermes-style output; unknown names are not calls."""
    if TOOL_CALL_OPEN not in text:
        return text, []
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    for block in _TOOL_CALL_BLOCK.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if not isinstance(value, dict) or value.get("name") not in known:
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append(ToolCall.new(value["name"], arguments))
    if not calls:
        return text, []
    content = _TOOL_CALL_BLOCK.sub("", text).strip()
    return content or None, calls


def held_back_len(text: str) -> int:
    """How many trailing characters of streamed ``auto`` text might start a ``<tool_call>`` tag.

    Everything from a complete opening tag on is held; so is a suffix that is
    a prefix of the tag, until the next delta shows whether it is one.
    """
    index = text.find(TOOL_CALL_OPEN)
    if index >= 0:
        return len(text) - index
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def tools_system_prompt(tools: list[ToolSpec]) -> str:
    """Hermes-style instructions, for chat templates that do not render ``tools`` themselves."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                     "parameters": t.parameters}}, ensure_ascii=False)
        for t in tools
    )
    return (
        "You may call one or more functions to assist with the user query. The function signatures "
        f"are within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\nFor each function "
        "call, return a JSON object with the function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_tools_into_messages(messages: list[dict], tools: list[ToolSpec]) -> list[dict]:
    """Messages for a chat template that does not render tools: the tools go into the system
    message, earlier calls and results into Hermes-style text."""
    prompt = tools_system_prompt(tools)
    rendered: list[dict] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [
                TOOL_CALL_OPEN + "\n" + json.dumps(
                    {"name": call["function"]["name"], "arguments": _arguments_value(call["function"].get("arguments"))},
                    ensure_ascii=False,
                ) + "\n" + TOOL_CALL_CLOSE
                for call in calls
                if isinstance(call, dict) and isinstance(call.get("function"), dict)
            ]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message.get("role") == "tool":
            message.pop("tool_call_id", None)
            message["content"] = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        rendered.append(message)
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}".strip()}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}
