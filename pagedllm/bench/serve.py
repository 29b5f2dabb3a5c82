"""``pagedllm bench serve``: load-test any OpenAI-compatible server with streaming completions.

Requests go to ``/v1/completions`` with ``stream: true`` and the prompt as token
ids (``ignore_eos``, greedy), arriving all at once (``--request-rate inf``) or
as a Poisson process; ``--max-concurrency`` caps requests in flight. One
``httpx.AsyncClient`` with a connection pool as large as the concurrency
carries every stream.

Per request: TTFT (send to first streamed token), ITL (gaps between
streamed chunks), TPOT ((E2E - TTFT) / (output tokens - 1)), E2E. Output
tokens come from the final ``usage`` chunk when the server sends one, else
from the number of streamed chunks.

While the load runs, the server's Prometheus ``/metrics`` is read every
``--metrics-interval`` seconds (vLLM's names, under any prefix: ``pagedllm:`` or
``vllm:``): the most requests running and waiting at once, the highest KV
cache usage, and the preemptions during the load. A server without the
endpoint gets no such figures.

``--compare pagedllm,vllm`` starts each server in turn as a subprocess on a
free port (``pagedllm serve``, then vLLM's OpenAI server from its own
virtualenv), both with the same settings (:class:`ServerSettings`), waits
until ``/v1/models`` answers (the start-up time), warms it up, sends the same
load and stops it, its whole process group, before the next one starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedllm.bench import report, stopping
from pagedllm.bench.stopping import run_async
from pagedllm.bench.throughput import PEER_PYTHON_ENV
from pagedllm.bench.workloads import (
    WARMUP_OUTPUT_LEN,
    Workload,
    add_workload_arguments,
    warmup_prompts,
    workload_from_args,
)
from pagedllm.errors import ConfigError

SERVERS = ("pagedllm", "vllm")

METRICS_INTERVAL_S = 0.5
# Prometheus sample names, after the server's prefix, that the sampler follows.
_SAMPLED_METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                    "num_requests_running_peak")


@dataclass
class RequestRecord:
    """One request's timings in seconds since it was sent."""

    prompt_tokens: int
    output_tokens: int = 0
    num_chunks: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _is_empty_final(chunk: dict) -> bool:
    """A chunk whose choices carry no text but end the stream: a token that decoded to no
    text yet (part of a UTF-8 character), or a closing chunk that carries no token."""
    choices = chunk["choices"]
    return all(not c.get("text") and c.get("finish_reason") is not None for c in choices)


async def sse_chunks(response):
    """The JSON objects of an OpenAI-style SSE stream (its ``data:`` lines), up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client, url: str, payload: dict, record: RequestRecord) -> RequestRecord:
    """POST one streaming completion and time its chunks into ``record``.

    Every chunk with choices is stamped (the ``usage`` chunk has none). A last
    chunk without text is dropped when the ``usage`` count shows it carried no
    token, or when there is no ``usage`` to tell.
    """
    start = time.perf_counter()
    stamps: list[float] = []
    last_is_empty_final = False
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if not chunk.get("choices"):
                    continue
                stamps.append(time.perf_counter())
                last_is_empty_final = _is_empty_final(chunk)
        record.e2e_s = time.perf_counter() - start
        if last_is_empty_final and (usage_tokens is None or len(stamps) > usage_tokens):
            stamps.pop()
        record.num_chunks = len(stamps)
        record.output_tokens = usage_tokens if usage_tokens is not None else len(stamps)
        if not stamps:
            record.error = "the stream ended without a token"
            return record
        record.ttft_s = stamps[0] - start
        record.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
    except Exception as exc:  # a load test records failures and carries on
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def arrival_times(num_requests: int, request_rate: float, seed: int):
    """Yield request indices at Poisson arrivals (all at once for an infinite rate)."""
    rng = random.Random(seed)
    for i in range(num_requests):
        yield i
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))


async def run_load(
    base_url: str,
    model: str | None,
    workload: Workload,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    timeout_s: float = 3600.0,
    transport=None,
    metrics_interval_s: float | None = None,
) -> dict:
    """Send the workload; ``transport`` replaces the network (an ``httpx.AsyncBaseTransport``, for tests)."""
    import httpx

    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    pool = (max_concurrency or workload.num_requests) + 1  # one more for the metrics sampler
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers, transport=transport) as client:
        if model is None:
            model = await _first_model(client, base)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(i: int) -> RequestRecord:
            prompt = workload.prompt_token_ids[i]
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": workload.output_len,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": workload.ignore_eos,
                "stream_options": {"include_usage": True},
            }
            record = RequestRecord(prompt_tokens=len(prompt))
            if gate is None:
                return await send_request(client, f"{base}/v1/completions", payload, record)
            async with gate:
                return await send_request(client, f"{base}/v1/completions", payload, record)

        start = time.perf_counter()
        sampler = MetricsSampler(client, f"{base}/metrics", metrics_interval_s)
        sampling = asyncio.create_task(sampler.run())
        arrivals = arrival_times(workload.num_requests, request_rate, seed)
        tasks = [asyncio.create_task(one(i)) async for i in arrivals]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        await sampler.stop(sampling)
    return {
        **summarize(records, duration, model, workload, request_rate, max_concurrency),
        "server_metrics": sampler.summary(),
    }


class MetricsSampler:
    """Reads a server's Prometheus ``/metrics`` at an interval while the load runs.

    Keeps the peaks of the running/waiting gauges and KV usage, and the first
    and last preemption counts. The first failed read (no endpoint, or not
    Prometheus text) ends the sampling: such a server reports no metrics.
    """

    def __init__(self, client, url: str, interval_s: float | None = None) -> None:
        self.client = client
        self.url = url
        self.interval_s = METRICS_INTERVAL_S if interval_s is None else interval_s
        self.samples: list[dict[str, float]] = []
        self._done = asyncio.Event()

    async def run(self) -> None:
        if self.interval_s <= 0:
            return  # sampling turned off
        while not self._done.is_set():
            values = await self._read()
            if values is None:
                return
            self.samples.append(values)
            try:
                await asyncio.wait_for(self._done.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self, task: asyncio.Task) -> None:
        """One last reading (for the preemption count at the end), then stop."""
        self._done.set()
        await task
        if self.samples:
            values = await self._read()
            if values is not None:
                self.samples.append(values)

    async def _read(self) -> dict[str, float] | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            response = await self.client.get(self.url)
            if response.status_code != 200:
                return None
            values: dict[str, float] = {}
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    name = sample.name.rsplit(":", 1)[-1]
                    if name in _SAMPLED_METRICS:
                        values[name] = values.get(name, 0.0) + sample.value
            return values or None
        except Exception:  # noqa: BLE001 - any unreadable answer means the server has no usable metrics
            return None

    def summary(self) -> dict | None:
        if not self.samples:
            return None

        def peak(name: str) -> float | None:
            seen = [s[name] for s in self.samples if name in s]
            return max(seen) if seen else None

        preemptions = [s["num_preemptions_total"] for s in self.samples if "num_preemptions_total" in s]
        return {
            "num_samples": len(self.samples),
            "peak_running": peak("num_requests_running"),
            # pagedllm's own gauge, exact per step but counted from the server's start (None elsewhere)
            "peak_running_since_start": peak("num_requests_running_peak"),
            "peak_waiting": peak("num_requests_waiting"),
            "peak_kv_cache_usage": peak("kv_cache_usage_perc"),
            "preemptions": preemptions[-1] - preemptions[0] if preemptions else None,
        }


async def _first_model(client, base: str) -> str:
    response = await client.get(f"{base}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _stats(values: list[float], scale: float = 1000.0) -> dict | None:
    """mean / p50 / p90 / p99, in ms by default."""
    if not values:
        return None
    return {
        "mean": scale * sum(values) / len(values),
        "p50": scale * report.percentile(values, 50),
        "p90": scale * report.percentile(values, 90),
        "p99": scale * report.percentile(values, 99),
    }


def summarize(records, duration: float, model: str, workload: Workload, rate: float, concurrency) -> dict:
    done = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_lens = [r.output_tokens for r in done]
    return {
        "model": model,
        "num_requests": len(records),
        "completed": len(done),
        "errors": len(errors),
        "error_samples": errors[:5],
        "request_rate": "inf" if rate == float("inf") else rate,
        "max_concurrency": concurrency,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        # per completed request; both equal max_tokens when every request ran to its length
        "min_output_tokens": min(output_lens, default=None),
        "max_output_tokens": max(output_lens, default=None),
        # streamed chunks that carried tokens; fewer than output_tokens if a server sends several per chunk
        "token_chunks": sum(r.num_chunks for r in done),
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": _stats([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itl_s]),
        "e2e_ms": _stats([r.e2e_s for r in done if r.e2e_s is not None]),
    }


# ---- servers started by --compare ----------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """What every server of a comparison is started with: sizes in bytes, lengths in tokens.

    ``model`` is what the servers load (``None``: the default model);
    ``served_model_name`` is the name they answer to and the load asks for.
    """

    model: str | None
    served_model_name: str
    dtype: str
    max_model_len: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool

    def to_json(self) -> dict:
        return asdict(self)


def settings_from_args(args: argparse.Namespace, workload: Workload) -> ServerSettings:
    """The engine options of ``args``, with pagedllm's defaults made explicit for vLLM."""
    from pagedllm.bench.peers import default_max_model_len

    max_model_len = args.max_model_len or default_max_model_len(workload)
    if workload.max_seq_len > max_model_len:
        raise ConfigError(
            f"--max-model-len {max_model_len} is shorter than the workload's longest request "
            f"({workload.max_seq_len} tokens)"
        )
    return server_settings(args, max_model_len)


def server_settings(args: argparse.Namespace, max_model_len: int) -> ServerSettings:
    """The engine options of ``args`` for servers of ``max_model_len`` tokens."""
    from pagedllm.bench.peers import resolve_dtype_name
    from pagedllm.config import step_token_budget
    from pagedllm.engine.llm_engine import DEFAULT_CPU_KV_MEMORY
    from pagedllm.models.paths import model_display_name, resolve_model_path

    return ServerSettings(
        model=args.model,
        served_model_name=model_display_name(resolve_model_path(args.model)),
        dtype=resolve_dtype_name(args.dtype),
        max_model_len=max_model_len,
        kv_cache_bytes=args.kv_cache_memory or DEFAULT_CPU_KV_MEMORY,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=step_token_budget(args.max_num_batched_tokens, args.max_num_seqs),
        enable_prefix_caching=args.enable_prefix_caching,
    )


def pagedllm_server_command(settings: ServerSettings, host: str, port: int) -> list[str]:
    """``pagedllm serve`` under this interpreter, started with ``settings``."""
    command = [sys.executable, "-m", "pagedllm.cli", "serve"]
    if settings.model is not None:
        command += ["--model", settings.model]
    return command + [
        "--served-model-name", settings.served_model_name,
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len),
        "--kv-cache-memory", str(settings.kv_cache_bytes),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching",
        "--host", host,
        "--port", str(port),
    ]


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server: its command line, environment and working directory."""

    command: list[str]
    env: dict
    cwd: str


def server_launch(
    system: str, settings: ServerSettings, host: str, port: int, peer_python: str | None
) -> ServerLaunch:
    from pagedllm.bench import peers

    if system == "pagedllm":
        # The folder holding the pagedllm package, so ``-m pagedllm.cli`` runs this very copy.
        package_root = str(Path(__file__).resolve().parents[2])
        return ServerLaunch(pagedllm_server_command(settings, host, port), dict(os.environ), package_root)
    if not Path(peer_python).exists():
        raise ConfigError(f"--peer-python {peer_python!r} does not exist")
    model_dir = peers.export_hf_dir(settings.model)
    command = peers.vllm_server_command(peer_python, model_dir, settings, host, port)
    # Not the repository: ``python -m`` puts the working directory first on sys.path.
    return ServerLaunch(command, peers.vllm_server_env(), tempfile.gettempdir())


def live_group_members(pgid: int) -> list[int]:
    """Pids of process group ``pgid`` that are not zombies (from /proc; without it, whether
    the group has any process at all)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class ServerProcess:
    """A server run in its own session, so that stopping it ends its whole process group
    (vLLM's engine core and worker processes as well as the API server).

    Use as a context manager: the group is stopped on leaving the block, on error too.
    Output goes to ``log_path`` (a temporary file when ``None``). ``pagedllm serve``
    and vLLM both shut down cleanly on SIGTERM; whatever of the group still runs
    ``stop_grace_s`` later is killed.
    """

    def __init__(
        self,
        name: str,
        launch: ServerLaunch,
        log_path: str | Path | None = None,
        stop_grace_s: float = 60.0,
    ) -> None:
        self.name = name
        self.launch = launch
        self.log_path = Path(log_path) if log_path else None
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen | None = None
        self._log = None
        self._started_at = 0.0

    @property
    def pgid(self) -> int:
        assert self.process is not None, "the server was not started"
        return self.process.pid

    def __enter__(self) -> ServerProcess:
        return self if self.process is not None else self.start()

    def start(self) -> ServerProcess:
        """Start the process (entering the ``with`` block does, unless this was called first)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "w+b")  # closed in stop()
        else:
            self._log = tempfile.TemporaryFile()
        self._started_at = time.perf_counter()
        self.process = subprocess.Popen(
            self.launch.command, env=self.launch.env, cwd=self.launch.cwd,
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        stopping.register_group(self.process.pid)
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait_ready(self, base_url: str, model: str, timeout_s: float) -> float:
        """Seconds from the start of the process until ``/v1/models`` lists ``model``;
        ConfigError if the server exits or does not answer within ``timeout_s``."""
        import httpx

        assert self.process is not None, "the server was not started"
        while True:
            if self.process.poll() is not None:
                raise ConfigError(
                    f"{self.name} exited with code {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(f"{base_url}/v1/models", timeout=5.0)
                if response.status_code == 200:
                    names = [m.get("id") for m in response.json().get("data", [])]
                    if model not in names:
                        raise ConfigError(f"{self.name} serves {names}, not {model!r}")
                    return time.perf_counter() - self._started_at
            except httpx.HTTPError:
                pass
            if time.perf_counter() - self._started_at > timeout_s:
                raise ConfigError(
                    f"{self.name} did not answer {base_url}/v1/models within {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the group; SIGKILL to whatever of it still runs ``stop_grace_s`` later."""
        if self.process is None or self._log.closed:
            return
        pgid = self.pgid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + stopping.stop_grace(self.stop_grace_s)
        # The leader's children (vLLM's engine processes) may outlive it in the group.
        while self._group_running(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_running(pgid):
            _signal_group(pgid, signal.SIGKILL)
            self.process.wait()
            deadline = time.monotonic() + 10.0  # SIGKILL takes effect asynchronously
            while live_group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        stopping.unregister_group(pgid)
        self._log.close()

    def _group_running(self, pgid: int) -> bool:
        # poll() also reaps the leader, so that an exited leader is not counted as a member
        return self.process.poll() is None or bool(live_group_members(pgid))

    def log_tail(self, num_chars: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - num_chars))
        return self._log.read().decode(errors="replace")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


PORT_RETRIES = 3  # new ports a server start tries when the one it was given is taken meanwhile


def start_server(
    name: str,
    launch_on: Callable[[int], ServerLaunch],
    model: str,
    timeout_s: float,
    log_path: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> tuple[ServerProcess, str, float]:
    """Start a server on a free port (``port``, else one free now) and wait until it serves ``model``.

    free_port() closes its probe socket, so another process can take the port before the
    server binds it. pagedllm and vLLM then both say "Address already in use" at once,
    before loading anything, and the start is tried again on a new port, up to
    PORT_RETRIES times; any other failure ends the start at once. ``launch_on(port)``
    gives the command for a port. Returns the running server (the caller stops it), its
    base URL and its start-up seconds (ConfigError when it does not come up).
    """
    for retries_left in reversed(range(PORT_RETRIES + 1)):
        if port is None:
            port = free_port(host)
        base_url = f"http://{host}:{port}"
        server = ServerProcess(name, launch_on(port), log_path).start()
        try:
            return server, base_url, server.wait_ready(base_url, model, timeout_s)
        except ConfigError:
            lost_port = "Address already in use" in server.log_tail()
            server.stop()
            if not (lost_port and retries_left):
                raise
            print(f"{name}: {base_url} was taken meanwhile; another port", file=sys.stderr, flush=True)
            port = None
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable: the last try returns or raises")


async def warm_up(base_url: str, model: str, max_model_len: int) -> None:
    """A few short requests of growing length, so that first-shape costs stay out of the figures."""
    prompts = warmup_prompts(max_len=max_model_len - WARMUP_OUTPUT_LEN)
    result = await run_load(base_url, model, Workload("warm-up", prompts, WARMUP_OUTPUT_LEN))
    if result["errors"]:
        raise ConfigError(f"the warm-up requests failed: {result['error_samples']}")


def server_version(base_url: str) -> str | None:
    """What ``GET /version`` answers (pagedllm and vLLM both have it), else None."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/version", timeout=5.0)
        return response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def bench_server(
    system: str, settings: ServerSettings, workload: Workload, args: argparse.Namespace, peer_python: str | None
) -> dict:
    """Start ``system``'s server, time its start-up, warm it up, run the load, stop it."""
    host = "127.0.0.1"
    log_path = Path(args.server_log_dir) / f"{system}.log" if args.server_log_dir else None
    launches: list[ServerLaunch] = []

    def launch_on(port: int) -> ServerLaunch:
        launches.append(server_launch(system, settings, host, port, peer_python))
        print(f"starting {system}: {' '.join(launches[-1].command)}", file=sys.stderr, flush=True)
        return launches[-1]

    server, base_url, startup_s = start_server(system, launch_on, settings.served_model_name,
                                               args.startup_timeout, log_path, host)
    launch = launches[-1]
    with server:
        print(f"{system} answered after {startup_s:.1f} s", file=sys.stderr, flush=True)
        version = server_version(base_url)
        if args.warmup:
            run_async(warm_up(base_url, settings.served_model_name, settings.max_model_len))
        result = run_async(
            run_load(
                base_url, settings.served_model_name, workload, args.request_rate, args.max_concurrency,
                seed=args.seed, timeout_s=args.timeout, metrics_interval_s=args.metrics_interval,
            )
        )
        loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "backend": system,
        "dtype": settings.dtype,
        "startup_s": startup_s,
        "server_version": version,
        **result,
        # other work on the machine skews the figures: the 1-minute load as this server's load ended
        "loadavg_1m": loadavg,
        "base_url": base_url,
        "server_command": " ".join(launch.command),
    }


def parse_servers(text: str) -> list[str]:
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers or not set(servers) <= set(SERVERS) or len(set(servers)) != len(servers):
        raise ConfigError(f"--compare {text!r}: choose from {', '.join(SERVERS)}, each at most once")
    return servers


def run_compare(args: argparse.Namespace, workload: Workload) -> int:
    servers = parse_servers(args.compare)
    peer_python = args.peer_python or os.environ.get(PEER_PYTHON_ENV)
    if "vllm" in servers and not peer_python:
        raise ConfigError(
            f"--compare vllm needs --peer-python PATH (the python of vLLM's virtualenv) or ${PEER_PYTHON_ENV}"
        )
    settings = settings_from_args(args, workload)
    results = [bench_server(system, settings, workload, args, peer_python) for system in servers]
    print(format_comparison(results, workload))
    data = {
        "workload": workload.describe(),
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "settings": settings.to_json(),
        "env": report.environment(),
        "results": results,
    }
    if args.json:
        report.write_json(args.json, data)
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(results) + "\n")
    return 0 if all(r["errors"] == 0 for r in results) else 1


# ---- command line -------------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("--request-rate must be > 0 (or inf)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load")
    g.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument(
        "--model", default=None,
        help="with --base-url: the model name to send (default: the server's first model); with --compare: "
        "the model the servers load (HF directory or .gguf; default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--api-key", default=None)
    g.add_argument(
        "--request-rate", type=_rate, default=float("inf"), help="requests/s, Poisson arrivals; inf = all at once"
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds a request may take")
    g.add_argument("--metrics-interval", type=float, default=METRICS_INTERVAL_S,
                   help="seconds between reads of the server's /metrics during the load (0: none)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    k = parser.add_argument_group("soak (with --duration; against --base-url)")
    k.add_argument("--duration", type=float, default=None, metavar="S",
                   help="soak for S seconds: sessions back to back, disconnects and bad requests alongside")
    k.add_argument("--num-sessions", type=int, default=None, help="stop starting sessions after this many")
    k.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="share of soak sessions that hang up after their first token")
    k.add_argument("--bad-request-rate", type=float, default=2.0, help="bad requests per second during the soak")
    g.add_argument("--markdown", default=None, metavar="FILE", help="write the results as a Markdown table")
    _add_compare_arguments(parser)
    _add_arm_arguments(parser)
    add_workload_arguments(
        parser, default_workload=False, default_num_prompts=32, default_output_len=None, with_seed=True
    )


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import parse_size

    c = parser.add_argument_group("servers started by --compare, each with the same settings")
    c.add_argument(
        "--compare", default=None, metavar="pagedllm,vllm",
        help="start each server in turn on a free port and send it the same load (instead of --base-url)",
    )
    c.add_argument(
        "--peer-python", default=None, metavar="PATH", help=f"python of vLLM's virtualenv (default: ${PEER_PYTHON_ENV})"
    )
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto: float32")
    c.add_argument("--max-model-len", type=int, default=None, help="default: the longest request, rounded up to 256")
    c.add_argument(
        "--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 2GiB (default: pagedllm's, 4GiB on CPU)"
    )
    c.add_argument("--max-num-seqs", type=int, default=256)
    c.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="per-step token budget (default: pagedllm's, 2048)"
    )
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    c.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds a server may take to answer /v1/models"
    )
    c.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True, help="a few short requests before timing"
    )
    c.add_argument("--server-log-dir", default=None, metavar="DIR", help="keep each server's output in DIR/<server>.log")


def _add_arm_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group(
        "arms: one pagedllm serve per --arm, started in turn with the settings above plus the arm's flags"
    )
    a.add_argument(
        "--arm", action="append", default=None, metavar="NAME=FLAGS",
        help="a server arm, e.g. 'int8=--kv-cache-dtype int8' (repeat for more); {kv_dir} in FLAGS is a fresh "
        "empty directory per arm",
    )
    a.add_argument("--kv-dir-root", default=None, metavar="DIR",
                   help="where the arms' {kv_dir} directories are made (default: the system temp dir)")
    m = parser.add_argument_group("multi-turn chat (--multi-turn, with --arm)")
    m.add_argument("--multi-turn", action="store_true",
                   help="C conversations of T chat turns, each prompt the whole conversation so far")
    m.add_argument("--turns", type=int, default=4, help="turns per conversation (T)")
    m.add_argument("--conversations", default="auto",
                   help="C, or 'auto': enough that the conversations hold --pool-multiple x the first arm's KV pool")
    m.add_argument("--pool-multiple", type=float, default=4.0, help="with --conversations auto")
    m.add_argument("--user-words", type=int, default=48, help="words per user message")
    m.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded per conversation and turn")
    m.add_argument("--restart-arm", default=None, metavar="NAME",
                   help="after arm NAME: restart its server on the same {kv_dir}, send each conversation one more "
                   "turn, and the same to a cold server")
    m.add_argument("--target-arms", default=",".join(("off", "on", "unlimited")), metavar="OFF,ON,UNLIMITED",
                   help="the arms the issue's ratios compare: tiers off, tiers on, an unlimited pool")


def run(args: argparse.Namespace) -> int:
    if args.arm and (args.base_url or args.compare):
        raise ConfigError("--arm starts its own servers: give it without --base-url and --compare")
    if args.multi_turn:
        from pagedllm.bench import multiturn

        if not args.arm:
            raise ConfigError("--multi-turn needs at least one --arm NAME=FLAGS (e.g. --arm 'base=')")
        return multiturn.run_arms(args)
    if not args.base_url and not args.compare and not args.arm:
        raise ConfigError(
            "give --base-url URL (a running server), --compare pagedllm,vllm or --arm NAME=FLAGS (servers to start)"
        )
    if args.base_url and args.compare:
        raise ConfigError("give either --base-url or --compare, not both")
    workload = workload_from_args(args)
    print(workload.describe(), file=sys.stderr)
    if args.arm:
        from pagedllm.bench import arms

        return arms.run_serve_arms(args, workload)
    if args.duration is not None:
        return run_soak_from_args(args, workload)
    if args.compare:
        return run_compare(args, workload)
    result = run_async(
        run_load(
            args.base_url, args.model, workload, args.request_rate, args.max_concurrency,
            args.api_key, args.seed, args.timeout, metrics_interval_s=args.metrics_interval,
        )
    )
    result["workload"] = workload.describe()
    result["base_url"] = args.base_url
    print(format_result(result))
    if args.json:
        report.write_json(args.json, result)
    if args.markdown:
        Path(args.markdown).write_text(format_markdown([result]) + "\n")
    return 0 if result["errors"] == 0 else 1


def run_soak_from_args(args: argparse.Namespace, workload: Workload) -> int:
    from pagedllm.bench import soak

    if not args.base_url:
        raise ConfigError("--duration soaks a running server: give --base-url")
    if not 0.0 <= args.disconnect_fraction <= 1.0:
        raise ConfigError(f"--disconnect-fraction must be in [0, 1], got {args.disconnect_fraction}")
    settings = soak.SoakSettings(
        duration_s=args.duration, num_sessions=args.num_sessions, concurrency=args.max_concurrency or 32,
        disconnect_fraction=args.disconnect_fraction, bad_request_rate=args.bad_request_rate,
        metrics_interval_s=args.metrics_interval or METRICS_INTERVAL_S,
    )
    result = run_async(
        soak.run_soak(args.base_url, args.model, workload, settings, args.api_key, args.seed, args.timeout)
    )
    result["base_url"] = args.base_url
    result["env"] = report.environment()
    result["loadavg_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(soak.format_soak(result))
    if args.json:
        report.write_json(args.json, result)
    return 0 if soak.soak_ok(result) else 1


# ---- presenting ---------------------------------------------------------------

LATENCY_METRICS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)"))
STATS = ("mean", "p50", "p90", "p99")


def format_result(result: dict) -> str:
    rows = [[label, *(result[key][k] if result[key] else None for k in STATS)] for key, label in LATENCY_METRICS]
    table = report.format_table(["metric", *STATS], rows)
    summary = (
        f"Serving {result['model']}: {result['completed']}/{result['num_requests']} requests ok, "
        f"{result['errors']} errors, rate {result['request_rate']}, "
        f"max concurrency {result['max_concurrency'] or 'unlimited'}\n"
        f"duration {result['duration_s']:.2f} s; {result['request_throughput']:.2f} req/s; "
        f"output {result['output_tokens_per_s']:.1f} tok/s; total {result['total_tokens_per_s']:.1f} tok/s"
    )
    metrics = ", ".join(f"{h} {c}" for h, c in zip(METRIC_HEADERS, _metric_cells(result.get("server_metrics"))))
    errors = "".join(f"\n  error: {e}" for e in result["error_samples"])
    return f"{summary}\nserver /metrics during the load: {metrics}\n{table}{errors}"


def format_comparison(results: list[dict], workload: Workload) -> str:
    """Throughput side by side, then each server's latencies."""
    base = next((r for r in results if r["backend"] == "pagedllm"), None)
    rows = [
        [
            r["backend"], r["dtype"], f"{r['completed']}/{r['num_requests']}", r["startup_s"], r["duration_s"],
            r["request_throughput"], r["output_tokens_per_s"], r["total_tokens_per_s"],
            r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None,
            *_metric_cells(r.get("server_metrics")),
        ]
        for r in results
    ]
    headers = [
        "server", "dtype", "ok", "start-up s", "wall s", "req/s", "output tok/s", "total tok/s", "x pagedllm",
        *METRIC_HEADERS,
    ]
    throughput = report.format_table(headers, rows, title=f"Serving: {workload.describe()}")
    latency_rows = [
        [r["backend"], label, *(r[key][k] if r[key] else None for k in STATS)]
        for r in results
        for key, label in LATENCY_METRICS
    ]
    latency = report.format_table(["server", "metric", *STATS], latency_rows)
    errors = "".join(f"\n  {r['backend']} error: {e}" for r in results for e in r["error_samples"])
    return f"{throughput}\n\n{latency}{errors}"


METRIC_HEADERS = ("peak running", "peak waiting", "peak KV use", "preemptions")


def _metric_cells(metrics: dict | None) -> list:
    """The sampled /metrics figures as table cells; '-' where the server gave none."""
    if not metrics:
        return ["-"] * len(METRIC_HEADERS)

    def count(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    usage = metrics["peak_kv_cache_usage"]
    return [
        count(metrics["peak_running"]), count(metrics["peak_waiting"]),
        "-" if usage is None else f"{100 * usage:.1f}%", count(metrics["preemptions"]),
    ]


def format_markdown(results: list[dict]) -> str:
    """One row per server: throughput, start-up, and TTFT / TPOT / ITL mean, p50, p99 in ms."""

    def stats(s: dict | None) -> str:
        return " / ".join(f"{s[k]:,.1f}" for k in ("mean", "p50", "p99")) if s else "-"

    lines = [
        "| server | dtype | requests ok | start-up s | output tok/s | total tok/s | requests/s "
        "| TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | ITL mean / p50 / p99 ms | "
        + " | ".join(METRIC_HEADERS) + " |",
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(METRIC_HEADERS),
    ]
    for r in results:
        startup = f"{r['startup_s']:.1f}" if r.get("startup_s") is not None else "-"
        cells = [
            r.get("backend") or r["base_url"], r.get("dtype", "-"), f"{r['completed']} / {r['num_requests']}", startup,
            f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}", f"{r['request_throughput']:.2f}",
            stats(r["ttft_ms"]), stats(r["tpot_ms"]), stats(r["itl_ms"]), *_metric_cells(r.get("server_metrics")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
