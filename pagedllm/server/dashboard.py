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
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedllm.kv.snapshot import snapshot_engine

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


def _capture(engine) -> object:
    """Runs on the engine thread: the snapshot and the copy targets since the previous one."""
    return snapshot_engine(engine, engine.block_manager.take_recent_writes())


class SnapshotSource:
    """Engine-thread snapshots shared by every open page: at most one per ``FEED_INTERVAL_S``."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._lock = asyncio.Lock()
        self._latest: dict | None = None
        self._latest_at = 0.0

    async def latest(self) -> dict:
        async with self._lock:
            if self._latest is None or time.monotonic() - self._latest_at >= FEED_INTERVAL_S:
                snapshot = await asyncio.wait_for(
                    self._engine.call_on_engine_thread(_capture), _CAPTURE_TIMEOUT_S
                )
                self._latest = snapshot.to_json()  # compression happens here, off the engine thread
                self._latest_at = time.monotonic()
            return self._latest


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
    """The feed of one page: hello, then a snapshot every FEED_INTERVAL_S (or as fast as the engine answers)."""
    yield _event("hello", {"settings": settings, "history": history.points(), "interval_s": FEED_INTERVAL_S})
    while True:
        start = time.monotonic()
        try:
            snapshot = await source.latest()
        except Exception as exc:  # engine stopped, or an engine that keeps no block manager
            yield _event("feed-error", {"message": f"no snapshot: {type(exc).__name__}: {exc}"})
            return
        yield _event("snapshot", {"snapshot": snapshot, "point": history.latest()})
        await asyncio.sleep(max(0.0, FEED_INTERVAL_S - (time.monotonic() - start)))


def install_dashboard(app: FastAPI, engine, api_key: str | None, unauthorized: Callable[[], object]) -> None:
    """Adds /dashboard and /dashboard/feed to ``app``; ``unauthorized()`` is the API's 401 response."""
    history = StatsHistory(engine.get_stats, lambda: engine.is_running)
    history.start()
    source = SnapshotSource(engine)
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
