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
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineOverloadedError, RequestStream
from pagedllm.errors import EngineDeadError, PagedLLMError, RequestError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.server import protocol as p
from pagedllm.server.metrics import CONTENT_TYPE, ServerMetrics
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


@dataclass
class _Prompt:
    """One prompt as submitted: its text (for echo) and token ids."""

    text: str
    token_ids: list[int]


class OpenAIServer:
    """The request handlers; holds the engine and the per-app configuration."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())

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

    def token_text(self, token_id: int) -> str:
        piece = getattr(self.tokenizer, "id_to_piece", None)
        if piece is not None:
            return piece(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def tokenize_prompt(self, prompt: str | list[int]) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, self.tokenizer.encode(prompt))
        return _Prompt(self.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt))

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> _Prompt:
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return _Prompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    async def compile_constraint(self, req: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        """Compiles the request's grammar off the event loop (the engine then finds it cached),
        so a bad schema, regex or grammar is a 400 naming the field it came from."""
        constraint = req.constraint()
        if constraint is None:
            return
        params, field = constraint
        await asyncio.to_thread(self.engine.grammar_compiler.compile, params,
                                None if field == "structured_outputs" else field)

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
        req = p.parse_request(p.CompletionRequest, await _read_json(request))
        self.check_model(req.model)
        prompts = [self.tokenize_prompt(prompt) for prompt in req.prompts()]
        params = [req.to_params(len(prompt.token_ids), self.engine.max_model_len) for prompt in prompts]
        await self.compile_constraint(req)
        response_id = p.random_id("cmpl")
        streams = await self.submit(response_id, prompts, params, req.cache_salt)
        if req.stream:
            events = self._completion_events(req, response_id, prompts, streams)
            return _sse_response(events, streams)
        finals = await _collect(streams, request)
        return JSONResponse(self._completion_response(req, response_id, prompts, finals).model_dump())

    def _completion_choice_logprobs(
        self, req: p.CompletionRequest, prompt: _Prompt, final: RequestOutput, completion, with_prompt: bool
    ) -> p.CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        generated_offset = len(prompt.text) if with_prompt else 0
        generated = p.completion_logprobs(
            completion.token_ids, completion.logprobs, req.logprobs, self.token_text, generated_offset
        )
        if not with_prompt:
            return generated
        prompt_part = p.completion_logprobs(
            prompt.token_ids, final.prompt_logprobs, req.logprobs, self.token_text, 0
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
                    )
                )
        return p.CompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=p.usage_for(finals)
        )

    async def _completion_events(
        self, req: p.CompletionRequest, response_id: str, prompts: list[_Prompt], streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        trackers: dict[int, p.DeltaTracker] = {}
        finished: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in _merge(streams):
            _raise_if_failed(output)
            finals[prompt_index] = output
            prompt = prompts[prompt_index]
            for completion in p.returned_completions(output, req.n):
                index = prompt_index * req.n + completion.index
                if index in finished:
                    continue
                first = index not in trackers
                tracker = trackers.setdefault(index, p.DeltaTracker())
                text, start, end = tracker.take(completion)
                logprobs = None
                if req.logprobs is not None:
                    offset = tracker.num_chars - len(text) + (len(prompt.text) if req.echo else 0)
                    logprobs = p.completion_logprobs(
                        completion.token_ids[start:end],
                        (completion.logprobs or [])[start:end],
                        req.logprobs,
                        self.token_text,
                        offset,
                    )
                if req.echo and first:
                    text = prompt.text + text
                    if logprobs is not None:
                        prompt_part = p.completion_logprobs(
                            prompt.token_ids, output.prompt_logprobs, req.logprobs, self.token_text, 0
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
        req = p.parse_request(p.ChatCompletionRequest, await _read_json(request))
        self.check_model(req.model)
        prompt = self.chat_prompt(req.message_dicts(), req.add_generation_prompt, req.template_tools())
        params = req.to_params(len(prompt.token_ids), self.engine.max_model_len)
        await self.compile_constraint(req)
        response_id = p.random_id("chatcmpl")
        streams = await self.submit(response_id, [prompt], [params], req.cache_salt)
        if req.stream and req.resolved_tool_choice().mode != "none":
            return _sse_response(self._chat_tool_events(req, response_id, streams[0]), streams)
        if req.stream:
            return _sse_response(self._chat_events(req, response_id, streams[0]), streams)
        (final,) = await _collect(streams, request)
        return JSONResponse(self._chat_response(req, response_id, final).model_dump())

    def _chat_logprobs(self, req: p.ChatCompletionRequest, token_ids, logprobs) -> p.ChatLogprobs | None:
        if not req.logprobs:
            return None
        return p.chat_logprobs(token_ids, logprobs, req.top_logprobs or 0, self.token_text)

    def _chat_response(self, req: p.ChatCompletionRequest, response_id: str, final: RequestOutput) -> p.ChatCompletionResponse:
        choices = []
        for completion in p.returned_completions(final, req.n):
            content, calls = _tool_output(req, completion.text)
            choices.append(p.ChatChoice(
                index=completion.index,
                message=p.ChatMessage(role="assistant", content=content,
                                      tool_calls=[_tool_call_object(c) for c in calls] if calls else None),
                logprobs=self._chat_logprobs(req, completion.token_ids, completion.logprobs),
                finish_reason="tool_calls" if calls else completion.finish_reason,
                stop_reason=completion.stop_reason,
            ))
        return p.ChatCompletionResponse(
            id=response_id, model=self.served_model_name, choices=choices, usage=p.usage_for([final])
        )

    async def _chat_events(
        self, req: p.ChatCompletionRequest, response_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> str:
            return _sse(p.ChatCompletionChunk(
                id=response_id, created=created, model=self.served_model_name, choices=choices, usage=usage
            ))

        trackers: dict[int, p.DeltaTracker] = {}
        finished: set[int] = set()
        final: RequestOutput | None = None
        async for _, output in _merge([stream]):
            _raise_if_failed(output)
            final = output
            for completion in p.returned_completions(output, req.n):
                index = completion.index
                if index in finished:
                    continue
                if index not in trackers:
                    trackers[index] = p.DeltaTracker()
                    role = p.DeltaMessage(role="assistant", content="")
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
        self, req: p.ChatCompletionRequest, response_id: str, stream: RequestStream
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
            _raise_if_failed(output)
            final = output
            for completion in p.returned_completions(output, req.n):
                index, text = completion.index, completion.text
                if index not in num_sent:
                    num_sent[index] = 0
                    yield chunk([p.ChatStreamChoice(index=index, delta=p.DeltaMessage(role="assistant", content=""))])
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
        req = p.parse_request(p.TokenizeRequest, await _read_json(request))
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tokens = self.chat_prompt(messages, req.add_generation_prompt).token_ids
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return p.TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    async def detokenize(self, request: Request) -> p.DetokenizeResponse:
        req = p.parse_request(p.DetokenizeRequest, await _read_json(request))
        self.check_model(req.model)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
            raise RequestError(f"tokens must be integers in [0, {vocab})", param="tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))


def build_app(
    engine: AsyncLLMEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting: int | None = None,
) -> FastAPI:
    """The FastAPI app; ``api_key`` guards /v1/* (health, metrics and version stay open)."""
    if max_waiting is not None:
        engine.set_max_waiting(max_waiting)
    metrics = ServerMetrics(engine.get_stats, engine.model_name)
    engine.set_observer(metrics)
    server = OpenAIServer(engine, served_model_name or engine.model_name, metrics)

    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    app.state.server = server
    _install_error_handlers(app)

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

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    v1.add_api_route("/completions", _guarded(server.create_completion), methods=["POST"])
    v1.add_api_route("/chat/completions", _guarded(server.create_chat_completion), methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"], response_model=p.ModelList)
    app.include_router(v1)

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

    app.add_api_route("/tokenize", _guarded(server.tokenize), methods=["POST"], response_model=p.TokenizeResponse)
    app.add_api_route("/detokenize", _guarded(server.detokenize), methods=["POST"], response_model=p.DetokenizeResponse)
    return app


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


async def _read_json(request: Request):
    body = await request.body()
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


def _sse(model: BaseModel | dict) -> str:
    data = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return f"data: {data}\n\n"


def _raise_if_failed(output: RequestOutput) -> None:
    if output.error is not None:
        raise APIError(500, f"the request failed in the engine: {output.error}", type="server_error", code="engine_error")


def _sse_response(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    return StreamingResponse(
        _sse_stream(events, streams),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse_stream(events: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """Adds the terminal ``[DONE]``, turns a failure into an error event, and aborts
    unfinished requests however the stream ends (cancellation on client disconnect included)."""
    try:
        async for event in events:
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


async def _collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Final output of every stream; aborts all of them if the client disconnects first."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def drain() -> None:
        async for index, output in _merge(streams):
            finals[index] = output

    collector = asyncio.create_task(drain())
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():
            collector.cancel()
            raise APIError(499, "the client closed the connection", type="invalid_request_error")
        collector.result()
    finally:
        watcher.cancel()
        for stream in streams:
            stream.close()
    for output in finals:
        assert output is not None, "a stream ended without a finished output"
        _raise_if_failed(output)
    return finals  # type: ignore[return-value]


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
