import math

import pytest
import torch

from pagedllm.sampling.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    top_k_logprobs,
)
from pagedllm.sampling_params import SamplingParams

VOCAB = 8


def row(params=None, prompt=(), output=(), seed_gen=None, eos=()):
    return SamplingRow(
        params=params or SamplingParams(temperature=0.0),
        token_ids=[*prompt, *output],
        prompt_len=len(prompt),
        generator=seed_gen,
        eos_token_ids=tuple(eos),
    )


def seeded(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def sampler():
    return Sampler()


def random_logits(rows, vocab=VOCAB, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ greedy and filters


def test_greedy_is_argmax(sampler):
    logits = random_logits(6, vocab=100)
    out = sampler(logits, [row() for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.top_logprobs is None and out.ranks is None


@pytest.mark.parametrize("vocab", [5, 100, 49152])
def test_greedy_rows_take_one_pass_with_the_general_paths_bits(sampler, monkeypatch, vocab):
    """Greedy rows with no logit processor: the native pick's token and logprob are those of
    argmax, gather and logsumexp (ties to the first index); a processor takes the general path."""
    from pagedllm.native import cpu_ops
    from pagedllm.sampling import sampler as sampler_module

    if not cpu_ops.available():
        pytest.skip("no native kernels")
    logits = 2 * random_logits(5, vocab=vocab, seed=vocab)
    logits[1] = 0.5  # all tied
    logits[2, vocab // 2 :] = logits[2].max() + 1  # the maximum tied in later lanes
    picks = []
    pick = cpu_ops.greedy_pick
    monkeypatch.setattr(cpu_ops, "greedy_pick", lambda x: picks.append(x) or pick(x))
    out = sampler(logits, [row() for _ in range(5)])
    assert len(picks) == 1
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = logits.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1) - torch.logsumexp(logits, -1)
    general = logits.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1) - cpu_ops.argmax_logsumexp(logits)[1]
    assert out.logprobs == general.tolist()  # the bits the general path reports
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=1e-6, atol=1e-5)
    for params in (
        SamplingParams(temperature=0.0, logit_bias={0: 50.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0.7),
    ):
        assert sampler_module._has_processors([row(params)]) or not params.is_greedy
        before = len(picks)
        sampler(logits, [row(params, prompt=[0], output=[1]) for _ in range(5)])
        assert len(picks) == before, params
    biased = sampler(logits, [row(SamplingParams(temperature=0.0, logit_bias={0: 100.0})) for _ in range(5)])
    assert biased.token_ids == [0] * 5


def test_does_not_modify_input_logits(sampler):
    logits = random_logits(2)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, logit_bias={1: 3.0}, top_p=0.5)
    sampler(logits, [row(params, prompt=[1, 2], output=[3]), row()])
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy(sampler):
    logits = random_logits(4, vocab=50)
    rows = [row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(4)]
    for _ in range(5):
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy(sampler):
    logits = random_logits(4, vocab=50)
    rows = [row(SamplingParams(temperature=1.0, top_p=1e-6)) for _ in range(4)]
    for _ in range(5):
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_best(sampler):
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    rows = [row(SamplingParams(temperature=10.0, top_k=2))]
    seen = {sampler(logits, rows).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p(sampler):
    # probabilities 0.5, 0.3, 0.2: p=0.6 needs tokens 0 and 1, never token 2
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    rows = [row(SamplingParams(temperature=1.0, top_p=0.6))]
    seen = {sampler(logits, rows).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_filters_unlikely_tokens(sampler):
    # probabilities 0.5, 0.3, 0.15, 0.05; min_p=0.25 keeps p >= 0.125: tokens 0, 1, 2
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rows = [row(SamplingParams(temperature=1.0, min_p=0.25))]
    seen = {sampler(logits, rows).token_ids[0] for _ in range(500)}
    assert seen == {0, 1, 2}


def test_temperature_sampling_follows_softmax(sampler):
    torch.manual_seed(1234)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, -1)
    draws = 20_000
    batch = logits.expand(draws, -1).contiguous()
    rows = [row(SamplingParams(temperature=temperature))] * draws
    counts = torch.bincount(torch.tensor(sampler(batch, rows).token_ids), minlength=5).double()
    chi_square = (((counts - draws * expected) ** 2) / (draws * expected)).sum().item()
    # 4 degrees of freedom: P(chi2 > 18.5) ~ 0.001
    assert chi_square < 18.5, (counts, expected * draws)
    # and a wrong distribution (no temperature) is rejected by the same test
    wrong = torch.softmax(logits[0], -1)
    assert (((counts - draws * wrong) ** 2) / (draws * wrong)).sum().item() > 18.5


# ------------------------------------------------------------ logit processors


def test_logit_bias_adds_to_logits(sampler):
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=0.0, logit_bias={0: 2.5})
    assert sampler(logits, [row(params)]).token_ids == [0]  # 3.5 > 3.0
    params = SamplingParams(temperature=0.0, logit_bias={0: 1.5})
    assert sampler(logits, [row(params)]).token_ids == [2]  # 2.5 < 3.0


def test_logit_bias_exact_values():
    from pagedllm.sampling.sampler import _apply_logit_processors

    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    rows = [row(SamplingParams(logit_bias={0: 2.5, 2: -1.0})), row()]
    out = _apply_logit_processors(logits, rows)
    assert out.tolist() == [[3.5, 2.0, 2.0], [0.0, 0.0, 0.0]]


def test_repetition_penalty_exact_values():
    from pagedllm.sampling.sampler import _apply_logit_processors

    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0)
    # token 0 in the prompt, token 1 in the output; 2 and 3 unseen
    out = _apply_logit_processors(logits, [row(params, prompt=[0], output=[1])])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_frequency_and_presence_penalty_exact_values():
    from pagedllm.sampling.sampler import _apply_logit_processors

    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt tokens do not count; token 1 generated three times, token 2 once
    out = _apply_logit_processors(logits, [row(params, prompt=[0, 0, 3], output=[1, 1, 2, 1])])
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0]]


def test_penalties_only_touch_rows_that_ask():
    from pagedllm.sampling.sampler import _apply_logit_processors

    logits = torch.ones(2, 3)
    rows = [
        row(SamplingParams(presence_penalty=1.0), output=[0]),
        row(SamplingParams(), output=[0]),
    ]
    assert _apply_logit_processors(logits, rows).tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_no_processor_returns_input_unchanged():
    from pagedllm.sampling.sampler import _apply_logit_processors

    logits = torch.ones(2, 3)
    assert _apply_logit_processors(logits, [row(), row()]) is logits


def test_min_tokens_bans_eos_and_stop_tokens_then_allows_them(sampler):
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # eos=1 and stop token 2 are the best
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [row(params, output=[], eos=[1])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[3], eos=[1])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[3, 3], eos=[1])]).token_ids == [1]


def test_a_row_reads_the_sequences_own_token_list(sampler):
    token_ids = [5, 6, 3]  # a prompt of two, one output so far
    r = SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), token_ids, 2, None, (1,))
    assert (r.prompt_token_ids, r.output_token_ids, r.num_output_tokens) == ([5, 6], [3], 1)
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # eos=1 is the best
    assert sampler(logits, [r]).token_ids == [2]
    token_ids.append(2)  # the sequence grows: the same row sees it, nothing was copied
    assert (r.output_token_ids, r.num_output_tokens) == ([3, 2], 2)
    assert sampler(logits, [r]).token_ids == [1]


def test_allowed_token_ids_leave_only_those_tokens(sampler):
    logits = random_logits(2, vocab=50, seed=3)
    allowed = [4, 17, 33]
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    out = sampler(logits, [row(greedy), row()])
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.token_ids[1] == int(logits[1].argmax())  # the other row is untouched
    # sampled rows too, over many draws; the reported logprob is the raw one
    hot = SamplingParams(temperature=5.0, seed=1, allowed_token_ids=allowed)
    drawn = {sampler(logits[:1], [row(hot, seed_gen=seeded(i))]).token_ids[0] for i in range(200)}
    assert drawn == set(allowed)
    out = sampler(logits[:1], [row(greedy)])
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[out.token_ids[0]]), abs=1e-5)


def test_a_one_token_bad_word_is_never_sampled_and_a_longer_one_only_after_its_start(sampler):
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # token 2 is the best, then 3
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[2]]  # as resolve_bad_words sets it from the tokenizer
    assert sampler(logits, [row(params, prompt=[1], output=[4])]).token_ids == [3]
    params.bad_words_token_ids = [[4, 1, 2]]  # banned only right after 4, 1
    assert sampler(logits, [row(params, prompt=[1], output=[])]).token_ids == [2]
    assert sampler(logits, [row(params, prompt=[4], output=[1])]).token_ids == [2]  # 4 is the prompt's
    assert sampler(logits, [row(params, prompt=[4, 1], output=[4, 1])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[4, 1, 0])]).token_ids == [2]


def test_bans_never_leave_a_row_without_a_token(sampler):
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    # the only allowed token is a bad word: the bans would empty the row, so it keeps the allowed token
    params = SamplingParams(temperature=0.0, allowed_token_ids=[3])
    params.bad_words_token_ids = [[3]]
    assert sampler(logits, [row(params)]).token_ids == [3]
    # the same under min_tokens: EOS is the only allowed token
    params = SamplingParams(temperature=1.0, seed=0, min_tokens=2, allowed_token_ids=[1])
    assert sampler(logits, [row(params, seed_gen=seeded(0), eos=[1])]).token_ids == [1]


def test_resolve_bad_words_bans_a_word_at_the_start_and_after_a_space():
    vocab = {"hello": [7], " hello": [8], "big cat": [3, 4], " big cat": [5, 4]}
    params = SamplingParams(bad_words=["  hello", "big cat"])
    params.resolve_bad_words(lambda text: vocab[text])
    assert params.bad_words_token_ids == [[7], [8], [3, 4], [5, 4]]
    same = SamplingParams(bad_words=["x"])
    same.resolve_bad_words(lambda text: [9])  # both spellings give the same tokens: kept once
    assert same.bad_words_token_ids == [[9]]


@pytest.mark.parametrize("kwargs, match", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": 5}, "must be a list of token ids"),
    ({"allowed_token_ids": [1, -2]}, "integer >= 0"),
    ({"bad_words": "word"}, "must be a list of strings"),
    ({"bad_words": ["ok", "  "]}, "non-space text"),
    ({"bad_words": [3]}, "non-space text"),
])
def test_bad_allowed_token_ids_and_bad_words_are_refused(kwargs, match):
    from pagedllm.errors import RequestError

    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_allowed_token_ids_and_bad_words_are_held_to_the_limits():
    from pagedllm.errors import RequestError
    from pagedllm.limits import RequestLimits

    limits = RequestLimits(max_logit_bias=2, max_stop_chars=5)
    with pytest.raises(RequestError, match=r"allowed_token_ids.*\[0, 10\)"):
        SamplingParams(allowed_token_ids=[3, 10]).check_limits(limits, 10)
    with pytest.raises(RequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=list(range(10)) * 2).check_limits(limits, 10)
    with pytest.raises(RequestError, match="bad_words"):
        SamplingParams(bad_words=["a", "b", "c"]).check_limits(limits, 10)
    with pytest.raises(RequestError, match="at most 5 characters"):
        SamplingParams(bad_words=["abcdef"]).check_limits(limits, 10)
    SamplingParams(allowed_token_ids=[9], bad_words=["ab", "cd"]).check_limits(limits, 10)


def test_out_of_vocab_ids_are_ignored(sampler):
    logits = torch.tensor([[0.0, 1.0]])
    params = SamplingParams(temperature=0.0, logit_bias={99: 5.0}, repetition_penalty=1.2)
    assert sampler(logits, [row(params, prompt=[50], output=[70])]).token_ids == [1]


# ------------------------------------------------------------ seeds


def test_seeded_row_is_independent_of_the_batch(sampler):
    vocab = 1000
    params = SamplingParams(temperature=1.0, seed=7)
    alone_gen, batch_gen = seeded(7), seeded(7)
    other_seeded_gen = seeded(99)
    alone, batched = [], []
    for step in range(6):
        logits = random_logits(4, vocab=vocab, seed=step)
        alone.append(sampler(logits[2:3], [row(params, seed_gen=alone_gen)]).token_ids[0])
        rows = [
            row(SamplingParams(temperature=0.9)),  # unseeded
            row(SamplingParams(temperature=0.0)),  # greedy
            row(params, seed_gen=batch_gen),
            row(SamplingParams(temperature=1.3, top_p=0.9, seed=99), seed_gen=other_seeded_gen),
        ]
        batched.append(sampler(logits, rows).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # really sampling, not stuck on one token


def test_same_seed_same_tokens_different_seed_differs(sampler):
    logits = random_logits(1, vocab=1000)
    params = SamplingParams(temperature=1.0, seed=1)

    def run(seed):
        gen = seeded(seed)
        return [sampler(logits, [row(params, seed_gen=gen)]).token_ids[0] for _ in range(8)]

    assert run(1) == run(1)
    assert run(1) != run(2)


# ------------------------------------------------------------ logprobs


def test_logprobs_ranks_and_top_logprobs_come_from_raw_logits(sampler):
    logits = random_logits(3, vocab=20, seed=3)
    raw = torch.log_softmax(logits, -1)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0), prompt=[0, 1]),
        row(SamplingParams(temperature=0.7)),  # did not ask
        row(SamplingParams(temperature=1.0, logprobs=0, logit_bias={5: 100.0})),
    ]
    out = sampler(logits, rows)
    assert out.token_ids[2] == 5
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert out.ranks[i] == int((raw[i] > raw[i, token]).sum()) + 1
    values, ids = raw[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(values.tolist())
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_chosen_logprob_without_logprobs_requested_is_the_raw_one(sampler):
    """No row asks for logprobs: the chosen token's logprob still comes from the raw
    logits (logit - logsumexp), after penalties and bias changed the choice."""
    logits = random_logits(4, vocab=50, seed=9) * 4
    raw = torch.log_softmax(logits, -1)
    rows = [
        row(),
        row(SamplingParams(temperature=0.0, logit_bias={7: 50.0})),
        row(SamplingParams(temperature=0.9, seed=1), seed_gen=seeded(1)),
        row(SamplingParams(temperature=0.0, repetition_penalty=3.0), prompt=[int(logits[3].argmax())]),
    ]
    out = sampler(logits, rows)
    assert out.top_logprobs is None and out.ranks is None
    assert out.token_ids[1] == 7
    assert out.token_ids[3] != int(logits[3].argmax())
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)


def test_greedy_logprob_of_uniform_logits(sampler):
    out = sampler(torch.zeros(1, 4), [row(SamplingParams(temperature=0.0, logprobs=1))])
    assert out.logprobs[0] == pytest.approx(math.log(0.25))
    assert out.ranks == [1]


def test_compute_logprobs_and_top_k_helpers():
    logits = torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float16)
    lp = compute_logprobs(logits)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(1))
    values, ids = top_k_logprobs(lp, 2)
    assert ids.tolist() == [[1, 2]]
    assert values[0, 0] > values[0, 1]


# ------------------------------------------------------------ mixed batches


def test_mixed_batch(sampler):
    vocab = 30
    logits = random_logits(5, vocab=vocab, seed=11)
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.5, top_k=1)),
        row(SamplingParams(temperature=2.0, top_p=1e-6, min_p=0.1)),
        row(SamplingParams(temperature=0.0, logit_bias={4: 50.0})),
        row(SamplingParams(temperature=1.0, top_k=3, seed=5), seed_gen=seeded(5)),
    ]
    out = sampler(logits, rows)
    best = logits.argmax(-1).tolist()
    assert out.token_ids[:3] == best[:3]
    assert out.token_ids[3] == 4
    assert out.token_ids[4] in logits[4].topk(3).indices.tolist()
    assert len(out.logprobs) == 5 and out.top_logprobs is None


def test_rejects_mismatched_rows(sampler):
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 4), [row()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_path_runs_on_cuda(sampler):
    device = torch.device("cuda")
    logits = random_logits(4, vocab=1000).to(device)
    gen = torch.Generator(device=device).manual_seed(3)
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={1: 1.0}, logprobs=2), prompt=[1]),
        row(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2), output=[4]),
        row(SamplingParams(temperature=0.8, top_k=5, min_p=0.05, seed=3), seed_gen=gen),
        row(SamplingParams(temperature=1.0, min_tokens=3, frequency_penalty=0.5), eos=[2]),
    ]
    out = sampler(logits, rows)
    assert out.token_ids[0] == sampler(logits[:1].cpu(), rows[:1]).token_ids[0]
    assert out.token_ids[2] in logits[2].topk(5).indices.tolist()
    assert out.token_ids[3] != 2
