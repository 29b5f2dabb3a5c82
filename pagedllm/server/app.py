"""The OpenAI-compatible HTTP API over an :class:`AsyncLLMEngine`.

Every failure leaves as OpenAI's error object ``{"error": {message, type,
param, code}}`` with the matching status (400 bad request, 401 bad key, 404
unknown model, 503 queue full or shutting down, 500 anything unexpected), so
the official client raises its usual exception classes. Streams are
server-sent events ending in ``data: [DONE]``; when the client goes away the
request is aborted and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import pagedllm
from pagedllm.chat import template_kwargs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineOverloadedError, RequestStream
from pagedllm.errors import EngineDeadError, PagedLLMError, RequestError
from pagedllm.limits import RequestLimits, ServerLimits, check_text, check_token_ids
from pagedllm.outputs import DeltaTracker, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.server import protocol as p
from pagedllm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.structured.compile_guard import CompileLimits
from pagedllm.structured.tools import ToolCall, held_back_len, parse_tool_calls
from pagedllm.structured.tools import calls_from_constrained as _calls_from_constrained

logger = logging.getLogger("pagedllm.server")

# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def _error_response(status: int, message: str, type: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _error_for(exc: BaseException) -> APIError:
    """Maps any exception to the APIError the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), type="invalid_request_error", param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="service_unavailable_error", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")


# Request fields a model's generation config may default (SamplingParams names).
_REQUEST_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class CorsSettings:
    """CORS as vLLM's --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class _Prompt:
    """One prompt as submitted: its text (for echo) and token ids."""

    text: str
    token_ids: list[int]


def _token_id_text(token_id: int) -> str:
    """A token as return_tokens_as_token_ids names it."""
    return f"token_id:{token_id}"


class OpenAIServer:
    """The request handlers; holds the engine and the per-app configuration."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        metrics: ServerMetrics,
        limits: ServerLimits,
        chat_template: str | None = None,
        default_sampling: dict | None = None,
        return_tokens_as_token_ids: bool = False,
        response_role: str = "assistant",
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template  # a request may bring its own
        self.response_role = response_role  # the role of chat responses (--response-role)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # a request's own field overrides it
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.limits = limits
        compiler = getattr(engine, "grammar_compiler", None)  # an engine without grammars has none
        if compiler is not None:
            compiler.set_compile_limits(
                CompileLimits(limits.grammar_compile_timeout_s, limits.grammar_compile_memory_bytes))
        self.request_limits: RequestLimits = getattr(engine.engine, "limits", None) or RequestLimits()
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.chat_template = chat_template  # Jinja text that replaces the model's, or None
        # SamplingParams defaults for fields a request leaves unset (--generation-config).
        self.default_sampling = {k: v for k, v in (default_sampling or {}).items() if k in _REQUEST_DEFAULTS}

    def with_default_sampling(self, req: p._SamplingRequest) -> p._SamplingRequest:
        """``req`` with the model's default sampling parameters where it sets none."""
        for name, value in self.default_sampling.items():
            if name not in req.model_fields_set:
                setattr(req, name, value)
        return req

    async def read_body(self, request: Request, model: type[BaseModel]):
        """The request body, read within the size and time limits, checked and parsed into ``model``."""
        body = await _read_json(request, self.limits)
        return p.parse_request(model, body)

    # -- helpers -----------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is None or model in (self.served_model_name, self.engine.model_name):
            return
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{self.served_model_name}`",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )

    def token_text_for(self, req: p._SamplingRequest):
        """How ``req``'s logprobs name tokens: 'token_id:<id>' (return_tokens_as_token_ids, the
        request's or else the server's) or the token's text."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.return_tokens_as_token_ids
        return _token_id_text if as_ids else self.token_text

    def token_text(self, token_id: int) -> str:
        piece = getattr(self.tokenizer, "id_to_piece", None)
        if piece is not None:
            return piece(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def tokenize_prompt(self, prompt: str | list[int], keep: int | None = None, add_special_tokens: bool = True) -> _Prompt:
        """The prompt's text and token ids; with ``keep`` only its last ``keep`` tokens (whose text
        is then what echo shows). ``add_special_tokens``: the tokenizer's own (a BOS, for many models)
        around a text prompt."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if not token_ids:
                raise RequestError(f"prompt: {prompt[:40]!r} has no tokens for this model's tokenizer; "
                                   "give some text", param="prompt")
            if keep is not None and len(token_ids) > keep:
                return self.truncated(token_ids, keep)
            return _Prompt(prompt, token_ids)
        if keep is not None:
            prompt = prompt[-keep:]
        if len(prompt) >= self.engine.max_model_len:  # refuse before decoding it
            p.check_context_length(len(prompt), 1, self.engine.max_model_len, prompt_param="prompt")
        check_token_ids(prompt, self.vocab_size, "prompt")
        return _Prompt(self.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt))

    def truncated(self, token_ids: list[int], keep: int) -> _Prompt:
        """The last ``keep`` of ``token_ids``, with their text."""
        kept = token_ids[-keep:]
        return _Prompt(self.tokenizer.decode(kept, skip_special_tokens=False), kept)

    def chat_prompt(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
        continue_final: bool = False, template_vars: dict | None = None, add_special_tokens: bool = False,
        request_template: str | None = None, documents: list[dict] | None = None,
    ) -> _Prompt:
        """The rendered conversation; with ``continue_final`` it ends inside the last (assistant)
        message, right after its content, so the model carries on with that message.
        ``template_vars`` (checked by ``chat.template_kwargs``) are the template's extra variables."""
        extra = dict(template_vars or {})
        if request_template is not None:
            if not self.trust_request_chat_template:
                raise RequestError("chat_template: this server renders chats with its own template only; "
                                   "leave chat_template out (a server started with --trust-request-chat-template "
                                   "takes one)", param="chat_template")
            extra["chat_template"] = request_template
        elif self.chat_template is not None:
            extra["chat_template"] = self.chat_template
        if tools:
            extra["tools"] = tools
        if documents:
            extra["documents"] = documents
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        if continue_final:
            text = _cut_after_final_message(text, messages[-1])
        return _Prompt(text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def compile_constraint(self, req: p.CompletionRequest | p.ChatCompletionRequest) -> str | None:
        """Compiles the request's grammar off the event loop (the engine then finds it cached),
        so a bad schema, regex or grammar is a 400 naming the field it came from; returns that
        field (None without a grammar), which a grammar's dead end is reported against too."""
        constraint = req.constraint()
        if constraint is None:
            return None
        params, field = constraint
        param = params.param if field == "structured_outputs" else field
        await asyncio.to_thread(self.engine.grammar_compiler.compile, params, param)
        return param

    async def submit(
        self,
        base_id: str,
        prompts: Sequence[_Prompt],
        params: Sequence[SamplingParams | BeamSearchParams],
        cache_salt: str | None,
    ) -> list[RequestStream]:
        """Adds every prompt; on any failure the accepted ones are aborted and the error raised."""
        results = await asyncio.gather(
            *(
                self.engine.add_request(f"{base_id}-{i}", {"prompt_token_ids": prompt.token_ids}, sp, cache_salt)
                for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
            ),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in streams:
                stream.close()
            raise errors[0]
        return streams

    # -- /v1/completions -----------------------------------------------------------
    async def create_completion(self, request: Request) -> Response:
        req = self.with_default_sampling(await self.read_body(request, p.CompletionRequest))
        self.check_model(req.model)
        req.check_limits(self.request_limits, self.vocab_size)
        keep = req.prompt_tokens_kept(self.engine.max_model_len)
        prompts = [self.tokenize_prompt(prompt, keep, req.add_special_tokens)
                   for prompt in req.prompts(self.limits.max_prompts)]
        params = [req.to_params(len(prompt.token_ids), self.engine.max_model_len) for prompt in prompts]
        grammar_param = await self.compile_constraint(req)
        response_id = p.response_id("cmpl", req.request_id, request.headers.get("x-request-id"))
        streams = await self.submit(response_id, prompts, params, req.cache_salt)
        if req.stream:
            events = self._completion_events(req, response_id, prompts, streams, grammar_param)
            return _sse_response(events, streams, self.limits, response_id)
        finals = await _collect(streams, request, self.limits.request_timeout_s, req.n, grammar_param)
        return JSONResponse(self._completion_response(req, response_id, prompts, finals).model_dump())

    def _completion_choice_logprobs(
        self, req: p.CompletionRequest, prompt: _Prompt, final: RequestOutput, completion, with_prompt: bool
    ) -> p.CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        generated_offset = len(prompt.text) if with_prompt else 0
        generated = p.completion_logprobs(
            completion.token_ids, completion.logprobs, req.logprobs, self.token_text_for(req), generated_offset
        )
        if not with_prompt:
            return generated
        prompt_part = p.completion_logprobs(
            prompt.token_ids, final.prompt_logprobs, req.logprobs, self.token_text_for(req), 0
        )
        return p.merge_completion_logprobs(prompt_part, generated)

    def _completion_response(
        self, req: p.CompletionRequest, response_id: str, prompts: list[_Prompt], finals: list[RequestOutput]
    ) -> p.CompletionResponse:
        choices = []
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for completion in p.returned_completions(final, req.n):
                text = prompt.text + completion.text if req.echo else completion.text
                choices.append(
                    p.CompletionChoice(
                        index=prompt_index * req.n + completion.index,
                        text=text,
                        logprobs=self._completion_choice_logprobs(req, prompt, final, completion, req.echo),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(req, prompt, final),
                    )
                )
        return p.CompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=p.usage_for(finals)
        )

    async def _completion_events(
        self, req: p.CompletionRequest, response_id: str, prompts: list[_Prompt], streams: list[RequestStream],
        grammar_param: str | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        trackers: dict[int, DeltaTracker] = {}
        finished: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in _merge(streams):
            _raise_if_failed(output, req.n, grammar_param)
            finals[prompt_index] = output
            prompt = prompts[prompt_index]
            for completion in p.returned_completions(output, req.n):
                index = prompt_index * req.n + completion.index
                if index in finished:
                    continue
                first = index not in trackers
                tracker = trackers.setdefault(index, DeltaTracker())
                text, start, end = tracker.take(completion)
                logprobs = None
                if req.logprobs is not None:
                    offset = tracker.num_chars - len(text) + (len(prompt.text) if req.echo else 0)
                    logprobs = p.completion_logprobs(
                        completion.token_ids[start:end],
                        (completion.logprobs or [])[start:end],
                        req.logprobs,
                        self.token_text_for(req),
                        offset,
                    )
                if req.echo and first:
                    text = prompt.text + text
                    if logprobs is not None:
                        prompt_part = p.completion_logprobs(
                            prompt.token_ids, output.prompt_logprobs, req.logprobs, self.token_text_for(req), 0
                        )
                        logprobs = p.merge_completion_logprobs(prompt_part, logprobs)
                if completion.finish_reason is not None:
                    finished.add(index)
                elif not text and start == end:
                    continue
                chunk = p.CompletionChunk(
                    id=response_id,
                    created=created,
                    model=self.served_model_name,
                    choices=[
                        p.CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                    ],
                )
                yield _sse(chunk)
        if req.include_usage_in_stream:
            usage = p.usage_for([finals[i] for i in sorted(finals)])
            yield _sse(p.CompletionChunk(id=response_id, created=created, model=self.served_model_name, choices=[], usage=usage))

    # -- /v1/chat/completions ------------------------------------------------------------
    async def create_chat_completion(self, request: Request) -> Response:
        req = self.with_default_sampling(await self.read_body(request, p.ChatCompletionRequest))
        self.check_model(req.model)
        req.check_limits(self.request_limits, self.vocab_size)
        prompt = self.chat_prompt(req.message_dicts(), req.add_generation_prompt, req.template_tools(),
                                  continue_final=req.continue_final_message,
                                  template_vars=template_kwargs(req.chat_template_kwargs),
                                  add_special_tokens=req.add_special_tokens, request_template=req.chat_template,
                                  documents=req.documents)
        keep = req.prompt_tokens_kept(self.engine.max_model_len)
        if keep is not None and len(prompt.token_ids) > keep:
            prompt = self.truncated(prompt.token_ids, keep)
        params = req.to_params(len(prompt.token_ids), self.engine.max_model_len)
        grammar_param = await self.compile_constraint(req)
        response_id = p.response_id("chatcmpl", req.request_id, request.headers.get("x-request-id"))
        streams = await self.submit(response_id, [prompt], [params], req.cache_salt)
        if req.stream and req.resolved_tool_choice().mode != "none":
            return _sse_response(self._chat_tool_events(req, response_id, streams[0], grammar_param), streams,
                                 self.limits, response_id)
        if req.stream:
            return _sse_response(self._chat_events(req, response_id, streams[0], grammar_param), streams, self.limits,
                                 response_id)
        (final,) = await _collect(streams, request, self.limits.request_timeout_s, req.n, grammar_param)
        response = self._chat_response(req, response_id, final)
        response.prompt_logprobs = self._prompt_logprobs(req, prompt, final)
        return JSONResponse(response.model_dump())

    @staticmethod
    def _prompt_logprobs(
        req: p.CompletionRequest | p.ChatCompletionRequest, prompt: _Prompt, final: RequestOutput
    ) -> p.PromptLogprobs | None:
        if req.prompt_logprobs is None:
            return None
        return p.prompt_logprobs_for(prompt.token_ids, final.prompt_logprobs, req.prompt_logprobs)

    def _chat_logprobs(self, req: p.ChatCompletionRequest, token_ids, logprobs) -> p.ChatLogprobs | None:
        if not req.logprobs:
            return None
        return p.chat_logprobs(token_ids, logprobs, req.top_logprobs or 0, self.token_text_for(req))

    def _chat_response(self, req: p.ChatCompletionRequest, response_id: str, final: RequestOutput) -> p.ChatCompletionResponse:
        choices = []
        for completion in p.returned_completions(final, req.n):
            content, calls = _tool_output(req, completion.text)
            choices.append(p.ChatChoice(
                index=completion.index,
                message=p.ChatMessage(role=self.response_role, content=content,
                                      tool_calls=[_tool_call_object(c) for c in calls] if calls else None),
                logprobs=self._chat_logprobs(req, completion.token_ids, completion.logprobs),
                finish_reason="tool_calls" if calls else completion.finish_reason,
                stop_reason=completion.stop_reason,
            ))
        return p.ChatCompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=p.usage_for([final])
        )

    async def _chat_events(
        self, req: p.ChatCompletionRequest, response_id: str, stream: RequestStream, grammar_param: str | None = None
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> str:
            return _sse(p.ChatCompletionChunk(
                id=response_id, created=created, model=self.served_model_name, choices=choices, usage=usage
            ))

        trackers: dict[int, DeltaTracker] = {}
        finished: set[int] = set()
        final: RequestOutput | None = None
        async for _, output in _merge([stream]):
            _raise_if_failed(output, req.n, grammar_param)
            final = output
            for completion in p.returned_completions(output, req.n):
                index = completion.index
                if index in finished:
                    continue
                if index not in trackers:
                    trackers[index] = DeltaTracker()
                    role = p.DeltaMessage(role=self.response_role, content="")
                    yield chunk([p.ChatStreamChoice(index=index, delta=role)])
                text, start, end = trackers[index].take(completion)
                if completion.finish_reason is not None:
                    finished.add(index)
                elif not text and start == end:
                    continue
                logprobs = self._chat_logprobs(
                    req, completion.token_ids[start:end], (completion.logprobs or [])[start:end]
                )
                delta = p.DeltaMessage(content=text) if text or completion.finish_reason is None else p.DeltaMessage()
                yield chunk([
                    p.ChatStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                ])
        if req.include_usage_in_stream and final is not None:
            yield chunk([], usage=p.usage_for([final]))

    async def _chat_tool_events(
        self, req: p.ChatCompletionRequest, response_id: str, stream: RequestStream, grammar_param: str | None = None
    ) -> AsyncIterator[str]:
        """Streamed chat when tools may be called: text that may be a call is held back until the
        end, then sent as one ``delta.tool_calls`` (or as content when it held no call)."""
        created = int(time.time())
        mode = req.resolved_tool_choice().mode

        def chunk(choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> str:
            return _sse(p.ChatCompletionChunk(
                id=response_id, created=created, model=self.served_model_name, choices=choices, usage=usage
            ))

        num_sent: dict[int, int] = {}  # choice index -> characters of content sent
        final: RequestOutput | None = None
        async for _, output in _merge([stream]):
            _raise_if_failed(output, req.n, grammar_param)
            final = output
            for completion in p.returned_completions(output, req.n):
                index, text = completion.index, completion.text
                if index not in num_sent:
                    num_sent[index] = 0
                    yield chunk([p.ChatStreamChoice(index=index, delta=p.DeltaMessage(role=self.response_role, content=""))])
                elif num_sent[index] < 0:
                    continue  # finished
                if completion.finish_reason is None:
                    safe = text[: len(text) - held_back_len(text)] if mode == "auto" else ""
                    if len(safe) > num_sent[index]:
                        yield chunk([p.ChatStreamChoice(index=index, delta=p.DeltaMessage(content=safe[num_sent[index]:]))])
                        num_sent[index] = len(safe)
                    continue
                content, calls = _tool_output(req, text)
                if calls:
                    delta = p.DeltaMessage(tool_calls=[
                        p.DeltaToolCall(index=i, **_tool_call_object(c).model_dump()) for i, c in enumerate(calls)
                    ])
                else:
                    delta = p.DeltaMessage(content=text[num_sent[index]:] or None)
                num_sent[index] = -1
                yield chunk([p.ChatStreamChoice(
                    index=index, delta=delta, finish_reason="tool_calls" if calls else completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )])
        if req.include_usage_in_stream and final is not None:
            yield chunk([], usage=p.usage_for([final]))

    # -- small endpoints ----------------------------------------------------------------
    def models(self) -> p.ModelList:
        card = p.ModelCard(
            id=self.served_model_name,
            created=self.created,
            root=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
        )
        return p.ModelList(data=[card])

    async def tokenize(self, request: Request) -> p.TokenizeResponse:
        req = await self.read_body(request, p.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            messages = p.message_dicts(req.messages)
            tokens = self.chat_prompt(messages, req.add_generation_prompt,
                                      template_vars=template_kwargs(req.chat_template_kwargs),
                                      request_template=req.chat_template, documents=req.documents).token_ids
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return p.TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    async def detokenize(self, request: Request) -> p.DetokenizeResponse:
        req = await self.read_body(request, p.DetokenizeRequest)
        self.check_model(req.model)
        check_token_ids(req.tokens, self.vocab_size, "tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))


def build_app(
    engine: AsyncLLMEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting: int | None = None,
    chat_template: str | None = None,
    default_sampling: dict | None = None,
    cors: CorsSettings | None = None,
    limits: ServerLimits | None = None,
    dashboard: bool = True,
    return_tokens_as_token_ids: bool = False,
    response_role: str = "assistant",
    docs: bool = True,
    trust_request_chat_template: bool = False,
    request_id_headers: bool = False,
) -> FastAPI:
    """The FastAPI app; ``api_key`` guards /v1/* and /dashboard (health, metrics and version stay open).

    ``chat_template`` (Jinja text) replaces the model's; ``default_sampling``
    holds SamplingParams defaults for fields a request leaves unset; ``cors``
    turns on CORS headers (none are sent without it). ``limits`` bounds what one
    client may send and hold (``ServerLimits()`` when None); the limits on
    request parameters are the engine's (``LLMEngine.limits``). ``dashboard``
    serves the live KV-cache map at /dashboard. ``return_tokens_as_token_ids``: logprobs
    name tokens 'token_id:<id>' unless a request says otherwise. ``response_role``: the role
    of chat responses. ``docs``: serve /docs, /redoc and /openapi.json.
    ``trust_request_chat_template``: a chat request's own chat_template is rendered (refused
    otherwise: a template is code the server runs). ``request_id_headers``: every response
    carries X-Request-Id (the request's, or a new one).
    """
    if max_waiting is not None:
        engine.set_max_waiting(max_waiting)
    metrics = ServerMetrics(engine.get_stats, engine.model_name)
    engine.set_observer(metrics)
    server = OpenAIServer(
        engine, served_model_name or engine.model_name, metrics, limits or ServerLimits(),
        chat_template=chat_template, default_sampling=default_sampling,
        return_tokens_as_token_ids=return_tokens_as_token_ids, response_role=response_role,
        trust_request_chat_template=trust_request_chat_template,
    )

    _install_uvicorn_log_filter()
    hidden = {"docs_url": None, "redoc_url": None, "openapi_url": None} if not docs else {}
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, **hidden)
    app.openapi = functools.partial(_openapi_with_request_bodies, app)
    app.state.server = server
    if request_id_headers:
        _add_request_id_headers(app)
    _install_error_handlers(app)
    if cors is not None:
        _add_cors(app, cors)
    _add_api_routes(app, server, api_key)
    _add_service_routes(app, engine, metrics)
    _add_token_routes(app, server)
    if dashboard:
        _add_dashboard(app, engine, api_key, metrics)
    return app


def _add_dashboard(app: FastAPI, engine: AsyncLLMEngine, api_key: str | None, metrics: ServerMetrics) -> None:
    """The live KV-cache map at /dashboard, behind the same API key as /v1."""
    from pagedllm.server.dashboard import install_dashboard

    install_dashboard(app, engine, api_key, unauthorized=lambda: _error_response(
        401, "missing or invalid API key; send 'Authorization: Bearer <key>' or open /dashboard?api_key=<key>",
        "invalid_request_error", code="invalid_api_key",
    ), registry=metrics.registry)


def _add_request_id_headers(app: FastAPI) -> None:
    """X-Request-Id on every response: the request's own header when it sent one, else a new id."""

    @app.middleware("http")
    async def request_id_header(request: Request, call_next):
        response = await call_next(request)
        response.headers["X-Request-Id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
        return response


def _add_cors(app: FastAPI, cors: CorsSettings) -> None:
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.allowed_origins),
        allow_methods=list(cors.allowed_methods),
        allow_headers=list(cors.allowed_headers),
        allow_credentials=cors.allow_credentials,
    )


def _add_api_routes(app: FastAPI, server: OpenAIServer, api_key: str | None) -> None:
    """/v1/completions, /v1/chat/completions and /v1/models, behind the API key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])
    v1.add_api_route("/completions", _guarded(server.create_completion), methods=["POST"])
    v1.add_api_route("/chat/completions", _guarded(server.create_chat_completion), methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"], response_model=p.ModelList)
    v1.add_api_route("/models", server.models, methods=["HEAD"], include_in_schema=False)
    app.include_router(v1)


def _add_token_routes(app: FastAPI, server: OpenAIServer) -> None:
    """/tokenize and /detokenize (outside /v1: no API key)."""
    app.add_api_route("/tokenize", _guarded(server.tokenize), methods=["POST"], response_model=p.TokenizeResponse)
    app.add_api_route("/detokenize", _guarded(server.detokenize), methods=["POST"], response_model=p.DetokenizeResponse)


def _api_key_check(api_key: str | None):
    """The dependency that refuses a request without ``Authorization: Bearer <api_key>`` (none: all pass)."""

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key; send it as 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    return require_api_key


def _add_service_routes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
    """/health, /version and /metrics (open without the API key), each with GET and HEAD."""

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error_response(503, "the engine is not running", "service_unavailable_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # HEAD wherever GET is served (load balancers probe with it); left out of the OpenAPI document.
    for path, endpoint in (("/health", health), ("/version", version), ("/metrics", prometheus_metrics)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)


def _cut_after_final_message(text: str, final: dict) -> str:
    """``text`` (a rendered conversation) up to the end of the final message's content."""
    content = final.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    at = text.rfind(content) if content else -1
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not show the final message's "
                           "content, so there is nothing to continue", param="continue_final_message")
    return text[: at + len(content)]


def _tool_output(req: p.ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """(message content, tool calls) of one finished chat completion under the request's tool_choice."""
    if not req.tools:
        return text, []
    choice = req.resolved_tool_choice()
    if choice.mode in ("named", "required"):
        calls = _calls_from_constrained(text, choice)
        return (None, calls) if calls else (text, [])
    if choice.mode == "auto":
        return parse_tool_calls(text, req.tool_specs())
    return text, []


def _tool_call_object(call: ToolCall) -> p.ToolCallObject:
    return p.ToolCallObject(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))


def _openapi_with_request_bodies(app: FastAPI) -> dict:
    """FastAPI's document, with the JSON body of each POST route that parses its own body."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    ref = "#/components/schemas/{model}"
    for path, model in p.REQUEST_BODIES.items():
        operation = document.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(ref_template=ref, mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": ref.format(model=model.__name__)}}},
        }
        operation.setdefault("responses", {})["400"] = {
            "description": "Invalid request",
            "content": {"application/json": {"schema": {"$ref": ref.format(model="ErrorResponse")}}},
        }
    error_schema = p.ErrorResponse.model_json_schema(ref_template=ref)
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    app.openapi_schema = document
    return document


def _guarded(handler: Callable[[Request], Awaitable]) -> Callable[[Request], Awaitable]:
    """Turns an unexpected exception of one request into a logged 500 for that request only."""

    @functools.wraps(handler)
    async def guarded(request: Request):
        try:
            return await handler(request)
        except (APIError, PagedLLMError):
            raise
        except Exception as exc:
            logger.exception("request to %s failed", request.url.path)
            raise _error_for(exc) from exc

    return guarded


def _install_error_handlers(app: FastAPI) -> None:
    # Specific classes are answered by Starlette's ExceptionMiddleware; only the
    # catch-all Exception handler runs in ServerErrorMiddleware, which re-raises.
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(PagedLLMError)
    async def engine_error(_: Request, exc: PagedLLMError) -> JSONResponse:
        error = _error_for(exc)
        return _error_response(error.status, error.message, error.type, error.param, error.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception) -> JSONResponse:
        error = _error_for(exc)
        if error.status >= 500 and not isinstance(exc, (EngineOverloadedError, EngineDeadError)):
            logger.exception("request to %s failed", request.url.path, exc_info=exc)
        return _error_response(error.status, error.message, error.type, error.param, error.code)


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    """The raw body; 413 as soon as it exceeds ``max_body_bytes`` (declared or sent), 408 if it is sent too slowly."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            415, f"Content-Encoding {encoding!r} is not supported; send the request body uncompressed",
            type="invalid_request_error", code="unsupported_content_encoding",
        )
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _body_too_large(size, limit)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), limits.body_read_timeout_s)
    except ClientDisconnect:  # nobody is left to answer; nothing was started for the request
        raise APIError(499, "the client closed the connection while sending the body",
                       type="invalid_request_error", code="client_closed_request") from None
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body was not received within {limits.body_read_timeout_s:g} s",
            type="invalid_request_error", code="request_timeout",
        ) from None
    return b"".join(chunks)


def _body_too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body has {size} bytes or more; this server accepts at most {limit} bytes",
        type="invalid_request_error", code="request_too_large",
    )


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


async def _read_json(request: Request, limits: ServerLimits):
    """The decoded body: strict JSON (no NaN/Infinity), no deeper than max_json_depth, valid Unicode."""
    body = await _read_body(request, limits)
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {limits.max_json_depth} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        if "integer string conversion" in str(exc):
            raise RequestError("the request body is not valid JSON: an integer has too many digits (over 4300)") from None
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    check_json_value(value, limits.max_json_depth)
    return value


def check_json_value(value: object, max_depth: int) -> None:
    """Every array/object at most ``max_depth`` deep, every string and key valid Unicode.

    Iterative, so a deep body cannot exhaust the stack; ``param`` is the top-level field.
    """
    stack: list[tuple[object, int, str | None]] = [(value, 1, None)]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, str):
            check_text(item, field or "body")
            continue
        if not isinstance(item, (list, dict)):
            continue
        if depth > max_depth:
            raise RequestError(
                f"{field or 'body'}: the request body nests deeper than {max_depth} levels", param=field
            )
        if isinstance(item, dict):
            for key, child in item.items():
                check_text(key, field or "body")
                stack.append((child, depth + 1, field if field is not None else key))
        else:
            stack.extend((child, depth + 1, field) for child in item)


def _sse(model: BaseModel | dict) -> str:
    data = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return f"data: {data}\n\n"


def _raise_if_failed(output: RequestOutput, n: int | None = None, grammar_param: str | None = None) -> None:
    """An engine failure is a 500; a returned choice whose grammar reached a dead end (nothing may
    follow its text, which is no complete match) is a 400 naming the field the grammar came from:
    the grammar admits an output it cannot finish. Streamed, both are an error event."""
    if output.error is not None:
        raise APIError(500, f"the request failed in the engine: {output.error}", type="server_error", code="engine_error")
    for completion in p.returned_completions(output, n) if n is not None else output.outputs:
        if completion.error is not None:
            param = grammar_param or "structured_outputs"
            raise APIError(400, f"{param}: {completion.error}", type="invalid_request_error", param=param,
                           code="grammar_dead_end")


def _sse_response(
    events: AsyncIterator[str], streams: list[RequestStream], limits: ServerLimits, response_id: str
) -> StreamingResponse:
    return _EventStreamResponse(
        _sse_stream(events, streams, limits.request_timeout_s),
        stall_timeout_s=limits.stream_stall_timeout_s,
        response_id=response_id,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _EventStreamResponse(StreamingResponse):
    """A stream whose client must keep reading: an event the transport cannot take within
    ``stall_timeout_s`` (the client stopped reading and the socket buffers are full) ends it.

    Only the socket buffers and one event are ever held for a client; the engine
    runs on meanwhile (the request's stream keeps only its latest output). On a
    stall the event iterator is closed, which aborts the requests and frees their
    KV blocks, and the connection is dropped.

    The stalled response cannot be completed (the final body message would wait for
    the client too), and ASGI gives an application no way to close the connection
    itself; uvicorn closes it when the application returns, logging "ASGI callable
    returned without completing response" at ERROR. The server logs the abort
    once, with the response id, at WARNING, and :class:`_DeliberateAbortFilter`
    drops uvicorn's record for exactly these responses.
    """

    def __init__(self, content: AsyncIterator[str], *, stall_timeout_s: float, response_id: str, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.response_id = response_id
        self.stalled = False

    async def __call__(self, scope, receive, send) -> None:
        # Set in the task uvicorn runs the request in, so its log record after the
        # application returns is made in this context (the streaming itself runs in a
        # child task, which sees the same response object).
        _current_stream.set(self)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        async def send_or_stall(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await super().stream_response(send_or_stall)
        except _ClientStalled:
            self.stalled = True
            logger.warning(
                "aborted stream %s: its client took no data for %.1f s; its KV blocks are freed "
                "and the connection is closed",
                self.response_id, self.stall_timeout_s,
            )
            await _aclose(self.body_iterator)


# The event stream being answered in this request's task, if any.
_current_stream: contextvars.ContextVar[_EventStreamResponse | None] = contextvars.ContextVar(
    "pagedllm_current_stream", default=None
)
# What uvicorn logs at ERROR when an application returns before the last body message.
_UNCOMPLETED_RESPONSE = "ASGI callable returned without completing response."


class _DeliberateAbortFilter(logging.Filter):
    """Drops uvicorn's "returned without completing response" record for a stream the
    server aborted on purpose (already logged with its id); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _UNCOMPLETED_RESPONSE:
            return True
        stream = _current_stream.get()
        return stream is None or not stream.stalled


_DELIBERATE_ABORT_FILTER = _DeliberateAbortFilter()


def _install_uvicorn_log_filter() -> None:
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if _DELIBERATE_ABORT_FILTER not in uvicorn_errors.filters:
        uvicorn_errors.addFilter(_DELIBERATE_ABORT_FILTER)


class _ClientStalled(Exception):
    """The client took no data for the stall timeout."""


async def _sse_stream(
    events: AsyncIterator[str], streams: list[RequestStream], timeout_s: float | None = None
) -> AsyncIterator[str]:
    """Adds the terminal ``[DONE]``, turns a failure into an error event, and aborts
    unfinished requests however the stream ends (cancellation on client disconnect included).
    Past ``timeout_s`` the stream ends with a timeout error event."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            try:
                if deadline is None:
                    event = await anext(events)
                else:
                    event = await asyncio.wait_for(anext(events), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _timeout_error(timeout_s) from None
            yield event
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        error = _error_for(exc)
        if error.status >= 500:
            logger.error("stream failed: %s", error.message)
        body = p.ErrorResponse(error=p.ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code))
        yield _sse(body)
    finally:
        for stream in streams:
            stream.close()
        await _aclose(events)
    yield "data: [DONE]\n\n"


def _timeout_error(timeout_s: float | None) -> APIError:
    return APIError(
        408, f"the request ran longer than this server's limit of {timeout_s:g} s and was aborted",
        type="invalid_request_error", code="request_timeout",
    )


async def _aclose(iterator: AsyncIterator) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(
    streams: list[RequestStream], request: Request, timeout_s: float | None = None,
    n: int | None = None, grammar_param: str | None = None,
) -> list[RequestOutput]:
    """Final output of every stream; aborts all of them if the client disconnects first
    or ``timeout_s`` passes."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def drain() -> None:
        async for index, output in _merge(streams):
            _raise_if_failed(output, n, grammar_param)  # a dead end decides the answer: stop at once
            finals[index] = output

    collector = asyncio.create_task(drain())
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():
            collector.cancel()
            if not watcher.done():
                raise _timeout_error(timeout_s)
            raise APIError(499, "the client closed the connection", type="invalid_request_error")
        collector.result()
    finally:
        watcher.cancel()
        for stream in streams:
            stream.close()
    for output in finals:
        assert output is not None, "a stream ended without a finished output"
        _raise_if_failed(output, n, grammar_param)
    return finals  # type: ignore[return-value]


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
