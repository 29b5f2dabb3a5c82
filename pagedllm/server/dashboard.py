"""``GET /dashboard``: a live map of the KV cache; ``GET /dashboard/feed``: its data.

The page is one self-contained HTML file (its CSS and JS are inlined from
``pagedllm/server/static``; nothing is fetched from elsewhere). The feed is
server-sent events: a ``hello`` event (engine settings, the last minutes of
history), then a ``snapshot`` event at most every ``FEED_INTERVAL_S``: the
packed pools and requests of :mod:`pagedllm.kv.snapshot` plus the newest
history point.

Cost to the engine: a snapshot is taken on the engine thread between two
steps, only while some page is open, at most once per interval however many
pages are open (they share it). The history is sampled once a second from
the stats the engine thread already publishes, so it costs the engine nothing.

Access follows the API's rule: with an API key, send it as
``Authorization: Bearer <key>`` or open ``/dashboard?api_key=<key>`` (the
page passes it on to the feed, since EventSource cannot send headers).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.kv.snapshot import snapshot_engine
from pagedllm.server.metrics import PREFIX

logger = logging.getLogger("pagedllm.server")

FEED_INTERVAL_S = 0.25  # snapshots reach a page at most this often
HISTORY_INTERVAL_S = 1.0
HISTORY_POINTS = 300  # five minutes at one point a second
_CAPTURE_TIMEOUT_S = 30.0  # a prefill step can be long; a stopped engine never answers

SETTING_KEYS = (
    "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
    "preemption_mode", "kv_policy", "num_headroom_tokens", "swap_space", "attention_backend",
    "async_scheduling", "enforce_eager",
)


# ---- the page --------------------------------------------------------------------


def _static(name: str) -> str:
    return resources.files("pagedllm.server").joinpath("static", name).read_text(encoding="utf-8")


def render_page(mode: str = "live", data: dict | None = None) -> str:
    """The dashboard as one HTML document; ``mode`` "replay" embeds ``data`` (see bench memory --html)."""
    page = _static("dashboard.html")
    # </ inside the embedded JSON must not end its script element early.
    embedded = json.dumps(data if data is not None else {}, separators=(",", ":")).replace("</", "<\\/")
    return (
        page.replace("/*__CSS__*/", _static("dashboard.css"))
        .replace("__MODE__", mode)
        .replace("__DATA__", embedded)
        .replace("/*__JS__*/", _static("dashboard.js"))
    )


# ---- history -----------------------------------------------------------------------


def history_point(stats, previous, now: float, dt: float) -> dict:
    """One time-series point from an EngineStats, with rates over ``dt`` seconds since ``previous``."""
    kv = stats.kv
    held = kv.num_slots_holding_tokens + kv.num_slots_saved_by_sharing
    point = {
        "t": now,
        "kv_usage": kv.usage,
        "shared_saving": kv.num_slots_saved_by_sharing / held if held else 0.0,
        "batch_size": getattr(stats, "num_running_seqs", stats.num_running_reqs),
        "running": stats.num_running_reqs,
        "waiting": stats.num_waiting_reqs,
        "swapped": stats.num_swapped_reqs,
        "prefix_hit_rate": None,
        "preemptions": 0,
        "gen_tok_s": 0.0,
        # the prefix cache's tiers below the device (host, disk): what they hold, what they served
        "tiers": {
            t.name: {"blocks": t.num_blocks, "bytes": t.num_bytes, "hit_tokens": t.num_hit_tokens}
            for t in getattr(kv, "tiers", ())
        },
    }
    if previous is not None and dt > 0:
        queries = kv.prefix_cache_queries - previous.kv.prefix_cache_queries
        hits = kv.prefix_cache_hits - previous.kv.prefix_cache_hits
        point["prefix_hit_rate"] = hits / queries if queries > 0 else None
        point["preemptions"] = stats.num_preemptions_total - previous.num_preemptions_total
        point["gen_tok_s"] = (stats.num_generation_tokens_total - previous.num_generation_tokens_total) / dt
    return point


class StatsHistory:
    """The last ``HISTORY_POINTS`` points, sampled by a daemon thread while the engine runs."""

    def __init__(self, stats_source: Callable[[], object], is_running: Callable[[], bool]) -> None:
        self._stats_source = stats_source
        self._is_running = is_running
        self._points: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self._lock = threading.Lock()
        self._previous = None
        self._previous_time = 0.0
        self._thread = threading.Thread(target=self._run, name="pagedllm-dashboard-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> dict:
        stats, now = self._stats_source(), time.time()
        point = history_point(stats, self._previous, now, now - self._previous_time)
        self._previous, self._previous_time = stats, now
        with self._lock:
            self._points.append(point)
        return point

    def points(self) -> list[dict]:
        with self._lock:
            return list(self._points)

    def latest(self) -> dict | None:
        with self._lock:
            return self._points[-1] if self._points else None

    def _run(self) -> None:
        while self._is_running():
            try:
                self.sample()
            except Exception:  # a broken stats source must not kill the server
                logger.exception("dashboard history sample failed")
            time.sleep(HISTORY_INTERVAL_S)


# ---- snapshots -------------------------------------------------------------------


def _capture(engine) -> tuple[object, float]:
    """Runs on the engine thread: (the snapshot and the copy targets since the previous one,
    the seconds the engine thread spent on it)."""
    start = time.perf_counter()
    snapshot = snapshot_engine(engine, engine.block_manager.take_recent_writes())
    return snapshot, time.perf_counter() - start


@dataclass
class SnapshotCost:
    """What the feed has cost so far: ``capture_s`` on the engine thread (the engine steps
    not at all meanwhile), ``encode_s`` on the server's event loop (packing and compressing;
    it holds the interpreter lock part of that time). Exported on ``/metrics``."""

    num_snapshots: int = 0
    capture_s: float = 0.0
    encode_s: float = 0.0


class SnapshotSource:
    """Engine-thread snapshots shared by every open page: at most one per ``FEED_INTERVAL_S``.

    Snapshots are numbered from 1; a page asks for the first one newer than the one it
    sent last, so it never receives the same snapshot twice, and pages that ask within
    one interval share a capture.
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self._lock = asyncio.Lock()
        self._latest: dict | None = None
        self._latest_number = 0
        self._latest_at = -FEED_INTERVAL_S  # monotonic time of the latest capture's start
        self.cost = SnapshotCost()

    async def newer_than(self, number: int) -> tuple[int, dict]:
        """(its number, the packed snapshot) of the first snapshot numbered above ``number``,
        taken now or once the interval since the previous capture has passed."""
        async with self._lock:
            if self._latest is not None and self._latest_number > number:
                return self._latest_number, self._latest
            await asyncio.sleep(max(0.0, self._latest_at + FEED_INTERVAL_S - time.monotonic()))
            self._latest_at = time.monotonic()
            snapshot, capture_s = await asyncio.wait_for(
                self._engine.call_on_engine_thread(_capture), _CAPTURE_TIMEOUT_S
            )
            start = time.perf_counter()
            self._latest = snapshot.to_json()  # compression happens here, off the engine thread
            self.cost.encode_s += time.perf_counter() - start
            self.cost.capture_s += capture_s
            self.cost.num_snapshots += 1
            self._latest_number += 1
            return self._latest_number, self._latest


class SnapshotCostCollector(Collector):
    """``pagedllm:dashboard_*`` counters from a :class:`SnapshotCost`, read at scrape time."""

    def __init__(self, cost: SnapshotCost, model_name: str) -> None:
        self._cost = cost
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        figures = (
            ("dashboard_snapshots", "Snapshots the dashboard feed has taken.", self._cost.num_snapshots),
            ("dashboard_capture_seconds", "Engine-thread seconds spent taking dashboard snapshots.",
             self._cost.capture_s),
            ("dashboard_encode_seconds", "Event-loop seconds spent packing dashboard snapshots.",
             self._cost.encode_s),
        )
        for name, doc, value in figures:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family


def engine_settings(engine) -> dict:
    """What the page lists under "Engine settings": resolved sizes first, then the config."""
    inner = getattr(engine, "engine", engine)  # the LLMEngine behind an AsyncLLMEngine
    config = engine.config
    kv_cache = getattr(inner, "kv_cache", None)
    settings = {
        "model": engine.model_name,
        "device": str(getattr(inner, "device", "")),
        "dtype": str(getattr(inner, "dtype", config.dtype)).replace("torch.", ""),
        "num_kv_blocks": getattr(kv_cache, "num_blocks", config.num_kv_blocks),
        "num_cpu_blocks": getattr(kv_cache, "num_cpu_blocks", 0),
    }
    for key in SETTING_KEYS:
        settings[key] = getattr(config, key, None)
    settings["max_model_len"] = engine.max_model_len
    settings["async_scheduling"] = getattr(inner, "async_scheduling", config.async_scheduling)
    backend = getattr(inner, "attn_backend", None)
    if backend is not None:
        settings["attention_backend"] = backend.name
    scheduler = getattr(inner, "scheduler", None)
    if scheduler is not None:
        settings["max_num_batched_tokens"] = scheduler.config.max_num_batched_tokens
    return settings


# ---- routes ------------------------------------------------------------------------


def _authorized(request: Request, api_key: str | None) -> bool:
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return True
    given = request.query_params.get("api_key")
    return given is not None and hmac.compare_digest(given.encode(), api_key.encode())


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def feed_events(source: SnapshotSource, history: StatsHistory, settings: dict) -> AsyncIterator[str]:
    """The feed of one page: hello, then a new snapshot every FEED_INTERVAL_S (or as fast as the engine answers)."""
    yield _event("hello", {"settings": settings, "history": history.points(), "interval_s": FEED_INTERVAL_S})
    number = 0
    while True:
        try:
            number, snapshot = await source.newer_than(number)
        except Exception as exc:  # engine stopped, or an engine that keeps no block manager
            yield _event("feed-error", {"message": f"no snapshot: {type(exc).__name__}: {exc}"})
            return
        yield _event("snapshot", {"snapshot": snapshot, "point": history.latest()})


def install_dashboard(
    app: FastAPI, engine, api_key: str | None, unauthorized: Callable[[], object],
    registry: CollectorRegistry | None = None,
) -> None:
    """Adds /dashboard and /dashboard/feed to ``app``; ``unauthorized()`` is the API's 401 response.
    With ``registry`` (the app's /metrics), the feed's cost is exported there."""
    history = StatsHistory(engine.get_stats, lambda: engine.is_running)
    history.start()
    source = SnapshotSource(engine)
    if registry is not None:
        registry.register(SnapshotCostCollector(source.cost, engine.model_name))
    page = render_page("live")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        if not _authorized(request, api_key):
            return unauthorized()
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/feed", include_in_schema=False)
    async def dashboard_feed(request: Request):
        if not _authorized(request, api_key):
            return unauthorized()
        events = feed_events(source, history, engine_settings(engine))
        return StreamingResponse(
            events, media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
