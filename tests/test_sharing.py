"""Copy-on-write sharing on the default model: parallel samples, best_of, beam search, preemption."""

from __future__ import annotations

import math
import random

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

BS = 16
BEAM_PROMPTS = ["The best way to learn a language is", "Once upon a time, in a small village,"]


def make_llm(**options) -> LLM:
    options.setdefault("kv_cache_memory", 128 * 2**20)
    options.setdefault("dtype", "float32")
    options.setdefault("quantization", "none")  # HF transformers' dequantized weights are the oracle
    return LLM(**options)


@pytest.fixture(scope="module")
def llm():
    return make_llm(enable_prefix_caching=False)


def assert_clean(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats.num_used_blocks == 0, stats
    llm.llm_engine.block_manager.check_invariants()


def long_prompt(length: int = 483, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}


def test_parallel_samples_share_the_prompt_blocks(llm):
    prompt, new = long_prompt(), 16
    params = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=new, ignore_eos=True)
    engine = llm.llm_engine
    engine.block_manager.reset_peak_stats()  # measure this request alone
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    stats = llm.kv_cache_stats()
    prompt_blocks = math.ceil(483 / BS)
    assert stats.peak_used_blocks <= prompt_blocks + 8 * (math.ceil(new / BS) + 1)
    assert stats.peak_used_blocks < 2 * prompt_blocks  # unshared would be 8x the prompt
    # the saving is visible in the stats: the same outputs unshared would hold 8 prompts' blocks
    assert stats.peak_blocks_without_sharing >= 8 * prompt_blocks
    assert len(out.outputs) == 8 and len({tuple(c.token_ids) for c in out.outputs}) == 8
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_clean(llm)


def test_parallel_samples_work_with_prefix_caching_on():
    llm = make_llm(enable_prefix_caching=True)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    first = llm.generate(long_prompt(100), params, use_tqdm=False)[0]
    second = llm.generate(long_prompt(100), params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 96
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert_clean(llm)


def test_best_of_returns_the_top_n_by_cumulative_logprob(llm):
    prompt = "My favourite animal is"
    all_samples = llm.generate(prompt, SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)[0]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=6, temperature=1.0, seed=5, max_tokens=6),
                        use_tqdm=False)[0]
    ranked = sorted(all_samples.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert_clean(llm)


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_hf(llm, hf_reference, width):
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=10)
    results = llm.beam_search(BEAM_PROMPTS, params)
    for prompt, result in zip(BEAM_PROMPTS, results):
        want = hf_reference.beam(tok.encode(prompt), width, 10)
        assert [c.token_ids for c in result.outputs] == want
        scores = [c.cumulative_logprob / len(c.token_ids) for c in result.outputs]
        assert scores == sorted(scores, reverse=True)
        assert result.outputs[0].text == tok.decode(result.outputs[0].token_ids)
    assert_clean(llm)


def test_beam_search_memory_stays_near_one_prompt(llm):
    engine = llm.llm_engine
    engine.block_manager.reset_peak_stats()
    width, new = 4, 12
    llm.beam_search(long_prompt(200), BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))
    stats = llm.kv_cache_stats()
    assert stats.peak_used_blocks <= math.ceil(200 / BS) + width * (math.ceil(new / BS) + 1)
    assert_clean(llm)


def _mixed_run(llm: LLM):
    sampled = llm.generate(
        [long_prompt(60, seed=1), long_prompt(70, seed=2)],
        SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    beams = llm.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10))
    return [[c.token_ids for c in o.outputs] for o in sampled + beams]


@pytest.fixture(scope="module")
def unconstrained_mixed_run():
    return _mixed_run(make_llm(enable_prefix_caching=False))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_groups_survive_preemption(mode, unconstrained_mixed_run):
    tight = make_llm(enable_prefix_caching=False, num_kv_blocks=14, preemption_mode=mode,
                     swap_space_bytes=64 * 2**20 if mode == "swap" else 0)
    assert _mixed_run(tight) == unconstrained_mixed_run
    assert tight.kv_cache_stats().num_preemptions > 0
    assert_clean(tight)
