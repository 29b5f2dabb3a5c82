"""Prometheus metrics with vLLM's names under a ``pagedllm:`` prefix.

Engine-level figures (queue sizes, KV usage, token and prefix-cache totals)
are read from the engine's latest stats snapshot at scrape time by a custom
collector, so they can never drift from the engine's own counts. Request
latencies are histograms fed by the async engine's observer hook.

Each app gets its own :class:`CollectorRegistry`, so several apps (tests) can
live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Gauges and counters computed from ``stats_source()`` (an EngineStats) at scrape time."""

    def __init__(self, stats_source: Callable[[], object], model_name: str) -> None:
        self._stats_source = stats_source
        self._model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        kv = stats.kv
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats.num_running_reqs)
        yield self._gauge(
            "num_requests_running_peak",
            "The most requests in the running batch at once since the server started (exact, per step).",
            getattr(stats, "peak_num_running_reqs", stats.num_running_reqs),
        )
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting_reqs)
        yield self._gauge("num_requests_swapped", "Requests swapped out to CPU.", stats.num_swapped_reqs)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = all).", kv.usage)
        yield self._gauge("kv_used_blocks", "KV blocks held by requests (cached free blocks excluded).", kv.num_used_blocks)
        yield self._gauge("kv_shared_blocks", "KV blocks referenced by more than one sequence.", kv.num_shared_blocks)
        yield self._gauge(
            "kv_slots_holding_tokens_ratio",
            "Fraction of the token slots of used KV blocks that hold a token.",
            kv.slot_utilization,
        )
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", kv.prefix_cache_hits)
        yield from _tier_metrics(kv, self._model_name)
        yield self._counter("num_preemptions", "Cumulative number of preemptions.", _preemptions(stats))
        yield self._counter("prompt_tokens", "Prompt tokens processed.", stats.num_prompt_tokens_total)
        yield self._counter("generation_tokens", "Generation tokens produced.", stats.num_generation_tokens_total)


def _tier_metrics(kv, model_name: str) -> Iterator[Metric]:
    """Per tier of the prefix cache below the device (host, disk), labelled ``tier``."""
    tiers = getattr(kv, "tiers", ())
    labels = ["model_name", "tier"]
    families = [
        (CounterMetricFamily, "kv_tier_hits", "Prompt tokens served from this tier of the prefix cache.",
         lambda t: t.num_hit_tokens),
        (GaugeMetricFamily, "kv_tier_blocks", "KV blocks this tier holds.", lambda t: t.num_blocks),
        (GaugeMetricFamily, "kv_tier_bytes", "Bytes of KV this tier holds.", lambda t: t.num_bytes),
        (CounterMetricFamily, "kv_tier_read_bytes", "Bytes of KV read from this tier.", lambda t: t.num_read_bytes),
        (CounterMetricFamily, "kv_tier_written_bytes", "Bytes of KV written to this tier.",
         lambda t: t.num_written_bytes),
    ]
    for family_type, name, doc, value in families:
        family = family_type(PREFIX + name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier.name], value(tier))
        yield family
    seconds = CounterMetricFamily(PREFIX + "kv_tier_seconds", "Seconds spent reading or writing this tier.",
                                  labels=[*labels, "op"])
    for tier in tiers:
        seconds.add_metric([model_name, tier.name, "read"], tier.read_seconds)
        seconds.add_metric([model_name, tier.name, "write"], tier.write_seconds)
    yield seconds


def _preemptions(stats) -> int:
    total = getattr(stats, "num_preemptions_total", None)
    return total if total is not None else stats.kv.num_preemptions


class ServerMetrics:
    """The registry of one app; also the async engine's RequestObserver (thread-safe)."""

    def __init__(self, stats_source: Callable[[], object], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats_source, model_name))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open fds
        labels = ["model_name"]
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token, from request arrival.",
            labels, registry=self.registry, buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
            labels, registry=self.registry, buckets=ITL_BUCKETS,
        ).labels(model_name)
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
            labels, registry=self.registry, buckets=E2E_BUCKETS,
        ).labels(model_name)

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_inter_token(self, seconds: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self._itl.observe(seconds)

    def on_finished(self, e2e_seconds: float) -> None:
        self._e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
