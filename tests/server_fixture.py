"""Helpers for the server tests: a real ``pagedllm serve`` subprocess, and a tiny
fake engine with the LLMEngine interface for fast in-process tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import EngineStats
from pagedllm.errors import RequestError
from pagedllm.kv.stats import KVCacheStats
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str) -> Iterator[ServerProcess]:
    """A ready ``ServerProcess(*args)``; stopped afterwards, which must exit 0."""
    proc = ServerProcess(*args)
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
    assert code == 0, proc.log()


class ServerProcess:
    """``python -m pagedllm.cli serve`` on a free port of 127.0.0.1, as users start it."""

    def __init__(self, *args: str) -> None:
        self._args = args
        self._log = tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log", delete=False)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(self.port), *self._args]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        retries = 3  # free_port() closes its probe, so another process can take the port before the server binds it
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries and f"cannot serve on 127.0.0.1:{self.port}: Address already in use" in self.log():
                    retries -= 1
                    self._start()
                    continue
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self, tail: int | None = 6000) -> str:
        """The server's output so far: its last ``tail`` characters, or all of it."""
        with open(self._log.name, errors="replace") as f:
            text = f.read()
        return text if tail is None else text[-tail:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Sends ``sig`` and returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels dropped; the last sample of a name wins)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if match:
                values[match.group(1)] = float(match.group(3))
        return values

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Polls /metrics until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["pagedllm:num_requests_running"] == 0
                and m["pagedllm:num_requests_waiting"] == 0
                and m["pagedllm:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


# ---------------------------------------------------------------------------
# A fake engine: one token per step, deterministic text, failure switches.
# ---------------------------------------------------------------------------


class FakeTokenizer:
    """One token per character (code point < 256); id 0 is EOS."""

    vocab_size = 256
    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 or 32 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def id_to_piece(self, token_id: int) -> str:
        return chr(token_id)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams
    metrics: RequestMetrics
    samples: list[list[int]]


class FakeEngine:
    """The LLMEngine interface over a trivial "model": sample i emits 'a'+i, 'b'+i, ...

    ``fail_step`` makes the next step() raise; a prompt containing "EXPLODE"
    makes add_request raise a RuntimeError. Every request holds one "block".
    """

    model_name = "fake-model"

    def __init__(self, max_model_len: int = 200_000, max_num_seqs: int = 4, step_delay: float = 0.0) -> None:
        self.config = EngineConfig(max_num_seqs=max_num_seqs)
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.requests: dict[str, _FakeRequest] = {}
        self.fail_step = False
        self.num_steps = 0
        self.aborted: list[str] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def add_request(self, request_id, prompt, params, *, arrival_time=None, cache_salt=None, output_kind=None) -> None:
        assert output_kind in (None, 0), "the fake engine's outputs are cumulative, as the async engine asks"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < 256 for t in ids):
            raise RequestError("prompt token ids must be integers in [0, 256)", param="prompt")
        if "EXPLODE" in self.tokenizer.decode(ids):
            raise RuntimeError("boom while adding")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError("prompt + max_tokens exceeds the context", param="max_tokens")
        num_samples = params.beam_width if isinstance(params, BeamSearchParams) else params.num_samples
        self.requests[request_id] = _FakeRequest(
            request_id, ids, params, RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            [[] for _ in range(num_samples)],
        )
        self.num_prompt_tokens += len(ids)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("the fake model crashed")
        outputs = []
        for request in list(self.requests.values()):
            for index, sample in enumerate(request.samples):
                sample.append(ord("a") + (len(sample) + index) % 26)
                self.num_generation_tokens += 1
            finished = len(request.samples[0]) >= request.params.max_tokens
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.monotonic()
            if finished:
                request.metrics.finished_time = time.monotonic()
                del self.requests[request.request_id]
            outputs.append(self._output(request, finished))
        return outputs

    def _output(self, request: _FakeRequest, finished: bool) -> RequestOutput:
        num_top = getattr(request.params, "logprobs", None)
        completions = []
        for index, sample in enumerate(request.samples):
            logprobs = None
            if num_top is not None:
                logprobs = [
                    {t: Logprob(-0.5, 1, chr(t)), **({t + 1: Logprob(-1.5, 2, chr(t + 1))} if num_top > 1 else {})}
                    for t in sample
                ]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=self.tokenizer.decode(sample),
                    token_ids=list(sample),
                    cumulative_logprob=-0.5 * len(sample),
                    logprobs=logprobs,
                    finish_reason="length" if finished else None,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=list(request.prompt_ids),
            outputs=completions[: getattr(request.params, "n", len(completions))],
            finished=finished,
            metrics=request.metrics,
        )

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> EngineStats:
        used = len(self.requests)
        kv = KVCacheStats(
            block_size=16, num_blocks=100, num_free_blocks=100 - used, num_used_blocks=used,
            num_cached_blocks=0, peak_used_blocks=used, num_shared_blocks=0,
            num_allocated_slots=16 * used, num_slots_holding_tokens=used, num_slots_saved_by_sharing=0,
            peak_blocks_without_sharing=used, prefix_cache_queries=0, prefix_cache_hits=0,
            num_preemptions=0, num_cpu_blocks=0, num_free_cpu_blocks=0, num_swapped_out_seqs=0,
        )
        return EngineStats(used, 0, 0, kv, self.num_prompt_tokens, self.num_generation_tokens, 0)
