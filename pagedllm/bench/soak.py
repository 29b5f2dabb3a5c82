"""``pagedllm bench serve --duration S``: a soak of a running server.

For ``S`` seconds (or until ``--num-sessions`` sessions have started),
``--max-concurrency`` clients each run streaming sessions back to back: a
greedy completion of a workload prompt, read to its end, except that a
``--disconnect-fraction`` of the sessions hang up after their first token.
Beside them one client sends bad requests (``--bad-request-rate`` per second,
drawn from :data:`BAD_BODIES`) that must be answered 4xx.

The server's ``/metrics`` is read every ``--metrics-interval`` seconds:
resident memory (``process_resident_memory_bytes``), KV blocks in use and
requests running. At the end the soak waits for the server to go idle and
reads what is still held: a block in use then is a leaked block.

Reported: errors of the good sessions, bad requests that were not 4xx,
resident memory over time and its growth after the first minute (the warm-up:
allocator pools, compiled kernels), and TTFT per one-minute window with the
p99 drift from the first full window to the last.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from pagedllm.bench import report
from pagedllm.bench.serve import sse_chunks
from pagedllm.bench.workloads import Workload

WARMUP_S = 60.0
WINDOW_S = 60.0

# Bodies a public endpoint receives; each must be answered 4xx, never 5xx.
BAD_BODIES: tuple[bytes, ...] = (
    b'{"prompt": "hi", "n": 100000}',
    b'{"prompt": "hi", "seed": 100000000000000000000000}',
    b'{"prompt": [-1, 5]}',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "hi", "logit_bias": {"5": 1000}}',
    b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "max_tokens": 100000000}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "hi", "use_beam_search": true, "n": 1000}',
    b"{not json",
    b'["an", "array"]',
)
BAD_CHAT_BODIES: tuple[bytes, ...] = (
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": []}',
    b'{"messages": [{"role": "user", "content": 5}]}',
)


@dataclass(frozen=True)
class SoakSettings:
    """Duration and session mix; times in seconds."""

    duration_s: float
    num_sessions: int | None
    concurrency: int
    disconnect_fraction: float
    bad_request_rate: float
    metrics_interval_s: float
    idle_timeout_s: float = 120.0


@dataclass
class Session:
    start_s: float  # since the soak began
    disconnect: bool
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class SoakState:
    sessions: list[Session] = field(default_factory=list)
    bad_statuses: dict[str, int] = field(default_factory=dict)
    bad_failures: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


async def _session(client, url: str, payload: dict, session: Session, t0: float) -> None:
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                session.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    session.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    session.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if chunk.get("choices") and session.ttft_s is None:
                    session.ttft_s = time.perf_counter() - sent
                    if session.disconnect:
                        return  # leaving the block closes the connection mid-stream
        if session.ttft_s is None:
            session.error = "the stream ended without a token"
    except Exception as exc:  # a soak records failures and carries on
        session.error = f"{type(exc).__name__}: {exc}"


async def _bad_requests(client, base: str, rate: float, end: float, rng: random.Random, state: SoakState) -> None:
    bodies = [("/v1/completions", b) for b in BAD_BODIES] + [("/v1/chat/completions", b) for b in BAD_CHAT_BODIES]
    while time.perf_counter() < end:
        path, body = rng.choice(bodies)
        try:
            r = await client.post(f"{base}{path}", content=body, headers={"content-type": "application/json"})
            key = str(r.status_code)
            if not 400 <= r.status_code < 500:
                state.bad_failures.append(f"{path} {body[:60]!r} -> {r.status_code}: {r.text[:120]}")
        except Exception as exc:  # noqa: BLE001
            key = type(exc).__name__
            state.bad_failures.append(f"{path} {body[:60]!r} -> {key}: {exc}")
        state.bad_statuses[key] = state.bad_statuses.get(key, 0) + 1
        await asyncio.sleep(rng.expovariate(rate))


async def _read_metrics(client, url: str) -> dict[str, float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(url)
        if response.status_code != 200:
            return None
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                values[sample.name.rsplit(":", 1)[-1]] = sample.value
        return values
    except Exception:  # noqa: BLE001 - no usable metrics
        return None


async def _sample(client, url: str, interval: float, t0: float, done: asyncio.Event, state: SoakState) -> None:
    while not done.is_set():
        values = await _read_metrics(client, url)
        if values is not None:
            state.samples.append({
                "t_s": time.perf_counter() - t0,
                "rss_bytes": values.get("process_resident_memory_bytes"),
                "kv_used_blocks": values.get("kv_used_blocks"),
                "running": values.get("num_requests_running"),
            })
        try:
            await asyncio.wait_for(done.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def _wait_idle(client, url: str, timeout_s: float) -> dict[str, float] | None:
    deadline = time.perf_counter() + timeout_s
    values = None
    while time.perf_counter() < deadline:
        values = await _read_metrics(client, url)
        if values is None:
            return None
        if not values.get("num_requests_running") and not values.get("num_requests_waiting") and not values.get(
            "kv_used_blocks", values.get("kv_cache_usage_perc")
        ):
            return values
        await asyncio.sleep(0.5)
    return values


async def run_soak(
    base_url: str, model: str | None, workload: Workload, settings: SoakSettings,
    api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0,
) -> dict:
    import httpx

    base = base_url.rstrip("/").removesuffix("/v1")
    pool = settings.concurrency + 4
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    state = SoakState()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=60.0), headers=headers) as client:
        if model is None:
            model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        end = t0 + settings.duration_s
        done = asyncio.Event()
        sampler = asyncio.create_task(_sample(client, f"{base}/metrics", settings.metrics_interval_s, t0, done, state))
        bad = None
        if settings.bad_request_rate > 0:
            bad = asyncio.create_task(_bad_requests(client, base, settings.bad_request_rate, end, rng, state))

        def next_session() -> tuple[Session, dict] | None:
            started = len(state.sessions)
            if time.perf_counter() >= end or (settings.num_sessions is not None and started >= settings.num_sessions):
                return None
            session = Session(start_s=time.perf_counter() - t0, disconnect=rng.random() < settings.disconnect_fraction)
            state.sessions.append(session)
            payload = {
                "model": model, "prompt": workload.prompt_token_ids[started % workload.num_requests],
                "max_tokens": workload.output_len, "temperature": 0.0, "stream": True,
                "ignore_eos": workload.ignore_eos, "stream_options": {"include_usage": True},
            }
            return session, payload

        async def worker() -> None:
            while (item := next_session()) is not None:
                await _session(client, f"{base}/v1/completions", item[1], item[0], t0)

        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
        wall_s = time.perf_counter() - t0
        if bad is not None:
            bad.cancel()
        at_end = await _wait_idle(client, f"{base}/metrics", settings.idle_timeout_s)
        done.set()
        await sampler
    return summarize_soak(state, settings, wall_s, at_end, model, workload)


def _p99_ms(values: list[float]) -> float | None:
    return 1000.0 * report.percentile(values, 99) if values else None


def summarize_soak(state: SoakState, settings: SoakSettings, wall_s: float, at_end, model, workload) -> dict:
    good = [s for s in state.sessions if not s.disconnect]
    dropped = [s for s in state.sessions if s.disconnect]
    errors = [s.error for s in state.sessions if s.error is not None]
    windows = []
    num_windows = max(1, int(wall_s // WINDOW_S) + (1 if wall_s % WINDOW_S else 0))
    for w in range(num_windows):
        ttfts = [s.ttft_s for s in good if s.ttft_s is not None and w * WINDOW_S <= s.start_s < (w + 1) * WINDOW_S]
        rss = [x["rss_bytes"] for x in state.samples if x["rss_bytes"] and w * WINDOW_S <= x["t_s"] < (w + 1) * WINDOW_S]
        windows.append({"start_s": w * WINDOW_S, "sessions": len(ttfts), "ttft_p99_ms": _p99_ms(ttfts),
                        "ttft_p50_ms": 1000.0 * report.percentile(ttfts, 50) if ttfts else None,
                        "rss_max_mib": max(rss) / 2**20 if rss else None})
    full = [w for w in windows if w["ttft_p99_ms"] is not None and w["start_s"] + WINDOW_S <= wall_s]
    # The first full window after the warm-up minute, against the last full window.
    after_warmup = [w for w in full if w["start_s"] >= WARMUP_S] or full
    drift = None
    if len(after_warmup) >= 2:
        first, last = after_warmup[0]["ttft_p99_ms"], after_warmup[-1]["ttft_p99_ms"]
        drift = (last - first) / first
    rss_series = [(x["t_s"], x["rss_bytes"]) for x in state.samples if x["rss_bytes"]]
    growth = None
    baseline = [r for t, r in rss_series if t >= min(WARMUP_S, wall_s / 2)]
    if baseline:
        growth = (max(baseline) - baseline[0]) / baseline[0]
    leaked = None
    if at_end is not None:
        leaked = at_end.get("kv_used_blocks")
    return {
        "model": model,
        "workload": workload.describe(),
        "duration_s": settings.duration_s,
        "wall_s": wall_s,
        "concurrency": settings.concurrency,
        "sessions": len(state.sessions),
        "good_sessions": len(good),
        "disconnected_sessions": len(dropped),
        "good_session_errors": sum(1 for s in good if s.error is not None),
        "disconnect_errors": sum(1 for s in dropped if s.error is not None),
        "error_samples": errors[:5],
        "output_tokens": sum(s.output_tokens for s in good),
        "bad_requests": sum(state.bad_statuses.values()),
        "bad_request_statuses": dict(sorted(state.bad_statuses.items())),
        "bad_requests_not_4xx": len(state.bad_failures),
        "bad_request_failure_samples": state.bad_failures[:5],
        "rss_start_mib": rss_series[0][1] / 2**20 if rss_series else None,
        "rss_end_mib": rss_series[-1][1] / 2**20 if rss_series else None,
        "rss_growth_after_warmup": growth,
        "ttft_p99_drift": drift,
        "leaked_kv_blocks": leaked,
        "running_at_end": at_end.get("num_requests_running") if at_end else None,
        "windows": windows,
        "rss_samples": [{"t_s": round(t, 1), "rss_mib": round(r / 2**20, 1)} for t, r in rss_series],
    }


def format_soak(result: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    lines = [
        f"Soak of {result['model']}: {result['wall_s']:.0f} s, {result['sessions']} sessions "
        f"({result['disconnected_sessions']} hung up after the first token), concurrency {result['concurrency']}",
        f"good sessions: {result['good_sessions']}, errors {result['good_session_errors']}; "
        f"disconnect sessions with errors: {result['disconnect_errors']}",
        f"bad requests: {result['bad_requests']} {result['bad_request_statuses']}, not 4xx: {result['bad_requests_not_4xx']}",
        f"resident memory: {result['rss_start_mib'] or 0:.0f} -> {result['rss_end_mib'] or 0:.0f} MiB, "
        f"growth after the first minute {pct(result['rss_growth_after_warmup'])}",
        f"TTFT p99 drift (first full window after warm-up -> last): {pct(result['ttft_p99_drift'])}",
        f"leaked KV blocks after idle: {result['leaked_kv_blocks']}, running: {result['running_at_end']}",
    ]
    rows = [[w["start_s"], w["sessions"], w["ttft_p50_ms"], w["ttft_p99_ms"], w["rss_max_mib"]] for w in result["windows"]]
    lines.append(report.format_table(["window start s", "good sessions", "TTFT p50 ms", "TTFT p99 ms", "RSS max MiB"], rows))
    lines += [f"  error: {e}" for e in result["error_samples"]]
    lines += [f"  bad request: {e}" for e in result["bad_request_failure_samples"]]
    return "\n".join(lines)


def soak_ok(result: dict) -> bool:
    return (
        result["good_session_errors"] == 0
        and result["bad_requests_not_4xx"] == 0
        and not result["leaked_kv_blocks"]
        and not result["running_at_end"]
    )
