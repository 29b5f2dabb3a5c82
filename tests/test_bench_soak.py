"""``pagedllm bench serve --duration``: the soak's arithmetic on synthetic sessions and samples,
and its run against an in-process app over the fake engine."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench import serve, soak
from pagedllm.bench.workloads import Workload
from pagedllm.errors import ConfigError

SETTINGS = soak.SoakSettings(duration_s=180, num_sessions=None, concurrency=4, disconnect_fraction=0.1,
                             bad_request_rate=1.0, metrics_interval_s=1.0)
WORKLOAD = Workload("w", [[1, 2, 3]], 4)


def test_summary_windows_drift_growth_and_leaks():
    state = soak.SoakState()
    # TTFT 100 ms in the first two minutes, 120 ms in the third; one hang-up, one failed good session
    for t in range(180):
        state.sessions.append(soak.Session(start_s=t, disconnect=False, ttft_s=0.1 if t < 120 else 0.12,
                                           output_tokens=4))
    state.sessions.append(soak.Session(start_s=5, disconnect=True, ttft_s=0.1))
    state.sessions.append(soak.Session(start_s=6, disconnect=False, error="HTTP 500"))
    state.samples = [{"t_s": t, "rss_bytes": (1000 if t < 60 else 2000 + t) * 2**20, "kv_used_blocks": 0,
                      "running": 0} for t in range(0, 180, 10)]
    state.bad_statuses = {"400": 7}
    result = soak.summarize_soak(state, SETTINGS, 180.0, {"kv_used_blocks": 3.0, "num_requests_running": 0.0},
                                 "m", WORKLOAD)
    assert [w["sessions"] for w in result["windows"]] == [60, 60, 60]
    assert result["ttft_p99_drift"] == pytest.approx(0.2)  # window 60-120 s against 120-180 s
    assert result["rss_growth_after_warmup"] == pytest.approx((2170 - 2060) / 2060)
    assert result["good_session_errors"] == 1 and result["disconnected_sessions"] == 1
    assert result["leaked_kv_blocks"] == 3.0 and result["bad_requests"] == 7
    assert not soak.soak_ok(result)
    assert "TTFT p99 drift" in soak.format_soak(result)


def test_every_bad_body_is_a_4xx_of_the_app():
    import asyncio

    import httpx
    from server_fixture import FakeEngine

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.server.app import build_app

    async def main():
        engine = AsyncLLMEngine(FakeEngine())
        app = build_app(engine)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                statuses = []
                for path, bodies in (("/v1/completions", soak.BAD_BODIES),
                                     ("/v1/chat/completions", soak.BAD_CHAT_BODIES)):
                    for body in bodies:
                        r = await client.post(path, content=body, headers={"content-type": "application/json"})
                        statuses.append(r.status_code)
                return statuses
        finally:
            await engine.shutdown(0)

    assert all(400 <= s < 500 for s in asyncio.run(main()))


def test_duration_needs_a_base_url():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--duration", "5", "--dataset", "random", "--num-prompts", "2", "--input-len", "4",
                              "--output-len", "2"])
    with pytest.raises(ConfigError, match="base-url"):
        serve.run(args)
