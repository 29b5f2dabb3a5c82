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
from pagedllm.bench.workloads import Workload, add_workload_arguments, workload_from_args


@dataclass
class RequestRecord:
    """One request's timings in seconds since it was sent."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _is_token_chunk(chunk: dict) -> bool:
    """A chunk that carries generated text (the usage-only and final empty chunks do not)."""
    choices = chunk.get("choices") or []
    return any(c.get("text") or c.get("finish_reason") is None for c in choices)


async def send_request(client, url: str, payload: dict, record: RequestRecord) -> RequestRecord:
    """POST one streaming completion and time its chunks into ``record``."""
    start = time.perf_counter()
    last = None
    num_chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if not _is_token_chunk(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
                num_chunks += 1
        record.e2e_s = time.perf_counter() - start
        record.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        if record.ttft_s is None:
            record.error = "the stream ended without a token"
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
) -> dict:
    """Send the workload; ``transport`` replaces the network (an ``httpx.AsyncBaseTransport``, for tests)."""
    import httpx

    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    pool = max_concurrency or workload.num_requests
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
        tasks = [asyncio.create_task(one(i)) async for i in arrival_times(workload.num_requests, request_rate, seed)]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(records, duration, model, workload, request_rate, max_concurrency)


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
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": _stats([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itl_s]),
        "e2e_ms": _stats([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("--request-rate must be > 0 (or inf)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s, Poisson arrivals; inf = all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds a request may take")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_workload_arguments(parser, default_workload=False, default_num_prompts=32, default_output_len=None, with_seed=True)


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    print(workload.describe(), file=sys.stderr)
    result = asyncio.run(
        run_load(
            args.base_url, args.model, workload, args.request_rate, args.max_concurrency,
            args.api_key, args.seed, args.timeout,
        )
    )
    result["workload"] = workload.describe()
    result["base_url"] = args.base_url
    print(format_result(result))
    if args.json:
        report.write_json(args.json, result)
    return 0 if result["errors"] == 0 else 1


def format_result(result: dict) -> str:
    rows = []
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)")):
        s = result[key]
        rows.append([label, *(s[k] if s else None for k in ("mean", "p50", "p90", "p99"))])
    table = report.format_table(["metric", "mean", "p50", "p90", "p99"], rows)
    summary = (
        f"Serving {result['model']}: {result['completed']}/{result['num_requests']} requests ok, "
        f"{result['errors']} errors, rate {result['request_rate']}, "
        f"max concurrency {result['max_concurrency'] or 'unlimited'}\n"
        f"duration {result['duration_s']:.2f} s; {result['request_throughput']:.2f} req/s; "
        f"output {result['output_tokens_per_s']:.1f} tok/s; total {result['total_tokens_per_s']:.1f} tok/s"
    )
    errors = "".join(f"\n  error: {e}" for e in result["error_samples"])
    return f"{summary}\n{table}{errors}"
