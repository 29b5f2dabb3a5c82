"""/dashboard in a real headless Chromium on a real ``pagedllm serve`` under load.

Chromium is Debian's ``chromium`` package; the set-up installs it when it is
missing and the tests run as root, and skips (saying why) where it cannot.
A screenshot of the page under load is written to ``$PAGEDLLM_TEST_ARTIFACTS``
(default: ``test-artifacts/`` in the repository).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from chromium_driver import Chromium, ensure_chromium
from server_fixture import REPO_ROOT, ServerProcess

from pagedllm.kv.snapshot import CellState, decode_field, unpack_cells

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 384
PROMPT = "Tell me a long story about a lighthouse keeper and the ships that pass by at night. " * 5


@pytest.fixture(scope="module")
def browser():
    path, why = ensure_chromium()
    if path is None:
        print(f"skipping the browser tests: {why}")
        pytest.skip(why)
    chromium = Chromium(path, width=1400, height=1000)
    yield chromium
    chromium.close()


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8").wait_ready()
    yield proc
    proc.stop()


def _load(base_url: str, errors: list) -> list[threading.Thread]:
    """Four requests of three samples each; two share their prompt (prefix-cache hits)."""
    def one(i: int) -> None:
        body = {"prompt": PROMPT if i < 2 else f"{PROMPT} ({i})", "max_tokens": 96, "n": 3,
                "temperature": 0.9, "seed": i, "ignore_eos": True}
        try:
            r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
        except Exception as exc:  # reported by the test, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # the second copy of the prompt finds the first one's blocks cached
    return threads


def _num(browser: Chromium, element_id: str) -> float:
    return float(browser.evaluate(f"document.getElementById({element_id!r}).textContent").replace("%", ""))


def _fresh_frame(browser: Chromium, timeout: float = 20.0) -> None:
    """Waits until the page has drawn two more snapshots than now."""
    frames = browser.evaluate("Number(document.body.dataset.frames || 0)")
    browser.wait_for(f"Number(document.body.dataset.frames || 0) >= {frames + 2}", timeout)


def test_live_page_under_load_matches_the_engine(browser, server):
    errors: list = []
    threads = _load(server.base_url, errors)
    browser.navigate(f"{server.base_url}/dashboard")
    # Shared cells appear while the n=3 requests run.
    browser.wait_for("Number(document.getElementById('count-shared')?.textContent || 0) > 0", timeout=120)
    grid = browser.evaluate("({...document.getElementById('grid').dataset})")
    assert int(grid["numBlocks"]) == NUM_KV_BLOCKS and int(grid["drawn"]) == NUM_KV_BLOCKS
    assert browser.evaluate("document.getElementById('setting-num_kv_blocks').textContent") == str(NUM_KV_BLOCKS)
    legend = sum(_num(browser, f"count-{s}") for s in ("free", "used", "reserved", "shared", "cached", "copied"))
    assert legend == NUM_KV_BLOCKS
    # The cells the page decoded agree with the engine's own counts in the same snapshot
    # (read in one evaluation: a frame arriving between two reads would pair different snapshots).
    same = browser.evaluate("""({...document.getElementById('grid').dataset,
        statShared: document.getElementById('stat-num_shared_blocks').textContent,
        statUsed: document.getElementById('stat-num_used_blocks').textContent})""")
    assert int(same["shared"]) == float(same["statShared"]) > 0
    assert int(same["used"]) == float(same["statUsed"])
    metrics = server.metrics()
    assert metrics["pagedllm:kv_shared_blocks"] > 0 and metrics["pagedllm:num_requests_running"] > 0

    # Hovering a shared cell names it; selecting a request lists its table and highlights it.
    cell = browser.evaluate("""(() => {
        const g = window.pagedllmDashboard.grid, i = Array.from(g.cells).findIndex(b => (b & 7) === 2);
        const [x, y] = g.center(i), r = g.canvas.getBoundingClientRect();
        return {i, x: r.left + x, y: r.top + y};
    })()""")
    browser.hover(cell["x"], cell["y"])
    tip = browser.wait_for("!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent")
    assert tip.startswith(f"block {cell['i']} · shared")
    browser.evaluate("document.querySelector('#requests .req').click()")
    table = browser.wait_for("document.getElementById('selected-table')?.textContent")
    blocks = [int(b) for b in table.split(" → ")]
    assert len(blocks) >= 1 and all(0 <= b < NUM_KV_BLOCKS for b in blocks)
    _fresh_frame(browser)
    browser.wait_for("window.pagedllmDashboard.points.length >= 8", timeout=60)  # some history to chart
    browser.hover(5, 5)  # the tooltip off the grid for the picture
    artifacts = os.environ.get("PAGEDLLM_TEST_ARTIFACTS", os.path.join(REPO_ROOT, "test-artifacts"))
    os.makedirs(artifacts, exist_ok=True)
    shot = os.path.join(artifacts, "dashboard-live.png")
    browser.screenshot(shot)
    print(f"screenshot: {shot}")
    assert os.path.getsize(shot) > 10_000

    for thread in threads:
        thread.join(600)
    assert not errors, errors
    # Idle: every figure on the page equals /metrics.
    metrics = server.wait_idle()
    _fresh_frame(browser)
    assert _num(browser, "stat-num_used_blocks") == 0 == metrics["pagedllm:kv_cache_usage_perc"]
    assert _num(browser, "count-free") + _num(browser, "count-cached") == NUM_KV_BLOCKS
    assert _num(browser, "stat-prefix_cache_hits") == metrics["pagedllm:prefix_cache_hits_total"] > 0
    assert _num(browser, "stat-prefix_cache_queries") == metrics["pagedllm:prefix_cache_queries_total"]
    assert _num(browser, "stat-num_generation_tokens_total") == metrics["pagedllm:generation_tokens_total"] == 4 * 3 * 96
    assert _num(browser, "stat-num_prompt_tokens_total") == metrics["pagedllm:prompt_tokens_total"]
    assert _num(browser, "stat-num_preemptions_total") == metrics["pagedllm:num_preemptions_total"]
    assert _num(browser, "queue-running") == metrics["pagedllm:num_requests_running"] == 0


def test_memory_audit_replay_page(browser, tmp_path, tiny_default_tokenizer_model):
    # The audit's KV pool, max_model_len and requests (random token ids, ignore_eos) do not depend
    # on the weights: conftest's 2-layer random Llama with the default model's tokenizer runs them.
    html = tmp_path / "replay.html"
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "memory", "--model", str(tiny_default_tokenizer_model),
           "--num-prompts", "4", "--output-len", "8",
           "--kv-tokens", "1024", "--policies", "paged,contiguous-max", "--no-sharing", "--no-warmup",
           "--html", str(html)]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True, timeout=900)
    text = html.read_text()
    data = json.loads(re.search(r'<script id="replay-data" type="application/json">(.*?)</script>', text, re.S)
                      .group(1).replace("<\\/", "</"))
    assert [run["name"] for run in data["runs"]] == ["paged", "contiguous-max"]
    for run in data["runs"]:
        assert len(run["frames"]) == len(run["points"]) > 1  # one frame per engine step (under 400 steps)
        for frame in run["frames"]:
            states, _ = unpack_cells(decode_field(frame["snapshot"]["device"]))
            in_use = np.isin(states, [CellState.USED, CellState.SHARED, CellState.COPIED, CellState.RESERVED])
            assert int(in_use.sum()) == frame["snapshot"]["counters"]["num_used_blocks"]

    browser.navigate(html.as_uri())
    browser.wait_for("document.getElementById('grid').dataset.numBlocks === '64'")
    assert browser.evaluate("document.getElementById('replay-run').options.length") == 2
    frames = data["runs"][1]["frames"]
    last = len(frames) - 1
    # contiguous-max reserves max_model_len per request: reserved cells show while one runs (not on the
    # step between two requests). Pick the frame nearest the middle that has some, by the data itself.
    reserved = [int((unpack_cells(decode_field(f["snapshot"]["device"]))[0] == CellState.RESERVED).sum())
                for f in frames]
    step = min((i for i in range(last) if reserved[i] > 0), key=lambda i: abs(i - last // 2))
    browser.evaluate(f"""(() => {{ const run = document.getElementById('replay-run'); run.value = '1';
        run.dispatchEvent(new Event('change'));
        const s = document.getElementById('replay-step'); s.value = '{step}';
        s.dispatchEvent(new Event('input')); return 1; }})()""")
    browser.wait_for(f"document.getElementById('replay-label').textContent.startsWith('step {step} ')")
    browser.wait_for(f"Number(document.getElementById('count-reserved').textContent) === {reserved[step]}")
    assert browser.evaluate("document.getElementById('replay-step').max") == str(last)
    browser.evaluate("document.getElementById('replay-play').click()")
    browser.wait_for(f"Number(document.getElementById('replay-step').value) > {step}")
