"""Tensor parallelism over torch.distributed (gloo on the CPU): TP=2 against TP=1, and failures.

The oracle is the single-process engine on the same model in float32: greedy
tokens must be equal. Both tests start real worker processes
(torch.multiprocessing) and are slow.
"""

from __future__ import annotations

import os
import signal
import time
from fractions import Fraction

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.distributed import (
    ALL_REDUCE_ENV,
    SHARED_HEADS_ENV,
    head_shard,
    split_row,
    step_head_rows,
)
from pagedllm.errors import ConfigError, EngineDeadError
from pagedllm.native import quant_ops

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of three fruits: apple,",
    "In 1969, the first humans to walk on the Moon were",
]


def _llm(tp: int, **options) -> LLM:
    options.setdefault("kv_cache_memory", 64 * 2**20)
    options.setdefault("quantization", "none")  # dense shards; the packed ones have their own test below
    return LLM(dtype="float32", device="cpu", tensor_parallel_size=tp, **options)


def _run(llm: LLM) -> list:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    samples = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12), use_tqdm=False)
    shared = llm.generate([PROMPTS[2] + " banana,"] * 2, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    beams = llm.beam_search([PROMPTS[3]], BeamSearchParams(beam_width=3, max_tokens=10))
    llm.llm_engine.block_manager.check_invariants()
    return [
        [o.outputs[0].token_ids for o in greedy],
        [c.token_ids for c in samples[0].outputs],
        [o.outputs[0].token_ids for o in shared],
        [c.token_ids for c in beams[0].outputs],
    ]


def test_head_shards_cover_every_head_once_or_replicate_kv(monkeypatch):
    # SmolLM2: 9 query heads over 3 KV heads, on 2 ranks: the middle KV head held by both, its
    # rows split at half the step's attention work
    shards = [head_shard(9, 3, 2, r) for r in range(2)]
    assert [(s.q_start, s.num_q, s.kv_start, s.num_kv) for s in shards] == [(0, 6, 0, 2), (3, 6, 1, 2)]
    assert [s.rows for s in shards] == [((0, 1), (0, Fraction(1, 2))), ((Fraction(1, 2), 1), (0, 1))]
    # 8 KV heads over 3 ranks: spans of 8/3 heads, each cut head split between two neighbours
    shards = [head_shard(32, 8, 3, r) for r in range(3)]
    for h in range(8):
        parts = sorted((lo, hi) for s in shards for k, (lo, hi) in enumerate(s.rows) if s.kv_start + k == h)
        assert parts[0][0] == 0 and parts[-1][1] == 1 and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    # whole heads (PAGEDLLM_TP_SHARED_HEADS=0): whole KV groups, uneven
    monkeypatch.setenv(SHARED_HEADS_ENV, "0")
    shards = [head_shard(9, 3, 2, r) for r in range(2)]
    assert [(s.q_start, s.num_q, s.kv_start, s.num_kv) for s in shards] == [(0, 3, 0, 1), (3, 6, 1, 2)]
    assert not any(s.splits_rows for s in shards)
    monkeypatch.setenv(SHARED_HEADS_ENV, "yes")
    with pytest.raises(ConfigError, match=SHARED_HEADS_ENV):
        head_shard(9, 3, 2, 0)
    monkeypatch.delenv(SHARED_HEADS_ENV)
    # more ranks than KV heads: each KV head replicated, its query heads split
    shards = [head_shard(8, 2, 4, r) for r in range(4)]
    assert [(s.q_start, s.num_q, s.kv_start) for s in shards] == [(0, 2, 0), (2, 2, 0), (4, 2, 1), (6, 2, 1)]
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        head_shard(9, 3, 4, 0)


def test_split_rows_follow_the_attention_work():
    # decode rows: a row's work is its keys plus a block's worth (16)
    assert split_row([100, 100, 100, 100], [1, 1, 1, 1], Fraction(1, 2)) == 2
    assert split_row([300, 20, 20], [1, 1, 1], Fraction(1, 2)) == 1  # the long row alone is half
    assert split_row([5, 5], [1, 1], Fraction(0)) == 0 and split_row([5, 5], [1, 1], Fraction(1)) == 2
    # a prefill chunk splits inside the sequence: its later rows see more keys
    row = split_row([64], [64], Fraction(1, 2))
    work = [16 + 1 + j for j in range(64)]
    assert sum(work[:row]) >= sum(work) / 2 > sum(work[: row - 1])
    # a step: every rank derives the same split; rank 0 computes the shared head before it
    shards = [head_shard(9, 3, 2, r) for r in range(2)]
    steps = [step_head_rows(shards, r, 3, 64, [40, 90, 7, 200], [1, 1, 7, 1]) for r in range(2)]
    split = steps[0].overlaps[0]
    assert steps[1].overlaps == (split,) and 0 < split < 10
    assert steps[0].head_rows == ((0, 10), (0, split)) and steps[1].head_rows == ((split, 10), (0, 10))
    assert steps[0].columns == ((192, 384, 0, split),) and steps[1].columns == ((0, 192, split, 10),)
    x = torch.ones(10, 384)
    steps[0].zero_unowned(x)
    assert x[:, :192].eq(1).all() and x[:split, 192:].eq(1).all() and x[split:, 192:].eq(0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_qkv_projects_a_shared_heads_queries_for_its_rows_only(packed):
    """Rank 1 of 2 over 3 KV heads holds KV heads 1-2 and computes head 1's attention for rows
    [split, T): those rows of its queries equal the whole projection's, the others are zero, and
    every other column is the whole projection's."""
    from pagedllm.distributed import TensorParallelGroup
    from pagedllm.layers import QKVParallelLinear
    from pagedllm.quant import quantize_rtn
    from pagedllm.quant.layers import QuantizedLinearMethod

    torch.manual_seed(0)
    tp = TensorParallelGroup(rank=1, size=2)
    dense = torch.randn(6 * 8 + 2 * 2 * 8, 64)
    method = QuantizedLinearMethod(quantize_rtn(dense, 4, 32)) if packed else None
    layer = QKVParallelLinear(64, 8, 9, 3, bias=True, tp=tp, method=method)
    if not packed:
        layer.weight.data.copy_(dense)
    layer.bias.data.copy_(torch.randn(layer.output_size))
    layer.bind(torch.device("cpu"), torch.float32)
    assert layer.shared_q == [(0, 0, 24)]
    x = torch.randn(10, 64)
    whole, split = layer(x), layer.forward_rows(x, ((4, 10), (0, 10)))
    # packed: each output's float sequence is fixed, so the bits; dense: oneDNN may block a
    # matrix of other rows differently
    same = torch.equal if packed else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    assert same(split[4:, :24], whole[4:, :24]) and split[:4, :24].eq(0).all()
    assert same(split[:, 24:], whole[:, 24:])
    assert not same(split[:4, :24], whole[:4, :24])  # (the zeros are not the projection's values)
    assert torch.equal(layer.forward_rows(x, None), whole)


def test_each_rank_takes_its_share_of_the_cores_this_process_may_use(monkeypatch):
    from pagedllm.worker.executor import _threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert _threads_per_rank(2) == 3  # the mask's 6 cores, not the machine's 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)
    assert _threads_per_rank(2) == 1


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_on_the_default_model():
    tp2 = _llm(2)
    try:
        assert tp2.llm_engine.async_scheduling is False  # the default with TP, which does not run it
        got = _run(tp2)
        times = tp2.llm_engine.executor.rank_times(reset=True)
        assert tp2.llm_engine.executor.rank_times()[1].num_steps == 0  # reset on every rank
        # a small cache forces preemption by recompute on every rank alike
        tight = _llm(1, kv_cache_memory=None, num_kv_blocks=10, max_num_seqs=4, num_headroom_tokens=0)
        want = _run(tight)
    finally:
        tp2.llm_engine.shutdown()
    assert got == want
    # every rank ran every step: two all-reduces per layer plus the embedding's, one logits gather
    num_layers = 30
    assert [t.rank for t in times] == [0, 1]
    assert times[0].num_steps == times[1].num_steps > 0
    for t in times:
        assert t.all_reduce.num_calls == (2 * num_layers + 1) * t.num_steps
        assert t.logits_gather.num_calls == t.num_steps
        assert 0 < t.all_reduce.seconds < t.forward_seconds
    assert times[0].sample_seconds > 0 and times[1].sample_seconds == 0


@pytest.mark.slow
@pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")
@pytest.mark.parametrize("collectives", ["gloo", "shm"])
def test_tp2_with_packed_gguf_weights_equals_tp1_bit_for_bit(collectives, monkeypatch):
    """Each rank serves its shard of the GGUF's packed matrices, and every output of every layer
    is computed whole on one rank in TP=1's float sequence (the row-parallel ones gather their
    input), so TP=2 gives TP=1's tokens and logprobs exactly, not only where ties are far.
    With an int8 KV cache, so that each rank's Hadamard-rotated K/V of its own heads are
    checked too (the dense test above keeps the float32 cache). Both CPU transports: gloo's
    zero-padded all-reduces and the shared-memory slots' column gathers."""
    monkeypatch.setenv(ALL_REDUCE_ENV, collectives)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    tp2 = _llm(2, quantization="gguf", kv_cache_dtype="int8")
    try:
        got = tp2.generate(PROMPTS, params, use_tqdm=False)
        times = tp2.llm_engine.executor.rank_times()
    finally:
        tp2.llm_engine.shutdown()
    want = _llm(1, quantization="gguf", kv_cache_dtype="int8").generate(PROMPTS, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), g.prompt
        for mine, theirs in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert {t: lp.logprob for t, lp in mine.items()} == {t: lp.logprob for t, lp in theirs.items()}
    # per layer: the attention's and the MLP's row-parallel layer gather twice (input, output); plus the embedding's sum
    assert all(t.all_reduce.num_calls == (4 * 30 + 1) * t.num_steps > 0 for t in times)


@pytest.mark.slow
def test_killing_a_worker_ends_the_engine_and_leaves_no_process():
    llm = _llm(2)
    engine = llm.llm_engine
    (process,) = engine.executor.processes
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    os.kill(process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker"):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert time.monotonic() - started < 30
    assert not process.is_alive()
    with pytest.raises(EngineDeadError):  # and it stays dead
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4), use_tqdm=False)


_UNGUARDED_SCRIPT = """
from pagedllm import LLM
LLM(dtype="float32", device="cpu", tensor_parallel_size=2, quantization="none", kv_cache_memory=64 * 2**20)
"""


def test_a_script_without_a_main_guard_fails_at_once_and_says_why(tmp_path):
    # spawn imports the script again in the worker, which then fails before it starts: rank 0
    # must say so at once, not after its rendezvous timeout (minutes)
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode != 0
    assert "EngineDeadError" in result.stderr and "__main__" in result.stderr
    assert time.monotonic() - start < 120
