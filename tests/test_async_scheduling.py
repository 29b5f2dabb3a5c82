"""Overlapped steps (async scheduling) against the ordinary engine, on the default model.

With ``async_scheduling=True`` the engine schedules and launches each decode
step before it reads the previous step's tokens. On the CPU nothing overlaps
(kernels run as they are called), but every piece of the bookkeeping runs:
pending tokens, tokens fed from the previous step's output tensor, stop
conditions seen one step late. The outputs must equal the ordinary engine's,
and every block must come back.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.rank_times import collect as collect_times
from pagedllm.errors import ConfigError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of three fruits: apple,",
    "In 1969, the first humans to walk on the Moon were",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
]


def _llm(async_scheduling: bool, **options) -> LLM:
    options.setdefault("kv_cache_memory", 64 * 2**20)
    return LLM(dtype="float32", device="cpu", async_scheduling=async_scheduling, **options)


def _mixed_params() -> list[SamplingParams]:
    """Greedy rows that stop at different steps (length, EOS, a stop string, a stop token),
    seeded random draws, min_tokens, and one row that needs the host every step."""
    return [
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]),
        SamplingParams(temperature=0, max_tokens=33, stop_token_ids=[28]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=25),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=18, min_tokens=12),
        SamplingParams(temperature=0, max_tokens=30, logprobs=2),  # takes the ordinary step
    ]


def _run(llm: LLM, prompts, params) -> list[tuple]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
         o.outputs[0].cumulative_logprob)
        for o in outputs
    ]


def _assert_same_outputs(got: list[tuple], want: list[tuple]) -> None:
    """Tokens, text and finish reason exactly equal; cumulative logprobs within 1e-3
    (rounding both to 3 decimals and comparing would fail on values a hair apart
    that straddle a rounding boundary)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g[3] - w[3]) <= 1e-3, (g, w)


def _assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_blocks() == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def plain():
    return _llm(False)


@pytest.fixture(scope="module")
def overlapped():
    return _llm(True)


def test_overlapped_steps_give_the_ordinary_outputs(plain, overlapped):
    params = _mixed_params()
    want = _run(plain, PROMPTS, params)
    before = overlapped.llm_engine.num_overlapped_steps
    got = _run(overlapped, PROMPTS, params)
    _assert_same_outputs(got, want)
    assert {o[2] for o in want} >= {"stop", "length"}  # both kinds of stop were exercised
    # The logprobs row runs ordinary steps until it finishes; after that the rest run ahead.
    assert overlapped.llm_engine.num_overlapped_steps - before > 10
    _assert_all_blocks_free(overlapped)


def test_steady_decode_runs_ahead_every_step(plain, overlapped):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = _run(plain, PROMPTS[:4], params)
    engine = overlapped.llm_engine
    before = engine.num_overlapped_steps
    collect_times(engine, reset=True)
    got = _run(overlapped, PROMPTS[:4], params)
    _assert_same_outputs(got, want)
    # one prefill step, then 19 decode steps, each launched before the previous step's
    # tokens were read; none after the last token, which ends every request by length
    assert engine.num_overlapped_steps - before == 19
    # the launched steps count in the worker's times as the ordinary ones do (bench's table)
    (times,) = collect_times(engine)
    assert times.num_steps == 20 and 0 < times.forward_seconds and 0 < times.sample_seconds
    assert engine._in_flight is None
    _assert_all_blocks_free(overlapped)


def test_abort_while_a_step_is_in_flight(plain, overlapped):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = dict(zip(PROMPTS[:3], _run(plain, PROMPTS[:3], params)))
    engine = overlapped.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    seen: dict[str, list[int]] = {}
    for _ in range(6):
        for output in engine.step():
            seen[output.request_id] = list(output.outputs[0].token_ids)
    assert engine._in_flight is not None
    engine.abort_request("r1")
    # what r1 produced before the abort is a prefix of its full output, with no pending token in it
    assert want[PROMPTS[1]][0][: len(seen["r1"])] == seen["r1"]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = list(output.outputs[0].token_ids)
    assert finals == {"r0": want[PROMPTS[0]][0], "r2": want[PROMPTS[2]][0]}
    _assert_all_blocks_free(overlapped)


def test_requests_arriving_mid_run_and_memory_pressure():
    """A small cache forces preemptions and late admissions; overlap steps aside for them."""
    params = [SamplingParams(temperature=0, max_tokens=40 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    results = {}
    for mode in (False, True):
        llm = _llm(mode, kv_cache_memory=None, num_kv_blocks=10, max_num_seqs=4, num_headroom_tokens=0)
        results[mode] = _run(llm, PROMPTS, params)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        _assert_all_blocks_free(llm)
        if mode:
            assert llm.llm_engine.num_overlapped_steps > 0
        # one sequence per prompt, numbered by this engine alone (the first engine's ids are not shared)
        assert llm.llm_engine.new_seq_id() == len(PROMPTS)
    _assert_same_outputs(results[True], results[False])


def test_async_scheduling_option():
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(dtype="float32", device="cpu", async_scheduling="yes")
    # On the CPU nothing runs while the host schedules, so the default is off.
    assert LLM(dtype="float32", device="cpu", kv_cache_memory=16 * 2**20).llm_engine.async_scheduling is False
