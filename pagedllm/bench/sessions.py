"""``pagedllm bench sessions``: many concurrent multi-turn chat sessions against a real server.

The scenario: a multi-tenant assistant with N users (default 500) chatting at
once in a KV budget too small for all their conversations. Each session sends
``--turns`` user messages to ``/v1/chat/completions`` (streamed, the whole
history each time, as chat clients do), waits a random think time between
turns (uniform in [0, 2 x ``--think-time``] seconds) and stops after its last
turn. A share of sessions (``--disconnect-share``, default 10%) closes the
stream mid-answer in one turn and leaves; the server must free their blocks.

Either the load goes to a running server (``--base-url``), or the bench starts
``pagedllm serve`` itself once per ``--kv-policies`` entry (``paged``, and
``contiguous-max`` for the same load with a max_model_len reservation per
session), on a free port, with the engine flags given here, and samples the
server process's resident memory every second.

Reported per run: sessions completed / disconnected on purpose / errored /
refused (by HTTP code); peak running and waiting requests and peak KV usage
(from ``/metrics``), preemptions; the KV blocks still in use once the server is
idle (leaked: must be 0); TTFT and TPOT percentiles over every turn; the
server's RSS over time. Exit status 1 when a session errored or blocks leaked,
and when the server cannot be reached (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from pagedllm.bench import report
from pagedllm.bench.serve import sse_chunks
from pagedllm.bench.stopping import run_async
from pagedllm.errors import ConfigError

# Words user turns are drawn from: common English, about one token each for a BPE vocabulary.
_WORDS = (
    "the market report shows revenue growth in the third quarter with higher margins and lower costs "
    "our team will review the plan for next year and share a summary of risks and opportunities "
    "please explain how the new product compares with last year and what customers said about it "
    "write a short answer with three points about sales cash flow guidance and hiring"
).split()
METRICS_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total")


@dataclass
class TurnRecord:
    """One chat turn; seconds since it was sent."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the final usage chunk, when the server sends one
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class SessionRecord:
    """One user's conversation. ``outcome``: completed | disconnected | errored | refused."""

    turns: list[TurnRecord] = field(default_factory=list)
    outcome: str = "completed"
    http_status: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class SessionLoad:
    """The shape of the load; token counts per turn, seconds of think time."""

    num_sessions: int = 500
    num_turns: int = 3
    user_words: int = 48
    max_tokens: int = 64
    think_time_s: float = 1.0
    disconnect_share: float = 0.1
    seed: int = 0

    def check(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1 or self.user_words < 1 or self.max_tokens < 1:
            raise ConfigError("--sessions, --turns, --user-words and --max-tokens must be >= 1")
        if not 0.0 <= self.disconnect_share <= 1.0 or self.think_time_s < 0:
            raise ConfigError("--disconnect-share must be in [0, 1] and --think-time >= 0")


def _user_message(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


async def stream_chat_turn(client, url: str, payload: dict, record: TurnRecord, stop_after: int | None) -> str:
    """Stream one answer into ``record``; returns its text. Closes the stream after
    ``stop_after`` chunks when given (a user leaving mid-answer). Raises on HTTP errors."""
    start = time.perf_counter()
    text: list[str] = []
    num_chunks = 0
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise Refused(response.status_code, body[:200])
        async for chunk in sse_chunks(response):
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:200])
            if chunk.get("usage"):
                _read_usage(chunk["usage"], record)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    text.append(piece)
                    num_chunks += 1
            if stop_after is not None and num_chunks >= stop_after:
                return "".join(text)  # leaving the block closes the connection mid-stream
    record.e2e_s = time.perf_counter() - start
    record.output_tokens = record.output_tokens or num_chunks
    return "".join(text)


def _read_usage(usage: dict, record: TurnRecord) -> None:
    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens", record.cached_tokens)


class Refused(Exception):
    """The server answered a turn with an HTTP error status (``status``)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status


async def run_session(client, base_url: str, model: str, load: SessionLoad, index: int) -> SessionRecord:
    rng = random.Random(load.seed * 1_000_003 + index)
    leaves_in_turn = rng.randrange(load.num_turns) if rng.random() < load.disconnect_share else None
    record = SessionRecord()
    messages: list[dict] = []
    await asyncio.sleep(rng.uniform(0, load.think_time_s))  # users do not all arrive in the same instant
    for turn in range(load.num_turns):
        messages.append({"role": "user", "content": _user_message(rng, load.user_words)})
        payload = {
            "model": model, "messages": messages, "max_tokens": load.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.7, "seed": index * 100 + turn,
        }
        turn_record = TurnRecord()
        record.turns.append(turn_record)
        leaving = turn == leaves_in_turn
        try:
            answer = await stream_chat_turn(
                client, f"{base_url}/v1/chat/completions", payload, turn_record,
                stop_after=max(1, load.max_tokens // 4) if leaving else None,
            )
        except Refused as exc:
            record.outcome, record.http_status, record.error = "refused", exc.status, str(exc)
            return record
        except Exception as exc:  # noqa: BLE001 - a load test records failures and carries on
            record.outcome, record.error = "errored", f"{type(exc).__name__}: {exc}"[:300]
            return record
        if leaving:
            record.outcome = "disconnected"
            return record
        messages.append({"role": "assistant", "content": answer})
        if turn + 1 < load.num_turns:
            await asyncio.sleep(rng.uniform(0, 2 * load.think_time_s))
    return record


class ServerSampler:
    """Reads ``/metrics`` (and the server's VmRSS when its pid is known) every ``interval_s``."""

    def __init__(self, client, base_url: str, pid: int | None, interval_s: float = 1.0) -> None:
        self.client, self.url, self.pid, self.interval_s = client, f"{base_url}/metrics", pid, interval_s
        self.samples: list[dict] = []  # {"t": s, metric: value, "rss_bytes": bytes}
        self._done = asyncio.Event()
        self._start = time.perf_counter()

    async def run(self) -> None:
        while not self._done.is_set():
            self.samples.append(await self.read())
            try:
                await asyncio.wait_for(self._done.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def read(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        sample: dict = {"t": time.perf_counter() - self._start}
        try:
            response = await self.client.get(self.url)
            for family in text_string_to_metric_families(response.text):
                for s in family.samples:
                    name = s.name.rsplit(":", 1)[-1]
                    if name in METRICS_NAMES:
                        sample[name] = sample.get(name, 0.0) + s.value
        except Exception:  # noqa: BLE001 - a missed scrape is a gap, not a failure
            pass
        if self.pid is not None:
            sample["rss_bytes"] = _rss_bytes(self.pid)
        return sample

    def peak(self, name: str) -> float | None:
        seen = [s[name] for s in self.samples if s.get(name) is not None]
        return max(seen) if seen else None


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _wait_idle(sampler: ServerSampler, timeout_s: float = 60.0) -> dict:
    """The first reading with nothing running or waiting (the server freed the aborted streams)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        sample = await sampler.read()
        idle = not sample.get("num_requests_running") and not sample.get("num_requests_waiting")
        if idle or time.perf_counter() > deadline:
            return sample
        await asyncio.sleep(0.5)


async def check_reachable(base_url: str) -> str:
    """The first model the server lists; ConfigError with one line if it does not answer."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(f"{base_url}/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"cannot reach an OpenAI-compatible server at {base_url} ({type(exc).__name__}: {exc})") from exc


async def run_sessions(base_url: str, load: SessionLoad, server_pid: int | None, num_kv_blocks: int | None) -> dict:
    import httpx

    model = await check_reachable(base_url)
    limits = httpx.Limits(max_connections=load.num_sessions + 8, max_keepalive_connections=load.num_sessions + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=60.0), limits=limits) as client:
        sampler = ServerSampler(client, base_url, server_pid)
        first = await sampler.read()
        sampling = asyncio.create_task(sampler.run())
        start = time.perf_counter()
        records = await asyncio.gather(
            *(run_session(client, base_url, model, load, i) for i in range(load.num_sessions))
        )
        duration = time.perf_counter() - start
        sampler._done.set()
        await sampling
        idle = await _wait_idle(sampler)
    return summarize(records, sampler, first, idle, duration, num_kv_blocks, load)


def summarize(records, sampler: ServerSampler, first: dict, idle: dict, duration: float,
              num_kv_blocks: int | None, load: SessionLoad) -> dict:
    outcomes = {k: sum(r.outcome == k for r in records) for k in ("completed", "disconnected", "errored", "refused")}
    refused_codes: dict[str, int] = {}
    for r in records:
        if r.outcome == "refused":
            refused_codes[str(r.http_status)] = refused_codes.get(str(r.http_status), 0) + 1
    turns = [t for r in records for t in r.turns if t.e2e_s is not None]
    ttft = [t.ttft_s for t in turns if t.ttft_s is not None]
    tpot = [t.tpot_s for t in turns if t.tpot_s is not None]
    final_usage = idle.get("kv_cache_usage_perc")
    rss = [(round(s["t"], 1), s["rss_bytes"]) for s in sampler.samples if s.get("rss_bytes")]
    preempt_first, preempt_last = first.get("num_preemptions_total"), idle.get("num_preemptions_total")
    return {
        "load": load.__dict__,
        "duration_s": duration,
        "sessions": outcomes,
        "refused_http_codes": refused_codes,
        "errors": sorted({r.error for r in records if r.outcome == "errored"})[:5],
        "turns_completed": len(turns),
        "output_tokens": sum(t.output_tokens for t in turns),
        "peak_running": sampler.peak("num_requests_running"),
        "peak_waiting": sampler.peak("num_requests_waiting"),
        "peak_kv_usage": sampler.peak("kv_cache_usage_perc"),
        "final_kv_usage": final_usage,
        "num_kv_blocks": num_kv_blocks,
        "leaked_blocks": _leaked_blocks(final_usage, num_kv_blocks),
        "idle_after_load": not idle.get("num_requests_running") and not idle.get("num_requests_waiting"),
        "preemptions": (preempt_last - preempt_first if preempt_first is not None and preempt_last is not None else None),
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "server_rss": _rss_summary(rss),
    }


def _leaked_blocks(final_usage: float | None, num_kv_blocks: int | None) -> int | None:
    """Blocks still in use once idle: 0 when the usage gauge reads 0, else needs the cache size."""
    if final_usage is None:
        return None
    if final_usage == 0:
        return 0
    return round(final_usage * num_kv_blocks) if num_kv_blocks else None


def _percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    return {f"p{q}": 1000 * report.percentile(values, q) for q in (50, 90, 99)}


def _rss_summary(rss: list[tuple[float, int]]) -> dict | None:
    """Peak and the level after warm-up (the first quarter) against the end: flat means no growth."""
    if not rss:
        return None
    values = [b for _, b in rss]
    quarter = max(1, len(values) // 4)
    step = max(1, len(rss) // 40)
    return {
        "peak_bytes": max(values),
        "after_warmup_bytes": max(values[:quarter]),
        "last_quarter_max_bytes": max(values[-quarter:]),
        "timeline": rss[::step],  # (seconds, bytes), about 40 points
    }


# ---- launching the server -----------------------------------------------------


def serve_command(args: argparse.Namespace, kv_policy: str, port: int) -> list[str]:
    """``pagedllm serve`` with this run's engine flags and ``kv_policy``."""
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--kv-policy", kv_policy, "--dtype", args.dtype, "--block-size", str(args.block_size),
               "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
               "--log-level", "warning"]
    for flag, value in (("--model", args.model), ("--num-kv-blocks", args.num_kv_blocks),
                        ("--kv-cache-memory", args.kv_cache_memory), ("--max-model-len", args.max_model_len),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value is not None:
            command += [flag, str(value)]
    if args.rope_scaling is not None:
        command += ["--rope-scaling", json.dumps(args.rope_scaling)]
    prefault = getattr(args, "kv_cache_prefault", None)  # None: serve's default (on)
    if prefault is not None:
        command.append("--kv-cache-prefault" if prefault else "--no-kv-cache-prefault")
    return command


def run_launched(args: argparse.Namespace, load: SessionLoad, kv_policy: str) -> dict:
    import os
    from pathlib import Path

    from pagedllm.bench.serve import ServerLaunch, start_server

    package_root = str(Path(__file__).resolve().parents[2])

    def launch_on(port: int) -> ServerLaunch:
        return ServerLaunch(serve_command(args, kv_policy, port), dict(os.environ), package_root)

    server, base_url, started_s = start_server(f"pagedllm serve ({kv_policy})", launch_on, _served_name(args),
                                               timeout_s=600.0)
    with server:
        result = run_async(run_sessions(base_url, load, server.pgid, args.num_kv_blocks))
        result.update(kv_policy=kv_policy, server_start_s=started_s)
    return result


def _served_name(args: argparse.Namespace) -> str:
    from pagedllm.models.paths import model_display_name, resolve_model_path

    return model_display_name(resolve_model_path(args.model))


# ---- command line ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedllm.cli import add_engine_arguments

    g = parser.add_argument_group("sessions")
    g.add_argument("--sessions", type=int, default=500, help="concurrent chat sessions")
    g.add_argument("--turns", type=int, default=3, help="user turns per session")
    g.add_argument("--user-words", type=int, default=48, help="words per user message")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (ignore_eos)")
    g.add_argument("--think-time", type=float, default=1.0, help="mean seconds between a session's turns")
    g.add_argument("--disconnect-share", type=float, default=0.1, help="share of sessions leaving mid-answer")
    g.add_argument("--base-url", default=None, help="a running server; default: start pagedllm serve per policy")
    g.add_argument("--kv-policies", default="paged", help="with a started server: e.g. paged,contiguous-max")
    g.add_argument("--max-waiting", type=int, default=100000, help="the started server's --max-waiting")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    load = SessionLoad(args.sessions, args.turns, args.user_words, args.max_tokens, args.think_time,
                       args.disconnect_share, args.seed)
    load.check()
    policies = [p.strip() for p in args.kv_policies.split(",") if p.strip()]
    results: list[dict] = []
    try:
        for policy in [None] if args.base_url else policies:
            if policy is None:
                result = run_async(run_sessions(args.base_url.rstrip("/"), load, None, args.num_kv_blocks))
            else:
                result = run_launched(args, load, policy)
            results.append(result)
            print(format_result(result), flush=True)  # each run as it ends: a later one may take long
            if args.json:
                report.write_json(args.json, {"environment": report.environment(), "runs": results})
    except ConfigError as exc:
        print(f"pagedllm bench sessions: error: {exc}", file=sys.stderr)
        return 1
    failed = any(r["sessions"]["errored"] or r["leaked_blocks"] != 0 or not r["idle_after_load"] for r in results)
    return 1 if failed else 0


def format_result(r: dict) -> str:
    s = r["sessions"]

    def ms(d: dict | None) -> str:
        return "-" if d is None else " / ".join(f"{v:.0f}" for v in d.values())

    rss = r["server_rss"]
    gib = 2**30
    rows = [
        ["sessions completed / disconnected / errored / refused",
         f"{s['completed']} / {s['disconnected']} / {s['errored']} / {s['refused']}"],
        ["refused by HTTP code", r["refused_http_codes"] or "-"],
        ["turns completed, output tokens", f"{r['turns_completed']}, {r['output_tokens']}"],
        ["wall time (s)", f"{r['duration_s']:.1f}"],
        ["peak running / waiting", f"{_count(r['peak_running'])} / {_count(r['peak_waiting'])}"],
        ["peak / final KV usage", f"{_pct(r['peak_kv_usage'])} / {_pct(r['final_kv_usage'])}"],
        ["leaked blocks", r["leaked_blocks"] if r["leaked_blocks"] is not None else "-"],
        ["preemptions", _count(r["preemptions"])],
        ["TTFT p50 / p90 / p99 (ms)", ms(r["ttft_ms"])],
        ["TPOT p50 / p90 / p99 (ms)", ms(r["tpot_ms"])],
        ["server RSS after warm-up / last quarter / peak (GiB)",
         "-" if rss is None else f"{rss['after_warmup_bytes'] / gib:.2f} / "
         f"{rss['last_quarter_max_bytes'] / gib:.2f} / {rss['peak_bytes'] / gib:.2f}"],
    ]
    title = f"pagedllm bench sessions ({r.get('kv_policy', 'server at --base-url')})"
    return report.format_table(["", "value"], rows, title=title)


def _count(value: float | None) -> str:
    return "-" if value is None else str(round(value))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
