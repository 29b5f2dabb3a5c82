"""What a long-running server keeps: nothing per request once it is done, and bounded caches.

- no Request or Sequence survives its request, and every per-request table of
  the engine, the step builder, the worker and the async front end forgets it
  (forked samples that finish on their first token, beams, best_of, aborts and
  refused requests included);
- oneDNN's shape-keyed primitive caches are capped (they grew the process by
  gigabytes under a serving load of varied batch sizes);
- the KV pools can be made resident at start-up (``pagedllm serve`` does), so
  the process does not grow block by block as the pools are first written.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_server_fuzz import make_tiny_llama

from pagedllm.cli import build_parser, engine_config_from_args
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sequence import Request, Sequence
from pagedllm.errors import ConfigError, RequestError
from pagedllm.layers import dispatch
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-memory")
    make_tiny_llama(directory)
    return directory


def _engine(tiny_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8, max_num_seqs=8,
    ))


def _first_wave() -> list[tuple[str, dict, SamplingParams | BeamSearchParams]]:
    """Requests whose sequences end in every way there is."""
    def prompt(*ids):
        return {"prompt_token_ids": list(ids)}

    wave = [  # n samples that all finish on the token that forks them
        (f"fork-{i}", prompt(5 + i, 6, 7, 8, 9), SamplingParams(n=3, max_tokens=1, seed=i, temperature=1.0))
        for i in range(4)
    ]
    wave += [
        ("best-of", prompt(3, 4, 5), SamplingParams(n=2, best_of=3, max_tokens=5, seed=1, temperature=1.0)),
        ("beam", prompt(3, 4, 5, 6), BeamSearchParams(beam_width=3, max_tokens=5)),
        ("logprobs", prompt(10, 11, 12), SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=1)),
        ("stop", prompt(20, 21), SamplingParams(max_tokens=8, stop=["t5"], seed=3, temperature=1.0)),
        ("aborted", prompt(30, 31, 32), SamplingParams(n=2, max_tokens=20, seed=4, temperature=1.0)),
        ("aborted-waiting", prompt(40, 41), SamplingParams(max_tokens=20)),
    ]
    return wave


def _run(engine: LLMEngine, requests, abort_after_steps: dict[str, int] | None = None) -> None:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    abort_after_steps = dict(abort_after_steps or {})
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        for rid in [r for r, n in abort_after_steps.items() if n == step]:
            engine.abort_request(rid)
            del abort_after_steps[rid]


def _alive(kind: type) -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is kind]


class _Survivors:
    """Objects of a type that were created after this baseline and are still alive.

    Objects alive at the baseline (left by earlier tests in the same process) are held
    here, so their ids stay theirs while the test runs."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self._baseline = _alive(kind)
        self._baseline_ids = {id(o) for o in self._baseline}

    def __call__(self) -> list:
        return [o for o in _alive(self.kind) if id(o) not in self._baseline_ids]


def _per_sequence_state(engine: LLMEngine) -> dict[str, set[int]]:
    """The sequence ids every per-sequence table of the step builder and the worker holds."""
    steps, worker = engine.steps, engine.worker
    return {
        "steps._tables": set(steps._tables),
        "steps._sampled_at": set(steps._sampled_at),
        "steps.fork_ids": set(steps.fork_ids) | {c for cs in steps.fork_ids.values() for c in cs},
        "steps._unscheduled_samples": set(steps._unscheduled_samples),
        "worker.batch.seqs": set(worker.batch.seqs),
        "worker._generators": set(worker._generators),
        "block_manager._seqs": set(engine.block_manager._seqs),
    }


def test_no_request_state_survives_finished_aborted_and_refused_requests(tiny_dir):
    new_requests, new_seqs = _Survivors(Request), _Survivors(Sequence)
    engine = _engine(tiny_dir)
    with pytest.raises(RequestError):
        engine.add_request("refused", {"prompt_token_ids": [1, 10**6]}, SamplingParams())
    wave = _first_wave()
    # max_num_seqs=8 keeps "aborted-waiting" queued when it is aborted.
    _run(engine, wave, abort_after_steps={"aborted": 3, "aborted-waiting": 1})
    assert not engine.requests and not engine.has_unfinished_requests()
    assert new_requests() == [] and new_seqs() == []
    seq_ids = set().union(*_per_sequence_state(engine).values())  # the worker still holds the last step's
    assert seq_ids

    # The worker hears of freed sequences with the next step: after a second
    # wave, nothing of the first is left anywhere.
    _run(engine, [(f"second-{i}", {"prompt_token_ids": [9, 9, 9]}, SamplingParams(max_tokens=2)) for i in range(2)])
    assert new_requests() == [] and new_seqs() == []
    for table, ids in _per_sequence_state(engine).items():
        assert not ids & seq_ids, f"{table} still holds first-wave sequences {sorted(ids & seq_ids)}"
        assert len(ids) <= 2, f"{table} holds {sorted(ids)} after two single-sequence requests"
    assert engine.steps.num_tracked_seqs() <= 2
    engine.block_manager.check_invariants()
    assert engine.block_manager.stats().num_used_blocks == 0


def test_a_parent_freed_before_its_samples_fork_takes_their_ids_along(tiny_dir):
    """The worker drew for the samples of a step whose results were never processed."""
    engine = _engine(tiny_dir)
    engine.add_request("n4", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=4, max_tokens=3, seed=0))
    out = engine.scheduler.schedule()
    step = engine.steps.build(out)
    children = engine.steps.fork_ids[engine.requests["n4"].seqs[0].seq_id]
    engine.executor.execute(step)  # the worker keeps a generator per sample
    assert set(children) <= set(engine.worker._generators)
    engine.abort_request("n4")  # before process(): the samples never fork
    engine.add_request("next", {"prompt_token_ids": [9, 9]}, SamplingParams(max_tokens=1))
    engine.step()
    assert not set(children) & set(engine.worker._generators)
    assert not engine.steps.fork_ids and not engine.steps._unscheduled_samples


def test_async_engine_forgets_streams_closed_early_failed_and_finished(tiny_dir):
    new_requests = _Survivors(Request)

    async def main() -> tuple[AsyncLLMEngine, list]:
        engine = AsyncLLMEngine(_engine(tiny_dir))
        params = SamplingParams(max_tokens=6, ignore_eos=True)

        async def read_all(rid: str) -> None:
            async for _ in engine.generate(rid, {"prompt_token_ids": [7, 8, 9]}, params):
                pass

        async def hang_up(rid: str) -> None:  # a client that leaves after its first chunk
            async for _ in engine.generate(rid, {"prompt_token_ids": [7, 8]}, params):
                break

        async def refused(rid: str) -> None:
            with pytest.raises(RequestError):
                await engine.add_request(rid, {"prompt_token_ids": [-1]}, params)

        jobs = [read_all(f"full-{i}") for i in range(6)]
        jobs += [hang_up(f"gone-{i}") for i in range(6)]
        jobs += [refused(f"bad-{i}") for i in range(3)]
        await asyncio.gather(*jobs)
        for _ in range(200):  # the engine thread applies the last aborts between steps
            if not engine.engine.has_unfinished_requests() and not engine._active:
                break
            await asyncio.sleep(0.05)
        state = [engine._open, engine._active, engine._timings, engine.engine.requests]
        await engine.shutdown(drain_timeout=0.0)
        return engine, state

    engine, tables = asyncio.run(main())
    assert [len(t) for t in tables] == [0, 0, 0, 0]
    assert engine.num_unfinished_requests == 0
    assert new_requests() == []
    assert engine.engine.block_manager.stats().num_used_blocks == 0


# ---- oneDNN's primitive caches -----------------------------------------------

_GROWTH_SCRIPT = textwrap.dedent("""
    import json, torch
    from pagedllm.layers.linear import dense_matmul

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    torch.set_num_threads(1)
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        layers = [(k, torch.randn(n, k, generator=gen)) for k, n in ((576, 960), (576, 3072), (1536, 576))]
        matmuls = [(k, w, dense_matmul(w)) for k, w in layers]
        packed = all(type(m).__name__ == "_PackedMatmul" for _, _, m in matmuls)
        for k, w, m in matmuls:
            m(torch.randn(1, k), w, None)
        start = rss_mib()
        for rows in range(2, 202):  # 200 batch sizes x 3 weight shapes: 600 primitives
            for k, w, m in matmuls:
                m(torch.randn(rows, k), w, None)
        print(json.dumps({"packed": packed, "growth_mib": rss_mib() - start}))
""")


def _growth_mib(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in dispatch.ONEDNN_CACHE_ENV}
    env.update(extra_env, PYTHONPATH=REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_onednn_caches_stay_small_over_hundreds_of_batch_sizes():
    if not dispatch.onednn_linear_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linear")
    bounded = _growth_mib({})
    unbounded = _growth_mib({name: "1024" for name in dispatch.ONEDNN_CACHE_ENV})  # oneDNN's default
    assert bounded["packed"] and unbounded["packed"]
    # Measured: about 58 MiB against 380 MiB (0.5 MiB per cached primitive at these sizes).
    assert bounded["growth_mib"] < 120, bounded
    assert unbounded["growth_mib"] > 2 * bounded["growth_mib"], (bounded, unbounded)


def test_a_cache_capacity_the_user_set_is_kept(monkeypatch):
    for name in dispatch.ONEDNN_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    settings = dispatch.bound_onednn_caches()
    assert settings == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(dispatch.ONEDNN_CACHE_CAPACITY),
                        "LRU_CACHE_CAPACITY": "7"}
    with pytest.raises(ValueError, match=">= 1"):
        dispatch.bound_onednn_caches(0)


# ---- the KV pools at start-up ------------------------------------------------

def _resident_fraction(tensors: list[torch.Tensor]) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for t in tensors:
        start = t.data_ptr() - t.data_ptr() % page
        length = t.data_ptr() + t.numel() * t.element_size() - start
        pages = (length + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
        resident += sum(b & 1 for b in bytes(vec))
        total += pages
    return resident / total


_PREFAULT_SCRIPT = """
import ctypes, os, sys, torch
from pagedllm.kv.kv_cache import KVCache

{resident_fraction}

# 40 MiB a tensor: above glibc's largest mmap threshold, so each is a fresh mapping in a fresh process
shape = dict(num_layers=1, num_blocks=5120, block_size=16, num_kv_heads=2, head_dim=64)
kv = KVCache(**shape, dtype=torch.float32, device="cpu", num_cpu_blocks=5120, prefault=sys.argv[1] == "1")
tensors = kv.block_tensors() + kv.cpu_block_tensors()
print(_resident_fraction(tensors), all(not t.any() for t in tensors))
"""


@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_makes_the_kv_pools_resident_at_start(prefault):
    # A fresh process: in a long one, freed heap memory that earlier work touched can serve the pools.
    script = _PREFAULT_SCRIPT.format(resident_fraction=inspect.getsource(_resident_fraction))
    out = subprocess.run([sys.executable, "-c", script, "1" if prefault else "0"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    fraction, all_zero = float(out[0]), out[1] == "True"
    if prefault:
        assert fraction == 1.0 and all_zero
    else:
        assert fraction < 0.05  # untouched pools are not resident yet


def test_serve_prefaults_the_kv_pools_and_the_offline_commands_do_not():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).kv_cache_prefault is True
    assert engine_config_from_args(parser.parse_args(["serve", "--no-kv-cache-prefault"])).kv_cache_prefault is False
    assert engine_config_from_args(parser.parse_args(["generate", "hi"])).kv_cache_prefault is False
    assert EngineConfig().kv_cache_prefault is False
    with pytest.raises(ConfigError, match="kv_cache_prefault"):
        EngineConfig(kv_cache_prefault="yes")


@pytest.mark.slow
def test_a_real_server_is_at_its_full_size_from_the_start_and_serves(tiny_dir):
    """``pagedllm serve`` with a 256 MiB pool: resident from start-up by default, not with the opt-out."""
    import httpx
    from server_fixture import ServerProcess

    num_blocks = 32768  # x 8 KiB a block for this model (2 layers, 2 KV heads of 16, fp32) = 256 MiB
    common = ("--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", str(num_blocks),
              "--max-num-seqs", "8", "--served-model-name", "m")
    servers = {"prefault": ServerProcess(*common), "lazy": ServerProcess(*common, "--no-kv-cache-prefault")}
    try:
        rss = {name: s.wait_ready().metrics()["process_resident_memory_bytes"] for name, s in servers.items()}
        assert rss["prefault"] - rss["lazy"] > 0.9 * 256 * 2**20, rss
        server = servers["prefault"]
        body = {"model": "m", "prompt": "t3 t4 t5", "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
            for i in range(6):
                with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if i % 2 and line.startswith("data: {"):
                            break  # hang up after the first chunk
            assert client.post("/v1/completions", json={**body, "n": 10**6}).status_code == 400
        idle = server.wait_idle()
        assert idle["pagedllm:kv_used_blocks"] == 0
        assert idle["process_resident_memory_bytes"] - rss["prefault"] < 64 * 2**20
    finally:
        for s in servers.values():
            s.stop()
