"""``pagedllm bench``: tiny runs of every benchmark, checking JSON shapes and arithmetic.

No timing assertions: the figures depend on the machine; only counts, key
sets and orderings that hold by construction are pinned. The runs that load a
model use conftest's 2-layer random Llama with the default model's tokenizer
and chat template (every request is greedy or seeded and ``ignore_eos``, so
token counts do not depend on the weights): the harness is what is under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from pagedllm.bench import report, serve
from pagedllm.bench.memory import SlotCensus, summarize_censuses
from pagedllm.bench.throughput import engine_argv
from pagedllm.bench.workloads import (
    Workload,
    load_workload,
    parse_range,
    random_workload,
    warmup_prompts,
)
from pagedllm.cli import build_parser, main
from pagedllm.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THROUGHPUT_KEYS = {
    "backend", "dtype", "num_requests", "prompt_tokens", "output_tokens", "wall_s",
    "output_tokens_per_s", "total_tokens_per_s",
}


def _run_cli(args: list[str], tmp_path, name: str = "out.json") -> dict:
    out = tmp_path / name
    assert main(["bench", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


# ---- pure parts (no model) -------------------------------------------------------


def test_random_workload_is_reproducible_and_in_range(tmp_path):
    w = random_workload(5, (3, 7), 4, seed=11)
    assert w.num_requests == 5 and w.output_len == 4
    assert all(3 <= len(p) <= 7 for p in w.prompt_token_ids)
    assert all(0 <= t < 49152 for p in w.prompt_token_ids for t in p)
    assert random_workload(5, (3, 7), 4, seed=11).prompt_token_ids == w.prompt_token_ids
    assert w.num_prompt_tokens == sum(len(p) for p in w.prompt_token_ids)
    w.save(tmp_path / "w.json")
    again = load_workload(tmp_path / "w.json")
    assert again.prompt_token_ids == w.prompt_token_ids and again.output_len == 4
    assert load_workload(tmp_path / "w.json", output_len=9).output_len == 9
    assert load_workload(tmp_path / "w.json").subset(2).prompt_token_ids == w.prompt_token_ids[:2]


def test_warmup_prompts_respect_the_length_cap():
    assert [len(p) for p in warmup_prompts()] == [16, 64, 256]
    assert [len(p) for p in warmup_prompts(max_len=50)] == [16, 50, 50]


def test_parse_range():
    assert parse_range("32:512") == (32, 512)
    assert parse_range("8") == (8, 8)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range("9:3")


def test_percentile_and_table():
    assert report.percentile([1, 2, 3, 4], 50) == 2.5
    assert report.percentile([5], 99) == 5
    assert report.percentile(list(range(101)), 90) == 90
    table = report.format_table(["name", "x"], [["a", 1.5], ["bb", 10]])
    assert table.splitlines()[2].split() == ["a", "1.50"]


def test_census_summary_arithmetic():
    # 100 slots; step 1: 40 allocated, 30 holding, 6 future, 4 fragmented; step 2: nothing allocated
    censuses = [SlotCensus(100, 40, 30, 6, 2), SlotCensus(100, 0, 0, 0, 0)]
    s = summarize_censuses(censuses)
    assert s["utilization"] == pytest.approx(0.75)
    assert s["reserved_future"] == pytest.approx(0.15)
    assert s["internal_fragmentation"] == pytest.approx(0.10)
    b = s["budget_breakdown"]
    assert b["token_states"] == pytest.approx(0.15) and b["unused"] == pytest.approx(0.8)
    assert sum(b.values()) == pytest.approx(1.0)
    assert s["max_concurrent_seqs"] == 2 and s["num_steps"] == 2


def test_engine_argv_passes_only_changed_engine_flags():
    args = build_parser().parse_args(
        ["bench", "throughput", "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "1MiB",
         "--dtype", "bfloat16"]
    )
    argv = engine_argv(args)
    assert argv == ["--dtype", "bfloat16", "--block-size", "32", "--kv-cache-memory", str(2**20),
                    "--no-enable-prefix-caching"]
    again = build_parser().parse_args(["bench", "throughput", *argv])
    assert engine_argv(again) == argv


def _sse(chunks: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_serve_parses_streams_and_counts_errors():
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["prompt"][0] == 0:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(n - 1)]
        chunks.append({"choices": [{"index": 0, "text": "end", "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    workload = Workload("fake", [[1, 2, 3], [4, 5], [0, 9]], output_len=5)
    result = asyncio.run(
        serve.run_load("http://fake/v1", "m", workload, max_concurrency=2, transport=httpx.MockTransport(handler))
    )
    assert result["num_requests"] == 3 and result["completed"] == 2 and result["errors"] == 1
    assert "503" in result["error_samples"][0]
    assert result["output_tokens"] == 10 and result["prompt_tokens"] == 5
    assert set(result["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert result["itl_ms"] is not None and result["tpot_ms"] is not None
    assert "TTFT" in serve.format_result(result)


# ---- on the default model ------------------------------------------------------


def test_throughput_pagedllm_counts_tokens(tmp_path, tiny_default_tokenizer_model):
    data = _run_cli(
        ["throughput", "--model", str(tiny_default_tokenizer_model), "--dataset", "random", "--num-prompts", "3", "--input-len-range", "8:24",
         "--output-len", "4", "--num-kv-blocks", "64", "--seed", "5", "--no-warmup"],
        tmp_path,
    )
    workload = random_workload(3, (8, 24), 4, seed=5)
    assert THROUGHPUT_KEYS <= set(data)
    assert data["backend"] == "pagedllm" and data["dtype"] == "float32"
    assert data["num_requests"] == 3
    assert data["prompt_tokens"] == workload.num_prompt_tokens
    assert data["output_tokens"] == 3 * 4
    assert data["output_tokens_per_s"] == pytest.approx(data["output_tokens"] / data["wall_s"])
    assert data["total_tokens_per_s"] == pytest.approx((data["prompt_tokens"] + 12) / data["wall_s"])
    assert data["num_errors"] == 0
    (rank,) = data["rank_times"]  # one process: the worker's own times, no collectives
    assert rank["num_steps"] > 0 and 0 < rank["forward_seconds"] < data["wall_s"]
    assert rank["all_reduce"]["num_calls"] == 0


def test_latency_reports_per_token_gaps(tmp_path, tiny_default_tokenizer_model):
    data = _run_cli(
        ["latency", "--model", str(tiny_default_tokenizer_model), "--input-len", "16", "--output-len", "4", "--runs", "2", "--num-kv-blocks", "32", "--no-warmup"], tmp_path
    )
    assert data["num_runs"] == 2 and len(data["runs"]) == 2
    for run in data["runs"]:
        assert len(run["inter_token_s"]) == 3
        assert run["ttft_s"] > 0 and run["e2e_s"] >= run["ttft_s"]
        assert run["tpot_s"] == pytest.approx(sum(run["inter_token_s"]) / 3)
    assert data["ttft_s"]["min"] <= data["ttft_s"]["median"] <= data["ttft_s"]["max"]


@pytest.mark.slow
def test_memory_audit_orders_the_policies(tmp_path, tiny_default_tokenizer_model):
    data = _run_cli(
        ["memory", "--model", str(tiny_default_tokenizer_model), "--dataset", "random", "--num-prompts", "3", "--input-len-range", "90:120",
         "--output-len", "2", "--block-size", "8", "--kv-tokens", "2048", "--max-model-len", "512",
         "--no-sharing", "--no-warmup", "--plot", str(tmp_path / "mem.png")],
        tmp_path,
    )
    policies = data["policies"]
    assert set(policies) == {"paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"}
    util = {name: p["utilization"] for name, p in policies.items()}
    assert util["contiguous-oracle"] >= util["contiguous-pow2"] >= util["contiguous-max"]
    assert util["paged"] >= 0.9
    for p in policies.values():
        assert p["output_tokens"] == 6 and p["num_errors"] == 0
        assert sum(p["budget_breakdown"].values()) == pytest.approx(1.0)
        assert p["utilization"] + p["reserved_future"] + p["internal_fragmentation"] == pytest.approx(1.0)
        assert 1 <= p["max_concurrent_seqs"] <= 3
    # contiguous-max reserves max_model_len (512) for prompts of at most 122 tokens
    assert policies["contiguous-max"]["internal_fragmentation"] > 0.5
    assert data["kv_tokens"] == 2048 and data["max_model_len"] == 512
    assert (tmp_path / "mem.png").stat().st_size > 0


@pytest.mark.slow
def test_memory_sharing_saves_blocks(tmp_path, tiny_default_tokenizer_model):
    data = _run_cli(
        ["memory", "--model", str(tiny_default_tokenizer_model), "--dataset", "random", "--num-prompts", "2", "--input-len-range", "40:60",
         "--output-len", "3", "--kv-tokens", "2048", "--max-model-len", "256", "--policies", "paged", "--no-warmup",
         "--sharing-n", "2,4", "--sharing-beam", "2", "--sharing-plot", str(tmp_path / "share.png")],
        tmp_path,
    )
    sharing = data["sharing"]
    assert set(sharing["parallel"]) == {"2", "4"} and set(sharing["beam"]) == {"2"}
    for kind in ("parallel", "beam"):
        for entry in sharing[kind].values():
            assert "error" not in entry, entry
            assert entry["peak_blocks_with_sharing"] < entry["peak_blocks_without_sharing"]
            expected = 100 * (1 - entry["peak_blocks_with_sharing"] / entry["peak_blocks_without_sharing"])
            assert entry["saving_pct"] == pytest.approx(expected)
    assert sharing["parallel"]["4"]["saving_pct"] > sharing["parallel"]["2"]["saving_pct"]
    assert (tmp_path / "share.png").stat().st_size > 0


@pytest.mark.slow
def test_compare_pagedllm_with_hf(tmp_path, tiny_default_tokenizer_model):
    random_workload(2, (12, 20), 3, seed=2).save(tmp_path / "w2.json")
    data = _run_cli(
        ["throughput", "--model", str(tiny_default_tokenizer_model), "--workload", str(tmp_path / "w2.json"), "--compare", "pagedllm,hf",
         "--num-kv-blocks", "32", "--no-warmup", "--plot", str(tmp_path / "cmp.png")],
        tmp_path,
    )
    results = {r["backend"]: r for r in data["results"]}
    assert set(results) == {"pagedllm", "hf"}
    for r in results.values():
        assert THROUGHPUT_KEYS <= set(r)
        assert r["dtype"] == "float32" and r["num_requests"] == 2 and r["output_tokens"] == 6
    assert results["pagedllm"]["prompt_tokens"] == results["hf"]["prompt_tokens"]
    assert results["hf"]["hf_batch_size"] == 32
    assert (tmp_path / "cmp.png").stat().st_size > 0


def test_compare_entries_split_outside_brackets_and_parse_variants():
    from pagedllm.bench.throughput import _parse_spec, split_compare
    from pagedllm.errors import ConfigError

    assert split_compare("pagedllm, pagedllm[--a 1,2 --b x],vllm") == [
        "pagedllm", "pagedllm[--a 1,2 --b x]", "vllm"]
    assert _parse_spec("pagedllm@avx2") == ("pagedllm", "avx2", [])
    assert _parse_spec("pagedllm[--kv-cache-dtype int8]") == ("pagedllm", "", ["--kv-cache-dtype", "int8"])
    with pytest.raises(ConfigError, match="brackets"):
        _parse_spec("pagedllm[--x]y")


@pytest.mark.slow
def test_compare_variant_flags_reach_their_own_process(tmp_path, tiny_default_tokenizer_model):
    random_workload(2, (12, 20), 3, seed=2).save(tmp_path / "w2.json")
    data = _run_cli(
        ["throughput", "--model", str(tiny_default_tokenizer_model), "--workload", str(tmp_path / "w2.json"), "--no-warmup", "--num-kv-blocks", "32",
         "--compare", "pagedllm,pagedllm[--num-kv-blocks 48 --block-size 8]"],
        tmp_path,
    )
    results = {r["backend"]: r for r in data["results"]}
    assert set(results) == {"pagedllm", "pagedllm[--num-kv-blocks 48 --block-size 8]"}
    assert results["pagedllm"]["num_kv_blocks"] == 32 and results["pagedllm"]["block_size"] == 16
    variant = results["pagedllm[--num-kv-blocks 48 --block-size 8]"]
    assert variant["num_kv_blocks"] == 48 and variant["block_size"] == 8
    assert variant["output_tokens"] == results["pagedllm"]["output_tokens"] == 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def pagedllm_server(tiny_default_tokenizer_model):
    import httpx

    port = _free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--kv-cache-memory", "256MiB",
         "--model", str(tiny_default_tokenizer_model)],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
    )

    def output() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]

    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.skip(f"`pagedllm serve` is not runnable here (exit {proc.returncode}):\n{output()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.skip(f"`pagedllm serve` did not become healthy in 180 s:\n{output()}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_serve_against_a_pagedllm_server(tmp_path, pagedllm_server):
    data = _run_cli(
        ["serve", "--base-url", pagedllm_server, "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
         "--max-concurrency", "4"],
        tmp_path,
    )
    assert data["completed"] == 4 and data["errors"] == 0
    assert data["output_tokens"] == 16 and data["prompt_tokens"] == 64
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(data[key]) == {"mean", "p50", "p90", "p99"}
        assert data[key]["p50"] <= data[key]["p99"]
    assert data["ttft_ms"]["mean"] <= data["e2e_ms"]["mean"]
    # The server's own /metrics was read during the load.
    metrics = data["server_metrics"]
    assert metrics["num_samples"] >= 2 and metrics["preemptions"] == 0
    assert 0 <= metrics["peak_running"] <= 4 and 0 <= metrics["peak_kv_cache_usage"] <= 1


def _metrics_text(prefix: str, running: int, waiting: int, usage: float, preemptions: int) -> str:
    return "\n".join([
        f"# TYPE {prefix}:num_requests_running gauge",
        f'{prefix}:num_requests_running{{model_name="m"}} {running}',
        f"# TYPE {prefix}:num_requests_waiting gauge",
        f'{prefix}:num_requests_waiting{{model_name="m"}} {waiting}',
        f"# TYPE {prefix}:kv_cache_usage_perc gauge",
        f'{prefix}:kv_cache_usage_perc{{model_name="m"}} {usage}',
        f"# TYPE {prefix}:num_preemptions counter",
        f'{prefix}:num_preemptions_total{{model_name="m"}} {preemptions}',
        "",
    ])


@pytest.mark.parametrize("prefix", ["pagedllm", "vllm"])
def test_serve_samples_the_servers_metrics_during_the_load(prefix, monkeypatch):
    import httpx

    monkeypatch.setattr(serve, "METRICS_INTERVAL_S", 0.01)
    readings = iter([(0, 0, 0.0, 5), (3, 7, 0.42, 5), (8, 1, 0.97, 6), (2, 0, 0.5, 9)])
    last = [(0, 0, 0.0, 9)]

    async def slow_stream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            reading = next(readings, None) or last[0]
            return httpx.Response(200, text=_metrics_text(prefix, *reading))
        await asyncio.sleep(0.2)  # long enough for every reading above
        body = json.loads(request.content)
        chunks = _token_chunks(body["max_tokens"], "x", closing_chunk=False)
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    workload = Workload("fake", [[1, 2]], output_len=3)
    result = asyncio.run(serve.run_load("http://fake", "m", workload, transport=httpx.MockTransport(slow_stream)))
    assert result["completed"] == 1
    metrics = result["server_metrics"]
    assert metrics["peak_running"] == 8 and metrics["peak_waiting"] == 7
    assert metrics["peak_kv_cache_usage"] == 0.97
    assert metrics["preemptions"] == 4  # 5 when the load began, 9 after it


def test_serve_without_a_metrics_endpoint_reports_none():
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404, text="not here")
        chunks = _token_chunks(json.loads(request.content)["max_tokens"], "x", closing_chunk=False)
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    workload = Workload("fake", [[1, 2]], output_len=3)
    result = asyncio.run(serve.run_load("http://fake", "m", workload, transport=httpx.MockTransport(handler)))
    assert result["completed"] == 1 and result["server_metrics"] is None
    assert "peak running -" in serve.format_result({**result, "workload": "fake", "base_url": "http://fake"})


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_VLLM_PYTHON"), reason="set PAGEDLLM_VLLM_PYTHON to vLLM's python")
def test_throughput_vllm_peer(tmp_path):
    random_workload(2, (12, 20), 3, seed=2).save(tmp_path / "w2.json")
    data = _run_cli(["throughput", "--workload", str(tmp_path / "w2.json"), "--backend", "vllm"], tmp_path)
    assert data["backend"] == "vllm" and data["output_tokens"] == 6 and data["prompt_tokens"] > 0


def test_latency_compare_rejects_unknown_backends_and_missing_peer(capsys, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_VLLM_PYTHON", raising=False)
    assert main(["bench", "latency", "--compare", "pagedllm,tgi"]) == 2
    assert "choose from pagedllm, vllm" in capsys.readouterr().err
    assert main(["bench", "latency", "--compare", "pagedllm,vllm"]) == 2
    assert "--peer-python" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_VLLM_PYTHON"), reason="set PAGEDLLM_VLLM_PYTHON to vLLM's python")
def test_latency_vllm_peer(tmp_path):
    data = _run_cli(
        ["latency", "--compare", "pagedllm,vllm", "--input-len", "16", "--output-len", "4", "--runs", "2",
         "--num-kv-blocks", "32", "--no-warmup"],
        tmp_path,
    )
    ours, peer = data["results"]
    assert (ours["backend"], peer["backend"]) == ("pagedllm", "vllm")
    for result in (ours, peer):
        assert result["num_runs"] == 2
        for run in result["runs"]:
            assert len(run["inter_token_s"]) == 3 and run["e2e_s"] >= run["ttft_s"] > 0


# ---- bench serve --compare: servers started and stopped by the bench -------------------


def _stream_handler(chunks_for):
    """An httpx handler that streams ``chunks_for(body)`` as server-sent events."""
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        chunks = chunks_for(json.loads(request.content))
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    return handler


def _token_chunks(n: int, last_text: str, closing_chunk: bool) -> list[dict]:
    chunks = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(n - 1)]
    if closing_chunk:  # the last token, then a chunk that only says why the stream ends
        chunks.append({"choices": [{"index": 0, "text": last_text, "finish_reason": None}]})
        chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    else:  # the last token carries the finish reason (pagedllm and vLLM)
        chunks.append({"choices": [{"index": 0, "text": last_text, "finish_reason": "length"}]})
    return chunks


@pytest.mark.parametrize("closing_chunk", [False, True])
@pytest.mark.parametrize("with_usage", [False, True])
def test_serve_stamps_every_token_chunk_even_without_text(closing_chunk, with_usage):
    import httpx

    def chunks_for(body):
        n = body["max_tokens"]
        # the last token decodes to no text (part of a UTF-8 character) unless a closing chunk follows
        chunks = _token_chunks(n, "" if not closing_chunk else "end", closing_chunk)
        if with_usage:
            chunks.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n}})
        return chunks

    workload = Workload("fake", [[1, 2], [3, 4]], output_len=6)
    result = asyncio.run(
        serve.run_load("http://fake", "m", workload, transport=httpx.MockTransport(_stream_handler(chunks_for)))
    )
    assert result["completed"] == 2 and result["errors"] == 0
    if with_usage or closing_chunk:
        # usage tells an empty last token from a closing chunk; without usage an empty
        # last chunk counts as a closing one
        assert result["token_chunks"] == 12 and result["output_tokens"] == 12
        assert result["min_output_tokens"] == result["max_output_tokens"] == 6
    else:
        assert result["token_chunks"] == 10 and result["output_tokens"] == 10


def test_serve_compare_settings_reach_both_servers_alike(monkeypatch):
    from pagedllm.bench import peers

    args = build_parser().parse_args(
        ["bench", "serve", "--compare", "pagedllm,vllm", "--dtype", "bfloat16", "--kv-cache-memory", "1GiB",
         "--no-enable-prefix-caching", "--max-num-seqs", "8"]
    )
    workload = random_workload(2, (300, 300), 10, seed=3)
    settings = serve.settings_from_args(args, workload)
    assert settings.max_model_len == 512  # 310 tokens, rounded up to 256
    assert settings.kv_cache_bytes == 2**30 and settings.dtype == "bfloat16"
    assert settings.max_num_batched_tokens == 2048 and not settings.enable_prefix_caching

    ours = serve.pagedllm_server_command(settings, "127.0.0.1", 8123)
    served = build_parser().parse_args(ours[ours.index("serve"):])
    assert (served.dtype, served.max_model_len, served.kv_cache_memory) == ("bfloat16", 512, 2**30)
    assert (served.max_num_seqs, served.max_num_batched_tokens) == (8, 2048)
    assert served.enable_prefix_caching is False and served.port == 8123
    assert served.served_model_name == settings.served_model_name

    theirs = peers.vllm_server_command("/peer/python", "/models/smol", settings, "127.0.0.1", 8124)

    def flag(name: str) -> str:
        return theirs[theirs.index(name) + 1]

    assert flag("--dtype") == "bfloat16" and flag("--max-model-len") == "512"
    assert flag("--kv-cache-memory-bytes") == str(2**30)
    assert flag("--max-num-seqs") == "8" and flag("--max-num-batched-tokens") == "2048"
    assert flag("--served-model-name") == settings.served_model_name and flag("--port") == "8124"
    assert "--no-enable-prefix-caching" in theirs and "--enable-prefix-caching" not in theirs
    # the whole-GiB setting would override --kv-cache-memory-bytes
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    env = peers.vllm_server_env()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"


def test_serve_compare_rejects_bad_choices(capsys, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_VLLM_PYTHON", raising=False)
    assert main(["bench", "serve", "--compare", "pagedllm,tgi"]) == 2
    assert "choose from pagedllm, vllm" in capsys.readouterr().err
    assert main(["bench", "serve", "--compare", "pagedllm,pagedllm"]) == 2
    assert main(["bench", "serve", "--compare", "vllm", "--num-prompts", "1"]) == 2
    assert "--peer-python" in capsys.readouterr().err
    assert main(["bench", "serve"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["bench", "serve", "--compare", "pagedllm", "--base-url", "http://x"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "serve", "--compare", "pagedllm", "--input-len", "300", "--max-model-len", "256"]) == 2
    assert "longest request" in capsys.readouterr().err


def _is_running(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _pids_with_argument(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and _is_running(int(entry)):
                pids.append(int(entry))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
def test_server_process_kills_its_whole_group_when_the_server_never_answers(tmp_path):
    from pagedllm.errors import ConfigError

    child_pid_file = tmp_path / "child.pid"
    # a "server" that never listens, with a child that ignores SIGTERM
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
        f"open({str(child_pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('listening nowhere', flush=True)\n"
        "time.sleep(300)\n"
    )
    launch = serve.ServerLaunch([sys.executable, "-c", script], dict(os.environ), str(tmp_path))
    server = serve.ServerProcess("fake", launch, stop_grace_s=2.0)
    with pytest.raises(ConfigError, match="did not answer") as excinfo:
        with server:
            server.wait_ready(f"http://127.0.0.1:{_free_port()}", "m", timeout_s=3.0)
    assert "listening nowhere" in str(excinfo.value)
    child_pid = int(child_pid_file.read_text())
    assert not _is_running(server.pgid) and not _is_running(child_pid)
    assert serve.live_group_members(server.pgid) == []


def test_server_process_reports_an_early_exit(tmp_path):
    from pagedllm.errors import ConfigError

    script = "import sys; print('no weights here'); sys.exit(3)"
    launch = serve.ServerLaunch([sys.executable, "-c", script], dict(os.environ), str(tmp_path))
    with pytest.raises(ConfigError, match="exited with code 3") as excinfo:
        with serve.ServerProcess("fake", launch) as server:
            server.wait_ready(f"http://127.0.0.1:{_free_port()}", "m", timeout_s=60.0)
    assert "no weights here" in str(excinfo.value)


def _check_compare_rows(data: dict, servers: list[str], workload: Workload) -> None:
    import httpx

    assert [r["backend"] for r in data["results"]] == servers
    assert data["settings"]["max_model_len"] == 256 and data["env"]["commit"]
    for row in data["results"]:
        assert row["completed"] == workload.num_requests and row["errors"] == 0
        assert row["min_output_tokens"] == row["max_output_tokens"] == workload.output_len
        assert row["output_tokens"] == workload.num_output_tokens
        assert row["prompt_tokens"] == workload.num_prompt_tokens
        assert row["token_chunks"] == workload.num_output_tokens
        assert row["model"] == data["settings"]["served_model_name"]
        assert row["startup_s"] > 0 and row["server_version"]
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["duration_s"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert row[key]["p50"] <= row[key]["p99"]
        # the server and every process it started are gone
        port = row["base_url"].rsplit(":", 1)[1]
        assert _pids_with_argument(f"--port {port}") == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{row['base_url']}/v1/models", timeout=5)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks for leftover processes in /proc")
def test_serve_compare_starts_runs_and_stops_a_pagedllm_server(tmp_path, tiny_default_tokenizer_model):
    data = _run_cli(
        ["serve", "--model", str(tiny_default_tokenizer_model), "--compare", "pagedllm", "--num-prompts", "3", "--input-len-range", "12:20", "--output-len", "4",
         "--kv-cache-memory", "64MiB", "--no-warmup", "--markdown", str(tmp_path / "serve.md")],
        tmp_path,
    )
    _check_compare_rows(data, ["pagedllm"], random_workload(3, (12, 20), 4, seed=0))
    assert data["settings"]["kv_cache_bytes"] == 64 * 2**20
    table = (tmp_path / "serve.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| pagedllm | float32 | 3 / 3 |")


@pytest.mark.slow
def test_sigterm_to_the_bench_stops_the_servers_it_started(tmp_path, tiny_default_tokenizer_model):
    """`timeout` or `kill` ending a bench must not leave its pagedllm serve running."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--model", str(tiny_default_tokenizer_model),
         "--compare", "pagedllm", "--num-prompts", "200",
         "--input-len-range", "12:20", "--output-len", "64", "--kv-cache-memory", "64MiB", "--no-warmup",
         "--server-log-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        server_pid = None
        deadline = time.monotonic() + 120
        while server_pid is None and time.monotonic() < deadline:  # the server's own log says it is up
            logs = list(tmp_path.glob("*.log"))
            if logs and "Uvicorn running" in logs[0].read_text(errors="replace"):
                server_pid = _child_pids(bench.pid)[0]
            time.sleep(0.5)
        assert server_pid is not None, "the bench's server did not come up"
        bench.terminate()
        assert bench.wait(timeout=90) != 0
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived the bench"
    finally:
        bench.kill()
        bench.wait()


def _child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_VLLM_PYTHON"), reason="set PAGEDLLM_VLLM_PYTHON to vLLM's python")
def test_serve_compare_with_vllm_server(tmp_path):
    data = _run_cli(
        ["serve", "--compare", "pagedllm,vllm", "--num-prompts", "3", "--input-len-range", "12:20",
         "--output-len", "4", "--kv-cache-memory", "256MiB"],
        tmp_path,
    )
    _check_compare_rows(data, ["pagedllm", "vllm"], random_workload(3, (12, 20), 4, seed=0))
    assert data["results"][1]["server_command"].split()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def _tiny_serve_launch(model, launched: list[int]):
    """launch_on for serve.start_server: ``pagedllm serve`` of ``model`` on the port asked for."""

    def launch_on(port: int) -> serve.ServerLaunch:
        launched.append(port)
        command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
                   "--max-model-len", "64", "--num-kv-blocks", "16", "--host", "127.0.0.1", "--port", str(port)]
        return serve.ServerLaunch(command, dict(os.environ), REPO_ROOT)

    return launch_on


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks for leftover processes in /proc")
def test_a_server_whose_port_is_taken_before_it_binds_starts_on_another(tiny_default_tokenizer_model):
    """free_port() closes its probe, so the port can be gone when the server binds it: every
    bench that starts a server (serve --compare, sessions, arms) retries on a new port."""
    import httpx

    launched: list[int] = []
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server, base_url, startup_s = serve.start_server(
            "tiny serve", _tiny_serve_launch(tiny_default_tokenizer_model, launched), "tiny", 120.0, port=taken)
        with server:  # entering a started server does not start another
            assert launched[0] == taken and len(launched) == 2 and launched[1] != taken
            assert base_url == f"http://127.0.0.1:{launched[1]}" and startup_s > 0
            assert httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
            assert len(_pids_with_argument(f"--port {launched[1]}")) == 1
    assert _pids_with_argument(f"--port {launched[1]}") == []
    assert _pids_with_argument(f"--port {taken}") == []


def test_a_server_that_fails_for_another_reason_is_not_retried(tmp_path):
    launched: list[int] = []
    with pytest.raises(ConfigError, match="exited with code"):
        serve.start_server("bad serve", _tiny_serve_launch(tmp_path / "no-such-model", launched), "tiny", 60.0)
    assert len(launched) == 1
