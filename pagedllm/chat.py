"""Chat messages: what each role requires, checked in one place for the server and the offline API.

:func:`check_messages` applies OpenAI's rules to a list of message dicts and raises
:class:`RequestError` naming the exact field (``messages[2].tool_call_id``);
:func:`normalise_messages` checks them and returns what a chat template renders.
``Tokenizer.apply_chat_template`` (and so ``LLM.chat``) and the server's chat and
/tokenize routes all go through them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.limits import CHAT_ROLES


def shown(value: object, limit: int = 60) -> str:
    """``value`` as the client wrote it (JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_error(field: str, message: str) -> RequestError:
    return RequestError(f"{field}: {message}", param=field)


def check_messages(messages: object) -> None:
    """What OpenAI requires of each message: an object with a known ``role``; content
    (a string or a list of content parts) for system, developer, user and tool messages;
    a string ``tool_call_id`` for tool messages; content or well-formed ``tool_calls``
    for assistant messages (whose content may then be null); a name for function
    messages; ``tool_calls`` on assistant messages only. The error names the field,
    e.g. ``messages[2].tool_call_id``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        _check_shape(message, i)
        _check_role_rules(message, f"messages[{i}]")


def _check_shape(message: object, i: int) -> None:
    """An object with a known role, string-or-parts content and a string name."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
    if message["role"] not in CHAT_ROLES:
        raise RequestError(
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r}",
            param="messages",
        )
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise RequestError(f"messages[{i}].content must be a string or a list of parts", param="messages")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise _field_error(f"messages[{i}].name", f"must be a string, got {shown(name)}")


def _check_role_rules(message: dict, where: str) -> None:
    role = message["role"]
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise _field_error(f"{where}.tool_calls", f"only assistant messages have tool_calls (this is a "
                                                  f"{role} message)")
    if role == "assistant":
        if tool_calls is not None:
            _check_tool_calls(tool_calls, f"{where}.tool_calls")
        if message.get("content") is None and not tool_calls and all(
            message.get(key) is None for key in ("function_call", "refusal")
        ):
            raise _field_error(f"{where}.content", "an assistant message needs content unless it has tool_calls")
    elif role == "function":
        if message.get("name") is None:
            raise _field_error(f"{where}.name", "is required for a function message")
    elif message.get("content") is None:
        state = "must not be null" if "content" in message else "is required"
        raise _field_error(f"{where}.content", f"{state} for a {role} message "
                                               "(a string or a list of content parts)")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is None:
            raise _field_error(f"{where}.tool_call_id", "is required for a tool message (the id of the "
                                                        "call it answers)")
        if not isinstance(call_id, str):
            raise _field_error(f"{where}.tool_call_id", f"must be a string, got {shown(call_id)}")


def _check_tool_calls(tool_calls: object, where: str) -> None:
    """An assistant message's ``tool_calls``: [{id, type: "function", function: {name, arguments}}]."""
    if not isinstance(tool_calls, list):
        raise _field_error(where, f"must be a list of tool calls, got {shown(tool_calls)}")
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _field_error(at, f"must be an object {{id, type, function}}, got {shown(call)}")
        for key in ("id", "type", "function"):
            if call.get(key) is None:
                raise _field_error(f"{at}.{key}", "is required")
        if not isinstance(call["id"], str):
            raise _field_error(f"{at}.id", f"must be a string, got {shown(call['id'])}")
        if call["type"] != "function":
            raise _field_error(f"{at}.type", f"must be 'function', got {shown(call['type'])}")
        function = call["function"]
        if not isinstance(function, dict):
            raise _field_error(f"{at}.function", f"must be an object {{name, arguments}}, got {shown(function)}")
        for key in ("name", "arguments"):
            if function.get(key) is None:
                raise _field_error(f"{at}.function.{key}", "is required")
            if not isinstance(function[key], str):
                what = "a string (JSON text)" if key == "arguments" else "a string"
                raise _field_error(f"{at}.function.{key}", f"must be {what}, got {shown(function[key])}")


def normalise_messages(messages: Sequence[dict]) -> list[dict]:
    """Checked messages as a chat template takes them: fields that are null dropped,
    OpenAI text parts joined into one content string, null content as ""."""
    check_messages(messages)
    normalised = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        kept = {key: value for key, value in message.items() if value is not None}
        normalised.append({**kept, "content": content if content is not None else ""})
    return normalised


def _join_text_parts(parts: list, index: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(
                f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                f"got type {kind!r}", param="messages",
            )
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text must be a string", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


# Names a chat template receives from the caller's own arguments: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "return_tensors", "tokenizer_kwargs",
})
MAX_TEMPLATE_KWARGS = 64


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs as the template's extra variables: at most MAX_TEMPLATE_KWARGS names,
    each an identifier that is not set another way (RESERVED_TEMPLATE_KWARGS); RequestError otherwise."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs: must be a dict of variable names to values, got {shown(kwargs)}",
                           param="chat_template_kwargs")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} names, got {len(kwargs)}",
                           param="chat_template_kwargs")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise RequestError(f"chat_template_kwargs: {shown(name)} is not a template variable name "
                               "(letters, digits and _, not starting with a digit)", param="chat_template_kwargs")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs: {name!r} is set by the request itself, not here "
                               "(use the request's own field)", param="chat_template_kwargs")
    return dict(kwargs)


MAX_DOCUMENTS = 256


def check_documents(documents: object) -> list[dict[str, str]]:
    """``documents`` for a chat template (vLLM's and transformers' RAG input): a list of at most
    MAX_DOCUMENTS dicts of strings (``title``, ``text``, ...); RequestError naming the bad one."""
    if not isinstance(documents, (list, tuple)):
        raise _field_error("documents", f"must be a list of documents (dicts of strings), got {shown(documents)}")
    if len(documents) > MAX_DOCUMENTS:
        raise _field_error("documents", f"at most {MAX_DOCUMENTS} documents, got {len(documents)}")
    for i, document in enumerate(documents):
        if not isinstance(document, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in document.items()
        ):
            raise _field_error(f"documents[{i}]", f"must be a dict of strings (such as title and text), "
                               f"got {shown(document)}")
    return [dict(d) for d in documents]
