"""The engine on the default model (fp32) against HF transformers, token for token."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError, RequestError

pytestmark = pytest.mark.slow

MAX_NEW = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of three fruits: apple,",
    "In 1969, the first humans to walk on the Moon were",
]
SHARED_PREFIX = (
    "You are a careful assistant. Answer in one short sentence and do not repeat the question. "
    "Question: "
)
PREFIXED = [SHARED_PREFIX + q for q in ("What is the boiling point of water?", "Who wrote Hamlet?",
                                         "What colour is the sky?")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def make_llm(**options) -> LLM:
    options.setdefault("kv_cache_memory", 192 * 2**20)
    options.setdefault("dtype", "float32")
    options.setdefault("quantization", "none")  # HF transformers' dequantized weights are the oracle
    return LLM(**options)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(autouse=True)
def no_block_left_in_use(request):
    yield
    for name in ("llm",):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name).llm_engine
            assert not engine.has_unfinished_requests()
            stats = engine.block_manager.stats()
            assert stats.num_used_blocks == 0, stats
            engine.block_manager.check_invariants()


def expected(hf_reference, llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [hf_reference.greedy(tuple(tok.encode(p)), MAX_NEW) for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_clean(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats.num_used_blocks == 0, stats
    llm.llm_engine.block_manager.check_invariants()


def test_greedy_one_at_a_time_matches_hf(llm, hf_reference):
    want = expected(hf_reference, llm, PROMPTS)
    got = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert got == want


def test_greedy_batched_matches_hf_and_text_decodes(llm, hf_reference):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected(hf_reference, llm, PROMPTS)
    tok = llm.get_tokenizer()
    for out in outputs:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        assert out.prompt in PROMPTS and out.finished


def test_chat_template_prompt_matches_hf_and_stops_at_eos(llm, hf_reference):
    messages = [{"role": "user", "content": "Say hello in French."}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == hf_reference.greedy(tuple(prompt_ids), 64)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in tok.eos_token_ids


def test_chunked_prefill_matches_hf(hf_reference):
    llm = make_llm(max_num_batched_tokens=8)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected(hf_reference, llm, PROMPTS)
    assert_clean(llm)


def test_preemption_keeps_outputs_identical(hf_reference):
    # just enough blocks to admit any single prompt, far too few for all of them to decode together
    llm = make_llm(num_kv_blocks=10, block_size=8)
    outputs = llm.generate(PROMPTS + PREFIXED, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected(hf_reference, llm, PROMPTS + PREFIXED)
    assert llm.kv_cache_stats().num_preemptions > 0
    assert_clean(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off_match_hf(hf_reference, caching):
    llm = make_llm(enable_prefix_caching=caching)
    first = llm.generate(PREFIXED[0], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(PREFIXED[1:], GREEDY, use_tqdm=False)
    assert token_ids([first] + rest) == expected(hf_reference, llm, PREFIXED)
    stats = llm.kv_cache_stats()
    if caching:
        assert stats.prefix_cache_hits > 0
        assert all(o.num_cached_tokens >= 16 for o in rest)
    else:
        assert stats.prefix_cache_hits == 0 and all(o.num_cached_tokens == 0 for o in rest)
    assert_clean(llm)


def test_seeded_sampling_is_identical_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16), SamplingParams(temperature=0.7, seed=9, max_tokens=16)]
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], seeded, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16)
    assert llm.generate(PROMPTS[0], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_is_excluded_unless_asked(llm):
    base = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base.strip().split()[1]  # a word that occurs in the greedy continuation
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert stop not in c.text and base.startswith(c.text)
    inc = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop], include_stop_str_in_output=True)
    c2 = llm.generate(PROMPTS[2], inc, use_tqdm=False)[0].outputs[0]
    assert c2.text == c.text + stop


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    base = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_token = base[3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == base[: base.index(stop_token) + 1]
    short = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "length" and short.token_ids == base[:5]
    # min_tokens bans the stop token until enough tokens exist
    held = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[base[0]],
                                                    min_tokens=2), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 2 and held.token_ids[0] != base[0] or held.token_ids[0] == base[0] and len(held.token_ids) >= 2


def test_ignore_eos_runs_to_max_tokens(llm):
    messages = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_n_returns_n_outputs_and_best_of_picks_highest_logprob(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = llm.generate(PROMPTS[1], SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8),
                        use_tqdm=False)[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_logprobs_are_consistent(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and entry[token].logprob <= 0


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"best_of": 1, "n": 2}, "best_of")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and info.value.param == field


def test_bad_prompts_are_rejected_without_leaking(llm):
    with pytest.raises(RequestError, match="context"):
        llm.generate("hello " * 6000, GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate("hello", SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(RequestError):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(RequestError):
        llm.generate({"prompt_token_ids": [10**9]}, GREEDY, use_tqdm=False)
    # a bad prompt in the middle of a batch aborts the good ones already added
    with pytest.raises(RequestError):
        llm.generate([PROMPTS[0], ""], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_engine_options_are_config_errors():
    with pytest.raises(ConfigError, match="block_size"):
        LLM(block_size=24)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(dtype="int8")


def test_abort_frees_every_block(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", PROMPTS[0], SamplingParams(max_tokens=50, n=3, temperature=1.0))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.stats().num_used_blocks > 0
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.stats().num_used_blocks == 0
