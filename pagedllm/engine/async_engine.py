"""An asyncio front end for :class:`LLMEngine`.

Threading model: the synchronous engine is not thread-safe, so exactly one
thread, the *engine thread*, ever touches it. The event loop talks to that
thread through a command list guarded by a condition variable (add, abort,
stop); the engine thread applies all pending commands between two ``step()``
calls and hands every output back to the request's own event loop with
``loop.call_soon_threadsafe``. With nothing to do, the engine thread sleeps on
the condition, so an idle server burns no CPU.

Abort path: a consumer that stops iterating (client gone, task cancelled)
closes its :class:`RequestStream`, which queues an abort command; the engine
thread applies it before the next step, and ``LLMEngine.abort_request`` frees
every block of the request at once. Outputs of a step that was already running
for that request are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from pagedllm.errors import ConfigError, EngineDeadError, PagedLLMError, RequestError
from pagedllm.outputs import (
    CompletionOutput,
    OutputProgress,
    RequestMetrics,
    RequestOutput,
    delta_output,
    stream_due,
)
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.limits import RequestLimits

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 512
# Unread outputs a request's stream holds before it merges them (see RequestStream).
MAX_UNREAD_OUTPUTS = 8
# Back-off after consecutive failed steps, so a broken engine does not spin a core.
_MAX_FAILURE_BACKOFF_S = 1.0


class EngineOverloadedError(PagedLLMError):
    """The waiting queue is full, or the engine is shutting down; retry later (HTTP 503)."""


class RequestObserver(Protocol):
    """Receives per-request latencies; called on the engine thread (must be thread-safe)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float, num_tokens: int) -> None: ...

    def on_finished(self, e2e_seconds: float) -> None: ...


@dataclass
class _AddRequest:
    stream: RequestStream
    prompt: str | list[int] | dict
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between two steps (a read-only look, e.g. a snapshot)."""

    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future


@dataclass
class _Timing:
    """Per-request latency bookkeeping, engine thread only."""

    submit_time: float
    last_token_time: float | None = None
    num_tokens_per_sample: dict[int, int] = field(default_factory=dict)


class RequestStream:
    """The outputs of one request, consumed on the event loop.

    Iterating yields the engine's outputs in order. The stream holds
    ``MAX_UNREAD_OUTPUTS`` unread outputs at most: a consumer that falls a few
    steps behind (an event loop busy for a moment) still gets one output per
    step, and one that stops reading (a client that does not read its socket)
    costs that many outputs of memory, not one per engine step: the engine
    sends cumulative outputs, so once the queue is full the newest output
    replaces the newest unread one and nothing is lost, only merged. The
    request's ``output_kind`` applies as they are read: DELTA yields what is new
    since the last output read, FINAL_ONLY only the finished one (so only the
    newest is kept). Iteration ends after the output with ``finished=True``; an
    error is raised after the output that preceded it. Closing the stream
    before the end aborts the request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._loop = loop
        self._owner = owner
        self._unread: collections.deque[RequestOutput] = collections.deque()  # event loop only
        self._error: BaseException | None = None  # event loop only
        self._ready = asyncio.Event()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._closed = False
        self.finished = False
        self.submit_time = time.monotonic()
        self._last_output: RequestOutput | None = None  # engine thread only
        self.output_kind = RequestOutputKind.CUMULATIVE  # set from the params when submitted
        self._progress = OutputProgress()  # what was read so far (DELTA, stream_interval)

    # -- engine thread side ---------------------------------------------------
    def _post(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self._last_output = item
        self._call_in_loop(self._deliver, item)

    def _post_accepted(self, error: BaseException | None) -> None:
        self._call_in_loop(self._resolve_accepted, error)

    def _call_in_loop(self, fn: Callable, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _resolve_accepted(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        """On the loop: queue the output (a finished one is never followed or replaced) or keep the
        first error."""
        unread = self._unread
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif not (unread and unread[-1].finished):
            if unread and (len(unread) >= MAX_UNREAD_OUTPUTS
                           or self.output_kind == RequestOutputKind.FINAL_ONLY):
                unread.pop()  # cumulative outputs: the new one carries everything the dropped one did
            unread.append(item)
        self._ready.set()

    # -- event loop side ------------------------------------------------------
    async def wait_accepted(self) -> None:
        """Returns once the engine took the request; raises what ``add_request`` raised."""
        try:
            await self._accepted
        except BaseException:
            self.close()
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        unread = self._unread
        while True:
            while not unread and self._error is None:
                self._ready.clear()
                await self._ready.wait()
            if not unread or unread[0].finished:
                break
            if self.output_kind != RequestOutputKind.FINAL_ONLY and stream_due(self._progress, unread[0]):
                break
            unread.popleft()  # not this one: FINAL_ONLY, or fewer new tokens than stream_interval
        if unread:
            item = unread.popleft()
            if item.finished:
                self._mark_done()
            if self.output_kind == RequestOutputKind.DELTA:
                item = delta_output(self._progress, item)
            return item
        error, self._error = self._error, None
        self._mark_done()
        raise error

    def close(self) -> None:
        """Stops the stream; aborts the request in the engine unless it already finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._owner._release(self)
            self._owner.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def _mark_done(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._release(self)
        self._closed = True


class AsyncLLMEngine:
    """Drives an :class:`LLMEngine` from a background thread for asyncio callers.

    ``max_waiting`` bounds the queue in front of the running batch: a new
    request is refused with :class:`EngineOverloadedError` once
    ``max_num_seqs + max_waiting`` requests are unfinished.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        self.engine = engine
        self.set_max_waiting(max_waiting)
        self._cond = threading.Condition()
        self._commands: list[_AddRequest | _Abort | _Call] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._accepting = True
        self._open_lock = threading.Lock()
        self._open: dict[str, RequestStream] = {}  # unfinished requests, guarded by _open_lock
        self._dead: BaseException | None = None
        self._observer: RequestObserver | None = None
        # Engine-thread state.
        self._active: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._stats = engine.get_stats()  # last snapshot; replaced (never mutated) by the engine thread
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, max_waiting: int = DEFAULT_MAX_WAITING, limits: RequestLimits | None = None
    ) -> AsyncLLMEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_config(config, limits), max_waiting=max_waiting)

    # -- read-only views (safe from any thread) --------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def grammar_compiler(self):
        """The engine's GrammarCompiler (thread-safe: the server compiles on its own threads)."""
        return self.engine.grammar_compiler

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a request may use are in [0, vocab_size) (the model's, else the tokenizer's)."""
        size = getattr(self.engine, "vocab_size", None)
        return size if size is not None else self.engine.tokenizer.vocab_size

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def num_unfinished_requests(self) -> int:
        with self._open_lock:
            return len(self._open)

    def get_stats(self):
        """The engine's stats as of the end of the last engine-thread iteration."""
        return self._stats

    def set_max_waiting(self, max_waiting: int) -> None:
        """Requests allowed to queue beyond the ``max_num_seqs`` the engine can run at once."""
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 0:
            raise ConfigError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.max_waiting = max_waiting
        self.max_unfinished = self.engine.config.max_num_seqs + max_waiting

    def set_observer(self, observer: RequestObserver | None) -> None:
        self._observer = observer

    # -- requests ----------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submits a request and waits until the engine thread has accepted it.

        Raises :class:`EngineOverloadedError` when the queue is full or the
        engine is shutting down, and whatever ``LLMEngine.add_request`` raised
        (``RequestError`` for a bad prompt) otherwise.
        """
        stream = self._open_stream(request_id)
        if isinstance(params, SamplingParams):
            stream.output_kind, stream._progress.stream_interval = params.output_kind, params.stream_interval
        self._submit(_AddRequest(stream, prompt, params, cache_salt))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the finished one; aborts if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def call_on_engine_thread(self, fn: Callable[[LLMEngine], object]):
        """``fn(engine)``'s result, run on the engine thread between two steps (it must not block)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (from any thread); their blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._submit(_Abort(ids))

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stops accepting requests, lets in-flight ones finish for up to
        ``drain_timeout`` seconds, aborts the rest and joins the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self.num_unfinished_requests and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._interrupt_step()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _open_stream(self, request_id: str) -> RequestStream:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead}")
        if not self._accepting:
            raise EngineOverloadedError("the server is shutting down and accepts no new requests")
        stream = RequestStream(request_id, asyncio.get_running_loop(), self)
        with self._open_lock:
            if len(self._open) >= self.max_unfinished:
                raise EngineOverloadedError(
                    f"the server is at capacity ({len(self._open)} unfinished requests: "
                    f"max_num_seqs={self.config.max_num_seqs} running plus max_waiting="
                    f"{self.max_waiting} queued); retry later"
                )
            if request_id in self._open:
                raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._open[request_id] = stream
        return stream

    def _release(self, stream: RequestStream) -> None:
        with self._open_lock:
            if self._open.get(stream.request_id) is stream:
                del self._open[stream.request_id]

    def _submit(self, command: _AddRequest | _Abort | _Call) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()
        self._interrupt_step()

    def _interrupt_step(self) -> None:
        """A step sleeping on a disk-tier load returns now, so that new commands are applied."""
        interrupt = getattr(self.engine, "interrupt_wait", None)
        if interrupt is not None:
            interrupt()

    # -- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        num_failures = 0
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                with self._cond:
                    while not self._commands and not busy and not self._stopping:
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._abort_all("abort", "the server shut down before the request finished")
                    close_tiers = getattr(self.engine, "close_kv_tiers", None)
                    if close_tiers is not None:
                        close_tiers()  # a restarted server finds the prefix cache on disk
                    return
                if self.engine.has_unfinished_requests():
                    if self._step():  # takes the stats snapshot itself
                        num_failures = 0
                    else:
                        num_failures += 1
                        time.sleep(min(_MAX_FAILURE_BACKOFF_S, 0.01 * 2**num_failures))
                else:
                    self._snapshot_stats()
        except BaseException as exc:  # a bug outside step(): fail everyone, refuse new work
            logger.exception("the engine loop stopped")
            self._dead = exc
            self._abort_all("error", f"the engine stopped: {exc}")
            self._fail_pending_commands(EngineDeadError(f"the engine stopped: {exc}"))

    def _apply(self, commands: list[_AddRequest | _Abort | _Call]) -> None:
        for command in commands:
            if isinstance(command, _Abort):
                self._apply_abort(command.request_ids)
            elif isinstance(command, _Call):
                _run_call(self.engine, command)
            else:
                self._apply_add(command)

    def _apply_add(self, command: _AddRequest) -> None:
        stream = command.stream
        try:
            self.engine.add_request(  # cumulative: the stream may merge outputs (see RequestStream)
                stream.request_id, command.prompt, command.params, cache_salt=command.cache_salt,
                output_kind=RequestOutputKind.CUMULATIVE,
            )
        except Exception as exc:  # fails this request only
            stream._post_accepted(exc)
            return
        self._active[stream.request_id] = stream
        self._timings[stream.request_id] = _Timing(submit_time=stream.submit_time)
        stream._post_accepted(None)

    def _apply_abort(self, request_ids: list[str]) -> None:
        known = [rid for rid in request_ids if self._active.pop(rid, None) is not None]
        for rid in request_ids:
            self._timings.pop(rid, None)
        if known:
            self.engine.abort_request(known)

    def _step(self) -> bool:
        """One engine step; on failure every in-flight request gets an error output.

        The stats snapshot is taken before the step's outputs are posted, so a
        client that has read an output and then scrapes /metrics sees the
        engine as of that step or later, never the state before it."""
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # a worker is gone: the loop stops and new work is refused
        except Exception as exc:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._active))
            self._abort_all("error", f"the engine failed while running this request: {exc}")
            self._snapshot_stats()
            return False
        self._snapshot_stats()
        for output in outputs:
            stream = self._active.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            self._observe(output)
            if output.finished:
                del self._active[output.request_id]
                self._timings.pop(output.request_id, None)
            stream._post(output)
        return True

    def _abort_all(self, finish_reason: str, message: str) -> None:
        streams = list(self._active.values())
        self._active.clear()
        self._timings.clear()
        if streams:
            try:
                self.engine.abort_request([s.request_id for s in streams])
            except Exception:
                logger.exception("aborting requests after a failure also failed")
        for stream in streams:
            stream._post(_terminal_output(stream, finish_reason, message))

    def _fail_pending_commands(self, error: BaseException) -> None:
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, _AddRequest):
                command.stream._post_accepted(error)
            elif isinstance(command, _Call):
                command.future.set_exception(error)

    def _snapshot_stats(self) -> None:
        try:
            self._stats = self.engine.get_stats()
        except Exception:
            logger.exception("engine.get_stats() failed")

    def _observe(self, output: RequestOutput) -> None:
        observer = self._observer
        timing = self._timings.get(output.request_id)
        if observer is None or timing is None:
            return
        try:
            _observe_latencies(observer, timing, output)
        except Exception:
            logger.exception("request observer failed")


def _run_call(engine: LLMEngine, call: _Call) -> None:
    """A failing call fails its own future only, never the engine loop."""
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn(engine))
    except Exception as exc:
        call.future.set_exception(exc)


def _observe_latencies(observer: RequestObserver, timing: _Timing, output: RequestOutput) -> None:
    """Latencies are measured from submission on the event loop, so they include queueing."""
    now = time.monotonic()
    metrics = output.metrics
    new_tokens = 0
    for completion in output.outputs:
        seen = timing.num_tokens_per_sample.get(completion.index, 0)
        new_tokens = max(new_tokens, len(completion.token_ids) - seen)
        timing.num_tokens_per_sample[completion.index] = len(completion.token_ids)
    if new_tokens > 0:
        if timing.last_token_time is None:
            first = metrics.first_token_time if metrics and metrics.first_token_time else now
            observer.on_first_token(max(0.0, first - timing.submit_time))
            new_tokens -= 1
        elif new_tokens > 0:
            observer.on_inter_token((now - timing.last_token_time) / new_tokens, new_tokens)
        timing.last_token_time = now
    if output.finished:
        end = metrics.finished_time if metrics and metrics.finished_time else now
        observer.on_finished(max(0.0, end - timing.submit_time))


def _terminal_output(stream: RequestStream, finish_reason: str, message: str) -> RequestOutput:
    """The last output the request got, finished with ``finish_reason`` (its text so far is kept)."""
    last = stream._last_output
    if last is None:
        completions = [CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason)]
        return RequestOutput(
            request_id=stream.request_id,
            prompt=None,
            prompt_token_ids=[],
            outputs=completions,
            finished=True,
            metrics=RequestMetrics(arrival_time=stream.submit_time),
            error=message if finish_reason == "error" else None,
        )
    completions = [
        replace(c, finish_reason=c.finish_reason or finish_reason, token_ids=list(c.token_ids))
        for c in last.outputs
    ]
    return replace(
        last,
        outputs=completions,
        finished=True,
        error=message if finish_reason == "error" else last.error,
    )
