"""/dashboard and /dashboard/feed in process: access rules, the page, the feed's events and pace."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import uvicorn
from server_fixture import FakeEngine, free_port

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, SeqStatus, Sequence
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.snapshot import CellState, decode_field, unpack_cells
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.app import build_app
from pagedllm.server.dashboard import FEED_INTERVAL_S, render_page


def _fake_with_pool() -> FakeEngine:
    """The fake engine plus a real scheduler and block manager: one request, two samples sharing 2 blocks."""
    fake = FakeEngine()
    bm = BlockManager(24, 8, enable_prefix_caching=True, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    tokens = list(range(1, 21))
    request = Request("shared-req", None, tokens, SamplingParams(n=2, max_tokens=8), RequestMetrics(0.0))
    for seq_id in (1000, 1001):
        request.seqs.append(Sequence(prompt_len=20, token_ids=list(tokens), seq_id=seq_id))
    bm.allocate(1000, tokens)
    bm.fork(1000, 1001)
    request.status = SeqStatus.RUNNING
    scheduler.running.append(request)
    fake.block_manager, fake.scheduler = bm, scheduler
    return fake


def _with_app(fake, calls, **app_kwargs):
    """Runs ``calls(client)`` against the app served by uvicorn on a free port (streams need a real server)."""
    engine = AsyncLLMEngine(fake)
    app = build_app(engine, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            return calls(client)
    finally:
        server.should_exit = True
        thread.join(10)
        asyncio.run(engine.shutdown(0))


def _read_events(client, url: str, num_snapshots: int, headers=None) -> list[tuple[str, dict, float]]:
    events = []
    with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):]), time.monotonic()))
                if sum(1 for e in events if e[0] == "snapshot") >= num_snapshots or name == "feed-error":
                    break
    return events


def test_page_is_self_contained():
    page = render_page("live")
    assert "/*__JS__*/" not in page and "/*__CSS__*/" not in page and "__DATA__" not in page
    assert "DecompressionStream" in page and "<canvas id=\"grid\">" in page
    # Nothing is fetched from another host: no external script, style or font.
    assert "http://" not in page and "https://" not in page
    replay = render_page("replay", {"runs": [{"name": "</script><b>"}]})
    assert "</script><b>" not in replay and '<\\/script><b>' in replay


def test_feed_sends_hello_then_paced_snapshots_of_the_pool():
    def calls(client):
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        events = _read_events(client, "/dashboard/feed", num_snapshots=3)
        return events, client.get("/metrics").text

    events, metrics = _with_app(_fake_with_pool(), calls)
    cost = {
        name: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        for name in ("snapshots", "capture_seconds", "encode_seconds")
        if line.startswith(f"pagedllm:dashboard_{name}_total{{")
    }
    assert cost["snapshots"] == 3  # the feed's cost is on /metrics: one capture per snapshot sent
    assert 0 < cost["capture_seconds"] < 5 and 0 < cost["encode_seconds"] < 5
    names = [name for name, _, _ in events]
    assert names == ["hello", "snapshot", "snapshot", "snapshot"]
    hello = events[0][1]
    assert hello["settings"]["model"] == "fake-model" and hello["interval_s"] == FEED_INTERVAL_S
    snapshot = events[1][1]["snapshot"]
    states, refs = unpack_cells(decode_field(snapshot["device"]))
    assert snapshot["num_blocks"] == 24
    assert states[:3].tolist() == [CellState.SHARED] * 3 and refs[:3].tolist() == [2, 2, 2]
    assert np.all(states[3:] == CellState.FREE)
    assert snapshot["counters"]["num_shared_blocks"] == 3
    (request,) = snapshot["requests"]
    assert request["id"] == "shared-req" and request["status"] == "running" and request["n"] == 2
    tables = np.frombuffer(decode_field(snapshot["tables"]), dtype="<i4").tolist()
    assert tables == [0, 1, 2, 0, 1, 2]
    gaps = [b[2] - a[2] for a, b in zip(events[1:], events[2:])]
    assert min(gaps) >= FEED_INTERVAL_S * 0.8  # at most one snapshot per interval


def test_two_open_pages_share_captures():
    def calls(client):
        results = [None, None]

        def read(index):
            results[index] = _read_events(client, "/dashboard/feed", num_snapshots=3)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(30)
        return results, client.get("/metrics").text

    (first, second), metrics = _with_app(_fake_with_pool(), calls)
    for events in (first, second):
        assert [name for name, _, _ in events] == ["hello"] + ["snapshot"] * 3
    (line,) = [x for x in metrics.splitlines() if x.startswith("pagedllm:dashboard_snapshots_total{")]
    # 6 snapshots sent, at most 4 taken: the pages share captures (3 when they ask in step)
    assert 3 <= float(line.rsplit(" ", 1)[1]) <= 4


def test_feed_reports_an_engine_without_a_pool():
    def calls(client):
        return _read_events(client, "/dashboard/feed", num_snapshots=1)

    events = _with_app(FakeEngine(), calls)
    assert [name for name, _, _ in events] == ["hello", "feed-error"]
    assert "no snapshot" in events[1][1]["message"]


def test_api_key_rules_and_no_dashboard():
    def secured(client):
        bare = client.get("/dashboard")
        header = client.get("/dashboard", headers={"Authorization": "Bearer k3y"})
        query = client.get("/dashboard?api_key=k3y")
        wrong = client.get("/dashboard/feed?api_key=nope")
        return bare, header, query, wrong

    bare, header, query, wrong = _with_app(FakeEngine(), secured, api_key="k3y")
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert header.status_code == 200 and query.status_code == 200
    assert wrong.status_code == 401

    def off(client):
        return client.get("/dashboard").status_code, client.get("/dashboard/feed").status_code

    assert _with_app(FakeEngine(), off, dashboard=False) == (404, 404)


def test_engine_thread_calls_fail_alone():
    async def calls():
        engine = AsyncLLMEngine(FakeEngine())
        try:
            ok = await engine.call_on_engine_thread(lambda e: e.model_name)
            try:
                await engine.call_on_engine_thread(lambda e: 1 / 0)
            except ZeroDivisionError:
                failed = True
            else:
                failed = False
            return ok, failed, engine.is_running
        finally:
            await engine.shutdown(0)

    assert asyncio.run(calls()) == ("fake-model", True, True)
