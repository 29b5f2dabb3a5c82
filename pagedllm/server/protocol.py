"""OpenAI request and response bodies, and the pure conversions around them.

Requests are parsed leniently (unknown fields are ignored, as OpenAI does) and
converted to :class:`SamplingParams` / :class:`BeamSearchParams`, whose
validation raises :class:`RequestError` naming the offending field. Responses
are built from :class:`RequestOutput` here, so everything in this module can be
tested without an engine.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from pagedllm.chat import check_messages
from pagedllm.chat import shown as _shown
from pagedllm.errors import RequestError
from pagedllm.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_LOGIT_BIAS,
    RequestLimits,
    check_at_most,
    check_sampling_lists,
    check_token_ids,
    parse_token_id_key,
)
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    check_extra_args,
    prompt_tokens_kept,
)
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.tools import (
    ToolChoice,
    ToolSpec,
    parse_tools,
    resolve_tool_choice,
    tool_constraint,
)

# OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Chat defaults to what is left of the context, but never more than this.
DEFAULT_CHAT_MAX_TOKENS_CAP = 1024
MAX_TOP_LOGPROBS = 20
# Shown when the chosen token's logprob is unknown (JSON has no -inf); vLLM uses the same value.
_MISSING_LOGPROB = -9999.0

# token id -> the text shown for it in logprobs
TokenText = Callable[[int], str]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def response_id(prefix: str, body_id: str | None, header_id: str | None) -> str:
    """A response's id as vLLM forms it: ``prefix-`` and the X-Request-Id header, else the body's
    request_id, else a random one. A given id is 1-128 letters, digits or ._:- (it is echoed in
    a header and names the request in the engine, where two running requests may not share it)."""
    for value, param in ((header_id, "X-Request-Id"), (body_id, "request_id")):
        if value is None:
            continue
        if not _REQUEST_ID.fullmatch(value):
            raise RequestError(f"{param}: must be 1-128 letters, digits or ._:- characters, got {_shown(value)}",
                               param=param)
        return f"{prefix}-{value}"
    return random_id(prefix)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# What a union field accepts, said once instead of pydantic's one error per member.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids "
    "(token ids are integers >= 0)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _is_union_tag(part: object) -> bool:
    """pydantic names a union member in an error location: ``str``, ``list[int]``, ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part or "-" in part)


def validation_error_to_request_error(exc: ValidationError) -> RequestError:
    """The first pydantic error as a RequestError whose param is the top-level field."""
    first = exc.errors(include_url=False)[0]
    loc = list(first.get("loc", ()))
    param = str(loc[0]) if loc else None
    tag_at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag_at is not None:
        field_loc = [str(part) for part in loc[:tag_at]]
        hint = _UNION_HINTS.get(field_loc[-1] if field_loc else "", "one of the documented types")
        return RequestError(f"{'.'.join(field_loc) or 'body'}: must be {hint}", param=param)
    where = ".".join(str(part) for part in loc) if loc else "body"
    message = first.get("msg", "invalid value")
    if first.get("type") != "missing" and "input" in first:
        message += f", got {_shown(first['input'])}"
    return RequestError(f"{where}: {message}", param=param)


def parse_request(model: type[BaseModel], body: Any) -> BaseModel:
    """Validates a decoded JSON body; raises RequestError (never ValidationError)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_request_error(exc) from None


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------
#
# Types are strict (no "5" for 5, no true for 1) and ranged: every integer fits
# the int64 it becomes, every float is finite. Ranges that depend on the
# server (n's cap, the vocabulary) are checked by check_limits before any work.

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
# OpenAI's roles (function is its deprecated spelling of tool).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Body(BaseModel):
    """A request body: unknown fields are ignored, as OpenAI and vLLM do; types are strict.

    ``null`` for an optional field means "not given" (OpenAI's schema makes them nullable),
    so the field takes its default; a required field that is ``null`` is still an error.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            key: value for key, value in data.items()
            if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()
        }


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# A constraint and the request field it came from (errors name that field).
Constraint = tuple[StructuredOutputsParams, str]


class _SamplingRequest(_Body):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[Finite, Field(ge=0.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    n: PositiveInt = 1
    best_of: PositiveInt | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[Finite, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[Finite, Field(gt=0.0)] = 1.0
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens 'token_id:<id>' (None: the server's)
    priority: Int64 = 0  # vLLM's priority scheduling: this server is first come, first served (0 only)
    # vLLM's custom logits processors (names of server-side classes): none are loaded here, so a
    # non-empty list is refused
    logits_processors: list[Any] | None = None
    # vLLM's extra arguments for custom sampling code: SamplingParams.extra_args (read by nothing built in)
    vllm_xargs: dict[str, Any] | None = None
    request_id: str | None = None  # names the response (an X-Request-Id header wins), see response_id
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: Finite = 1.0
    cache_salt: str | None = None
    # top-k logprobs of every prompt token (-1: the whole vocabulary, past any server's limit)
    prompt_logprobs: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    # keep only the last k prompt tokens (-1: the model's context length)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The one output constraint the request asks for, if any; RequestError when several are given."""
        found = [c for c in (self._response_format_constraint(), self._extra_body_constraint(), *self._guided()) if c]
        if len(found) > 1:
            raise RequestError(
                f"{found[1][1]}: only one output constraint per request (also got {found[0][1]})", param=found[1][1]
            )
        return found[0] if found else None

    def _response_format_constraint(self) -> Constraint | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format: json_schema.schema is required for type json_schema",
                               param="response_format")
        return _constraint("response_format", json=fmt.json_schema.schema_)

    def _extra_body_constraint(self) -> Constraint | None:
        if self.structured_outputs is None:
            return None
        try:
            return StructuredOutputsParams(**self.structured_outputs), "structured_outputs"
        except TypeError as exc:
            raise RequestError(f"structured_outputs: unknown field ({exc})", param="structured_outputs") from None

    def _guided(self) -> list[Constraint]:
        fields = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
        return [
            _constraint(name, **{kind: getattr(self, name)}) for name, kind in fields.items()
            if getattr(self, name) is not None
        ]

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        """The server's caps on counts, and token ids within the vocabulary, before any work."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.use_beam_search:
            width = max(self.n, self.best_of or 0)
            if width > limits.max_beam_width:
                param = "best_of" if (self.best_of or 0) > self.n else "n"
                raise RequestError(
                    f"{param}: beam search with {width} beams exceeds the server's limit of "
                    f"{limits.max_beam_width}", param=param,
                )
        else:
            for name in ("n", "best_of"):
                value = getattr(self, name)
                if value is not None and value > limits.max_n:
                    raise RequestError(
                        f"{name}: must be <= {limits.max_n} (the server's limit on samples per prompt), "
                        f"got {value}", param=name,
                    )
        check_at_most("stop", len(stop), limits.max_stop, "stop strings")
        longest = max((len(s) for s in stop), default=0)
        if longest > limits.max_stop_chars:
            raise RequestError(
                f"stop: each stop string may have at most {limits.max_stop_chars} characters, got {longest}",
                param="stop",
            )
        if self.stop_token_ids:
            check_at_most("stop_token_ids", len(self.stop_token_ids), limits.max_stop_token_ids, "stop token ids")
            check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if self.logit_bias:
            check_at_most("logit_bias", len(self.logit_bias), limits.max_logit_bias, "logit_bias entries")
            check_token_ids(self._logit_bias() or {}, vocab_size, "logit_bias")
        check_sampling_lists(self.allowed_token_ids, self.bad_words, limits, vocab_size)
        self._check_vllm_xargs()
        if self.logits_processors:
            raise RequestError(
                "logits_processors: this server loads no custom logits processors; leave the field out "
                "(sampling fields such as logit_bias, allowed_token_ids and bad_words are built in)",
                param="logits_processors",
            )
        if self.priority != 0:
            raise RequestError(
                f"priority: this server schedules first come, first served (no priority scheduling policy); "
                f"send 0 or leave it out, got {self.priority}", param="priority",
            )
        self._check_prompt_logprobs(limits)

    def _check_vllm_xargs(self) -> None:
        """vllm_xargs become SamplingParams.extra_args: checked as that field is, errors naming vllm_xargs."""
        try:
            check_extra_args(self.vllm_xargs)
        except RequestError as exc:
            raise RequestError(str(exc).replace("extra_args", "vllm_xargs", 1), param="vllm_xargs") from None

    def _check_prompt_logprobs(self, limits: RequestLimits) -> None:
        """vLLM's rules (not with a stream unless 0, -1 is the whole vocabulary) and the server's cap."""
        value = self.prompt_logprobs
        if value is None:
            return
        if self.stream and value != 0:
            raise RequestError("prompt_logprobs: not available when stream is true", param="prompt_logprobs")
        if self.use_beam_search:
            raise RequestError("prompt_logprobs: not available with use_beam_search", param="prompt_logprobs")
        if value == -1 or value > limits.max_logprobs:
            shown = "-1 (the whole vocabulary)" if value == -1 else str(value)
            raise RequestError(
                f"prompt_logprobs: must be in [0, {limits.max_logprobs}] (the server's limit on logprobs per "
                f"position), got {shown}", param="prompt_logprobs",
            )

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (the last ones), or None to keep all."""
        return prompt_tokens_kept(self.truncate_prompt_tokens, max_model_len)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        return {parse_token_id_key(token, "logit_bias"): float(bias) for token, bias in self.logit_bias.items()}

    def _build_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams | BeamSearchParams:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
        constraint = self.constraint()
        structured = constraint[0] if constraint else None
        if self.use_beam_search:
            return self._beam_params(max_tokens, structured)
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured,
            extra_args=self.vllm_xargs,
        )

    def _beam_params(self, max_tokens: int, structured: StructuredOutputsParams | None) -> BeamSearchParams:
        if self.n < 1:
            raise RequestError(f"n: must be an integer >= 1, got {self.n}", param="n")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of: must be >= n ({self.n}), got {self.best_of}", param="best_of")
        if self.stop:
            raise RequestError("stop strings are not supported with beam search", param="stop")
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name):
                raise RequestError(f"{name}: not supported with beam search", param=name)
        return BeamSearchParams(
            beam_width=max(self.n, self.best_of or 0),
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=0.0 if self.temperature is None else self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=list(self.stop_token_ids or []),
            structured_outputs=structured,
            skip_special_tokens=self.skip_special_tokens,
        )


def _constraint(field: str, **kwargs) -> Constraint:
    """StructuredOutputsParams built from one request field; its errors name that field."""
    try:
        return StructuredOutputsParams(**kwargs), field
    except RequestError as exc:
        message = str(exc).split(": ", 1)[-1]
        raise RequestError(f"{field}: {message}", param=field) from None


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    echo: bool = False
    add_special_tokens: bool = True  # the tokenizer's own special tokens (a BOS, for many models) around a text prompt
    logprobs: TopLogprobs | None = None
    suffix: str | None = None

    def prompts(self, max_prompts: int | None = None) -> list[str | list[int]]:
        """The prompt as a non-empty list of single prompts (text or token ids), at most ``max_prompts``."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RequestError("prompt must not be empty", param="prompt")
        if max_prompts is not None:
            check_at_most("prompt", len(prompts), max_prompts, "prompts")
        return prompts

    def to_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams | BeamSearchParams:
        if self.suffix is not None:
            raise RequestError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", param="logprobs")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        check_max_tokens(max_tokens)
        check_context_length(num_prompt_tokens, max_tokens, max_model_len, prompt_param="prompt")
        # echo shows the prompt's logprobs too; the engine computes the larger count once
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return self._build_params(max_tokens, self.logprobs, max(wanted) if wanted else None)


class ChatMessageParam(BaseModel):
    """One message; fields beyond these (tool calls, ...) are kept for the chat template.

    :func:`pagedllm.chat.check_messages` checks what each role requires, as OpenAI does.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


def message_dicts(messages: Sequence[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as the client sent them (an explicit null kept, so the check can tell it
    from a missing field), checked by role with :func:`pagedllm.chat.check_messages`."""
    dicts = [m.model_dump(exclude_unset=True) for m in messages]
    check_messages(dicts)
    return dicts


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own special tokens around the rendered chat
    chat_template: str | None = None  # Jinja text for this request: only where --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    documents: list[dict[str, str]] | None = None  # retrieval results the chat template renders
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_specs(self) -> list[ToolSpec]:
        return parse_tools(self.tools)

    def resolved_tool_choice(self) -> ToolChoice:
        return resolve_tool_choice(self.tool_specs(), self.tool_choice)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none when tool_choice is 'none')."""
        return self.tools if self.tools and self.resolved_tool_choice().mode != "none" else None

    def constraint(self) -> Constraint | None:
        """response_format / structured_outputs, or the grammar a required or named tool_choice implies."""
        base = super().constraint()
        tools = tool_constraint(self.tool_specs(), self.resolved_tool_choice())
        if tools is None:
            return base
        if base is not None:
            raise RequestError(f"tool_choice: a required or named tool_choice cannot be combined with {base[1]}",
                               param="tool_choice")
        return tools, "tool_choice"

    def message_dicts(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise RequestError("continue_final_message: set add_generation_prompt to false with it "
                                   "(the model continues the last message instead of starting a new one)",
                                   param="continue_final_message")
            if self.messages[-1].role != "assistant" or not self.messages[-1].content:
                raise RequestError("continue_final_message: the last message must be an assistant message "
                                   "with content to continue", param="continue_final_message")
        return message_dicts(self.messages)

    def to_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams | BeamSearchParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(
                    f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                    param="top_logprobs",
                )
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if requested is None:
            remaining = max_model_len - num_prompt_tokens
            if remaining < 1:
                check_context_length(num_prompt_tokens, 1, max_model_len, prompt_param="messages")
            max_tokens = min(remaining, DEFAULT_CHAT_MAX_TOKENS_CAP)
        else:
            max_tokens = requested
            check_max_tokens(max_tokens, param)
            check_context_length(num_prompt_tokens, max_tokens, max_model_len, prompt_param="messages", max_tokens_param=param)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._build_params(max_tokens, logprobs, self.prompt_logprobs)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None  # with messages, as on /v1/chat/completions
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as on /v1/chat/completions
    documents: list[dict[str, str]] | None = None  # with messages, as on /v1/chat/completions


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# The request bodies of each route, for the OpenAPI document.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def check_max_tokens(max_tokens: int, param: str = "max_tokens") -> None:
    if max_tokens < 1:
        raise RequestError(f"{param}: must be an integer >= 1, got {max_tokens}", param=param)


def check_context_length(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    *,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
) -> None:
    """Prompt plus completion must fit the context; the message states all three numbers."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return
    param = prompt_param if num_prompt_tokens >= max_model_len else max_tokens_param
    raise RequestError(
        f"this model's maximum context length is {max_model_len} tokens, but the request needs "
        f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt + {max_tokens} for "
        f"{max_tokens_param}); shorten the prompt or lower {max_tokens_param}",
        param=param,
    )


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """vLLM's Logprob as it serializes it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, the first None, then token id -> Logprob
PromptLogprobs = list[dict[str, PromptLogprobEntry] | None]


def _drop_if_none(data: dict, *keys: str) -> dict:
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only when asked for (vLLM's field)

    @model_serializer(mode="wrap")
    def _drop_no_prompt_logprobs(self, handler):
        return _drop_if_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallObject(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCallObject):
    index: int


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallObject] | None = None  # left out of the JSON when there are none

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only when asked for (vLLM's field, one list for the prompt)

    @model_serializer(mode="wrap")
    def _drop_no_prompt_logprobs(self, handler):
        return _drop_if_none(handler(self), "prompt_logprobs")


class DeltaMessage(BaseModel):
    """A streamed message fragment; unset fields are left out, as in OpenAI's chunks."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------
# RequestOutput -> response pieces
# ---------------------------------------------------------------------------


def usage_for(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per prompt; completion tokens sum over returned samples."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def returned_completions(output: RequestOutput, n: int) -> list[CompletionOutput]:
    """The n samples the client asked for (best_of and beam search produce more)."""
    completions = sorted(output.outputs, key=lambda c: c.index)
    return completions[:n]


def _chosen_logprob(position: PositionLogprobs, token_id: int) -> float | None:
    entry = position.get(token_id)
    return entry.logprob if entry is not None else None


def _top_entries(position: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely entries at one position, best first."""
    ranked = sorted(
        position.items(),
        key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob),
    )
    return [(token_id, lp.logprob) for token_id, lp in ranked[:num_top]]


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[PositionLogprobs | None] | None,
    num_top: int,
    token_text: TokenText,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """The legacy completions logprobs object for ``token_ids``; offsets start at ``text_offset``."""
    result = CompletionLogprobs()
    offset = text_offset
    for i, token_id in enumerate(token_ids):
        text = token_text(token_id)
        position = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_chosen_logprob(position, token_id))
        top: dict[str, float] = {}
        for top_id, logprob in _top_entries(position, num_top):
            top.setdefault(token_text(top_id), logprob)
        result.top_logprobs.append(top)
    return result


def prompt_logprobs_for(
    token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs | None] | None, num_top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the token itself and
    the ``num_top`` most likely ones, as token id -> {logprob, rank, decoded_token}."""
    result: PromptLogprobs = []
    for i, token_id in enumerate(token_ids):
        position = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        if position is None:
            result.append(None)
            continue
        result.append({
            str(top_id): PromptLogprobEntry(
                logprob=max(entry.logprob, _MISSING_LOGPROB), rank=entry.rank, decoded_token=entry.decoded_token
            )
            for top_id, entry in position.items()
            if top_id == token_id or (entry.rank is not None and entry.rank <= num_top)
        })
    return result


def merge_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[PositionLogprobs | None] | None,
    num_top: int,
    token_text: TokenText,
) -> ChatLogprobs:
    content = []
    for i, token_id in enumerate(token_ids):
        position = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        text = token_text(token_id)
        chosen = _chosen_logprob(position, token_id) if position else None
        top = [
            ChatTopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode("utf-8")))
            for t, lp in (_top_entries(position, num_top) if position else [])
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=chosen if chosen is not None else _MISSING_LOGPROB,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


