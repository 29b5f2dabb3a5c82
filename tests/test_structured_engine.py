"""Constrained decoding in the engine, on a tiny random-weight model with the default model's tokenizer.

Random weights make the unconstrained text garbage, which is the point: every
valid output below is the grammar's doing. Schemas are bounded (enums,
integer ranges, short strings) so that a random model reaches the end.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from pydantic import BaseModel, Field

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.errors import RequestError
from pagedllm.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["color", "ok", "n", "tag"],
    "additionalProperties": False,
}


class Item(BaseModel):
    color: str = Field(pattern="^(red|green|blue)$")
    ok: bool
    n: int = Field(ge=0, le=99)
    tag: str = Field(max_length=4)


def _schema(**extra) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, **extra)


def _valid(text: str) -> bool:
    try:
        Item.model_validate(json.loads(text))
    except ValueError:
        return False
    return list(json.loads(text)) == ["color", "ok", "n", "tag"]  # properties in schema order


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("tiny-smollm-vocab")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    source = Tokenizer.load(default_model_path()).source
    for path in source.iterdir():
        if path.is_file():
            shutil.copy(path, directory / path.name)
    return directory


def _llm(tiny_model_dir, **options) -> LLM:
    options.setdefault("kv_cache_memory", 16 * 2**20)
    return LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", **options)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return _llm(tiny_model_dir)


PROMPT = "Describe an item as JSON:"


def _assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_blocks() == engine.kv_cache.num_blocks


def test_unconstrained_random_model_is_not_json(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert not _valid(out.outputs[0].text)


def test_n4_samples_under_one_schema_are_all_valid(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60, structured_outputs=_schema())
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(c.finish_reason == "stop" for c in out.outputs), texts
    assert all(_valid(t) for t in texts), texts
    assert len(set(texts)) > 1  # the forks sampled on their own, each with its own matcher
    _assert_all_free(llm)


def test_best_of_ranks_only_valid_samples(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=9, max_tokens=60, structured_outputs=_schema())
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(_valid(c.text) for c in out.outputs)


def test_beam_search_under_a_schema_returns_only_complete_valid_hypotheses(llm):
    eos = llm.get_tokenizer().eos_token_id
    params = BeamSearchParams(beam_width=4, max_tokens=40, structured_outputs=_schema())
    out = llm.beam_search([{"prompt": PROMPT}], params)[0]
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert _valid(completion.text), completion.text
        assert completion.token_ids[-1] == eos and completion.finish_reason == "stop"
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    _assert_all_free(llm)


def test_beam_search_that_cannot_finish_in_max_tokens_returns_nothing_invalid(llm):
    # 6 tokens cannot spell the shortest valid object, so no hypothesis may be returned.
    params = BeamSearchParams(beam_width=3, max_tokens=6, structured_outputs=_schema())
    out = llm.beam_search([{"prompt": PROMPT}], params)[0]
    assert all(_valid(c.text) for c in out.outputs)
    _assert_all_free(llm)


def test_greedy_constrained_equals_unconstrained_where_the_grammar_allows_it(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert "\ufffd" not in free.text
    # A grammar that allows exactly that text, then anything: the mask must not move the argmax.
    regex = re.escape(free.text) + r"[\s\S]*"
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex))
    constrained = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert constrained.token_ids == free.token_ids
    # And a mixed batch: constrained rows do not disturb the unconstrained ones.
    prompts = [PROMPT, "Another prompt", PROMPT]
    mixed = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12),
                                   params], use_tqdm=False)
    alone = llm.generate(["Another prompt"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert mixed[0].outputs[0].token_ids == free.token_ids
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == free.token_ids


def test_choice_and_regex(llm):
    choice = StructuredOutputsParams(choice=["alpha", "beta gamma", 'quo"te'])
    outs = llm.generate([PROMPT, "x", "yz"], SamplingParams(temperature=1.0, seed=1, max_tokens=10, structured_outputs=choice),
                        use_tqdm=False)
    assert all(o.outputs[0].text in ("alpha", "beta gamma", 'quo"te') for o in outs)
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}")
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs=regex),
                       use_tqdm=False)[0]
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", out.outputs[0].text), out.outputs[0].text


def test_ebnf_grammar_and_json_object(llm):
    grammar = StructuredOutputsParams(grammar='root ::= "(" ("a" | "b")+ ")"')
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=4, max_tokens=10, structured_outputs=grammar),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"\((a|b)+\)", out.text) or (out.finish_reason == "length" and re.fullmatch(r"\((a|b)*", out.text))
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json_object=True))
    text = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("{")



def test_a_grammar_that_may_only_end_wins_over_min_tokens(llm):
    """Under min_tokens the EOS ban would forbid every token a finished grammar allows:
    the grammar's end wins (finish_reason "stop", fewer tokens than min_tokens)."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    for temperature, seed in ((0.0, None), (1.0, 11), (1.0, 12)):
        params = SamplingParams(temperature=temperature, seed=seed, min_tokens=10, max_tokens=20, structured_outputs=choice)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 10, out
    # A schema whose every valid (compact) document is shorter than min_tokens: it ends valid.
    params = SamplingParams(temperature=0, min_tokens=60, max_tokens=60, structured_outputs=_schema())
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert _valid(out.text) and out.finish_reason == "stop" and len(out.token_ids) < 60
    _assert_all_free(llm)


def test_min_tokens_still_holds_while_the_grammar_can_go_on(llm):
    """Rows of one batch: a grammar that can always continue is held to min_tokens, a finished
    one ends, an unconstrained row keeps its EOS ban."""
    eos = llm.get_tokenizer().eos_token_id
    forever = SamplingParams(temperature=1.0, seed=5, min_tokens=8, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="(yes|no)+"))
    ends = SamplingParams(temperature=1.0, seed=6, min_tokens=8, max_tokens=12,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=1.0, seed=7, min_tokens=8, max_tokens=12, logit_bias={eos: 100.0})
    outs = [o.outputs[0] for o in llm.generate([PROMPT, PROMPT, PROMPT], [forever, ends, free], use_tqdm=False)]
    assert re.fullmatch("(yes|no)+", outs[0].text) and len(outs[0].token_ids) >= 8, outs[0]
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason == "stop"
    # EOS is all but certain for the biased row, yet it comes no earlier than token 9.
    assert eos not in outs[2].token_ids[:8] and len(outs[2].token_ids) >= 9, outs[2].token_ids
    _assert_all_free(llm)


def test_grammar_mask_allows_only_reads_every_bit_of_a_word():
    from pagedllm.structured.bitmask import GrammarMask

    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = -2**31  # bit 31: token 31 (the sign bit)
    bitmask[1, 1] = 1 | 4  # tokens 32 and 34
    mask = GrammarMask(bitmask, [0, 1])
    assert mask.allows_only(0, [31], 64) and not mask.allows_only(0, [30], 64)
    assert mask.allows_only(1, [32, 34, 2], 64) and not mask.allows_only(1, [32], 64)
    assert mask.allows_only(1, [], 32)  # tokens 32 and 34 lie past a 32-token vocabulary

@pytest.mark.slow  # two engines per mode
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_matcher_state_survives_forced_preemption(tiny_model_dir, mode):
    prompts = [f"{PROMPT} {i} " + "word " * (20 + 7 * i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=_schema()) for _ in prompts]
    roomy = _llm(tiny_model_dir)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # Too few blocks for all six at once: requests are preempted mid-JSON and resumed.
    extra = {"swap_space_bytes": 8 * 2**20} if mode == "swap" else {}
    tight = _llm(tiny_model_dir, kv_cache_memory=None, num_kv_blocks=24, preemption_mode=mode, **extra)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(_valid(o.outputs[0].text) for o in outs)
    _assert_all_free(tight)


@pytest.mark.slow  # two engines
def test_overlapped_steps_keep_matcher_state(tiny_model_dir):
    prompts = [PROMPT, "second", "third prompt here", "4"]
    params = [
        SamplingParams(temperature=0, max_tokens=50, structured_outputs=_schema()),
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.9, seed=5, max_tokens=50, structured_outputs=_schema()),
        SamplingParams(temperature=0, max_tokens=30),
    ]
    plain = [o.outputs[0].token_ids for o in _llm(tiny_model_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False)]
    overlapped = _llm(tiny_model_dir, async_scheduling=True)
    outs = overlapped.generate(prompts, params, use_tqdm=False)
    assert overlapped.llm_engine.num_overlapped_steps > 0
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert _valid(outs[0].outputs[0].text) and _valid(outs[2].outputs[0].text)
    _assert_all_free(overlapped)


@pytest.mark.parametrize(
    ("constraint", "param", "words"),
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json", "objekt"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"regex": "(unclosed"}, "structured_outputs.regex", "parenthesis"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar", "cannot compile"),
        ({"choice": []}, "structured_outputs.choice", "non-empty"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one"),
    ],
)
def test_bad_constraints_are_request_errors_naming_the_field(llm, constraint, param, words):
    with pytest.raises(RequestError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    assert info.value.param == param and words in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_text_and_bounded(llm):
    compiler = llm.llm_engine.grammar_compiler
    first = compiler.compile(StructuredOutputsParams(regex="cache-[0-9]+"))
    hits = compiler.num_cache_hits
    assert compiler.compile(StructuredOutputsParams(regex="cache-[0-9]+")) is first
    assert compiler.num_cache_hits == hits + 1
    # the same schema given as a dict or as JSON text is one grammar
    a = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}}))
    b = compiler.compile(StructuredOutputsParams(json='{"type": "object", "properties": {"k": {"type": "integer"}}}'))
    assert a is b
    limit = compiler._max_cached
    compiler._max_cached = 3
    try:
        for i in range(5):
            compiler.compile(StructuredOutputsParams(regex=f"bound-{i}"))
        assert compiler.num_cached == 3
    finally:
        compiler._max_cached = limit


def test_bench_mask_clock_times_the_hooks_the_engine_really_calls(llm):
    """`bench structured` wraps the step's bitmask fill, apply and accept; if a refactor moves
    them, the clock must fail loudly or still count, never read zero."""
    from pagedllm.bench.structured import MaskClock

    clock = MaskClock()
    clock.install()
    try:
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=_schema())
        llm.generate([PROMPT, PROMPT + " a lamp"], params, use_tqdm=False)
    finally:
        clock.uninstall()
    assert clock.num_steps >= 8 and clock.num_rows >= clock.num_steps
    assert clock.fill_s > 0 and clock.pack_s > 0 and clock.apply_s > 0 and clock.accept_s > 0
    steps = clock.num_steps
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, structured_outputs=_schema()), use_tqdm=False)
    assert clock.num_steps == steps  # uninstalled: nothing counts any more


def test_top_logprobs_under_a_grammar_list_only_tokens_it_allows(llm):
    """A masked token has logprob -inf: it is no alternative (and JSON could not carry it)."""
    import math

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text in ("yes", "no") and completion.logprobs
    entries = [entry for position in completion.logprobs for entry in position.values()]
    assert entries and all(math.isfinite(entry.logprob) for entry in entries)
    assert len(completion.logprobs[0]) < 6  # fewer than 5 tokens start "yes" or "no" here: the rest are gone


def test_a_regex_that_matches_nothing_is_refused_before_any_step(llm):
    with pytest.raises(RequestError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs={"regex": r"[^\s\S]"}), use_tqdm=False)
    assert info.value.param == "structured_outputs.regex" and "matches no output" in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()
    _assert_all_free(llm)


# A grammar with a dead end: after "a" nothing may follow and nothing is complete; "b+" is fine.
DEAD_END_OR_BS = StructuredOutputsParams(regex=r"(a[^\s\S]|b+)")
# Every output dead-ends, after 40 to 60 characters.
ALWAYS_DEAD_LATER = StructuredOutputsParams(regex=r"[a-z ]{40,60}[^\s\S]")


def _is_dead_end(completion) -> bool:
    return completion.finish_reason == "error" and "dead end" in (completion.error or "")


def test_a_grammar_that_dead_ends_mid_answer_ends_that_sequence_there(llm):
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": r"a[^\s\S]"})
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    (completion,) = out.outputs
    assert out.finished and out.error is None
    # The text so far, and no token drawn from the empty mask after it.
    assert completion.text == "a" and llm.get_tokenizer().decode(completion.token_ids) == "a"
    assert _is_dead_end(completion) and "'a'" in completion.error, completion
    assert completion.cumulative_logprob == completion.cumulative_logprob  # not NaN
    assert not llm.llm_engine.has_unfinished_requests()
    _assert_all_free(llm)


def test_a_dead_ended_sample_leaves_its_siblings_running(llm):
    params = SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=6, structured_outputs=DEAD_END_OR_BS)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    dead = [c for c in out.outputs if _is_dead_end(c)]
    alive = [c for c in out.outputs if not _is_dead_end(c)]
    assert dead and alive and out.error is None, out.outputs  # seed 0 draws both kinds
    assert all(c.text == "a" for c in dead)
    assert all(re.fullmatch("b+", c.text) and c.finish_reason in ("stop", "length") for c in alive)
    _assert_all_free(llm)


def test_best_of_never_picks_a_dead_ended_sample(llm):
    # The same draws as above: the dead-ended "a" samples are short, so their logprob is the highest.
    params = SamplingParams(temperature=1.0, seed=0, n=1, best_of=4, max_tokens=6, structured_outputs=DEAD_END_OR_BS)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    (completion,) = out.outputs
    assert re.fullmatch("b+", completion.text) and completion.error is None, completion
    _assert_all_free(llm)


def test_beam_search_drops_beams_whose_grammar_dead_ends(llm):
    params = BeamSearchParams(beam_width=4, max_tokens=5, structured_outputs=StructuredOutputsParams(regex=r"(x[^\s\S]|[0-9]{1,3})"))
    (out,) = llm.beam_search([{"prompt": PROMPT}], params)
    assert out.outputs and all(re.fullmatch("[0-9]{1,3}", c.text) for c in out.outputs)
    # Every beam dead-ends: no hypothesis is complete, so none is returned.
    params = BeamSearchParams(beam_width=4, max_tokens=5, structured_outputs=StructuredOutputsParams(regex=r"x[^\s\S]"))
    (out,) = llm.beam_search([{"prompt": PROMPT}], params)
    assert out.finished and out.outputs == []
    _assert_all_free(llm)


@pytest.mark.slow  # two engines
def test_dead_ends_under_overlapped_steps_and_preemption(tiny_model_dir):
    """Dead ends several tokens in, beside unconstrained and valid constrained requests, with steps
    run ahead (the dead-ended sequence may have a step in flight) and with too few KV blocks."""
    prompts = [f"{PROMPT} {i} " + "word " * (20 + 7 * i) for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=70, structured_outputs=ALWAYS_DEAD_LATER),
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=_schema()),
        SamplingParams(temperature=0.9, seed=3, max_tokens=70, structured_outputs=ALWAYS_DEAD_LATER),
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=70, structured_outputs=ALWAYS_DEAD_LATER),
    ]
    plain = _llm(tiny_model_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    for index in (0, 3, 5):
        completion = plain[index].outputs[0]
        assert _is_dead_end(completion) and re.fullmatch("[a-z ]{40,60}", completion.text), completion
    assert _valid(plain[2].outputs[0].text)
    expected = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain]
    for options in ({"async_scheduling": True}, {"kv_cache_memory": None, "num_kv_blocks": 18, "preemption_mode": "recompute"}):
        engine = _llm(tiny_model_dir, **options)
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == expected, options
        if options.get("async_scheduling"):
            assert engine.llm_engine.num_overlapped_steps > 0
        else:
            assert engine.llm_engine.get_stats().num_preemptions_total > 0
        assert not engine.llm_engine.has_unfinished_requests()
        _assert_all_free(engine)
