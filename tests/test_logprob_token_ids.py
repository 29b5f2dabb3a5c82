"""SamplingParams.logprob_token_ids (vLLM 0.32's): the logprobs of exactly the asked tokens.

At every output position the request's logprobs hold the asked ids (in the vocabulary's
log-softmax of the raw logits, each with its rank there) and the drawn token, nothing else.
The oracle for the engine is HF transformers on the same weights: its log-softmax at each
position of the greedy continuation.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import RequestError
from pagedllm.sampling.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import MAX_LOGPROB_TOKEN_IDS


def _row(params: SamplingParams) -> SamplingRow:
    return SamplingRow(params=params, token_ids=[1, 2], prompt_len=2, generator=None, eos_token_ids=())


def test_the_sampler_reports_the_asked_tokens_in_order_with_their_ranks():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    asked = [7, 0, 49, 7]  # any order, a repeat kept as asked
    rows = [_row(SamplingParams(temperature=0.0, logprob_token_ids=asked)),
            _row(SamplingParams(temperature=0.0, logprobs=2)),
            _row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert [t for t, _ in out.top_logprobs[0]] == asked
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(raw[0, asked].tolist(), abs=1e-6)
    assert out.top_ranks[0] == [int((raw[0] > raw[0, t]).sum()) + 1 for t in asked]
    # the other rows as before: top-k best first (ranks implied), nothing
    values, ids = torch.topk(raw[1], 2)
    assert [t for t, _ in out.top_logprobs[1]] == ids.tolist() and out.top_ranks[1] is None
    assert out.top_logprobs[2] == [] and out.top_ranks[2] is None
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("value,message", [
    ([], "must not be empty"),
    ([3, -1], "integer >= 0"),
    ([3, True], "integer >= 0"),
    ("3", "list of token ids"),
    (list(range(MAX_LOGPROB_TOKEN_IDS + 1)), f"at most {MAX_LOGPROB_TOKEN_IDS}"),
])
def test_bad_token_id_lists_are_refused_with_the_field_named(value, message):
    with pytest.raises(RequestError, match=message) as err:
        SamplingParams(logprob_token_ids=value)
    assert "logprob_token_ids" in str(err.value)


def test_logprobs_beside_token_ids_must_count_them():
    with pytest.raises(RequestError, match="logprobs must equal its length"):
        SamplingParams(logprobs=1, logprob_token_ids=[4, 5])
    assert SamplingParams(logprobs=2, logprob_token_ids=[4, 5]).num_logprobs == 2
    assert SamplingParams(logprob_token_ids=[4, 5, 6]).num_logprobs == 3
    assert SamplingParams().num_logprobs is None and SamplingParams(logprobs=0).num_logprobs == 0


@pytest.fixture(scope="module")
def llm(tiny_default_tokenizer_model) -> LLM:
    return LLM(model=str(tiny_default_tokenizer_model), dtype="float32", device="cpu", block_size=16,
               num_kv_blocks=64, max_logprobs=6)


def test_the_engine_returns_the_asked_tokens_logprobs_as_hf_computes_them(llm, tiny_default_tokenizer_model):
    from transformers import LlamaForCausalLM

    prompt = "The quick brown fox jumps over"
    asked = [11, 2000, 40000, 5]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprob_token_ids=asked)
    completion = llm.generate([prompt], params, use_tqdm=False)[0]
    out = completion.outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    hf = LlamaForCausalLM.from_pretrained(str(tiny_default_tokenizer_model), torch_dtype=torch.float32).eval()
    ids = completion.prompt_token_ids + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    start = len(completion.prompt_token_ids) - 1
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[start + j]
        assert set(entry) == {*asked, token}, j
        for t in {*asked, token}:
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=2e-4), (j, t)
            assert entry[t].rank == int((row > row[t]).sum()) + 1, (j, t)
            assert entry[t].decoded_token == llm.get_tokenizer().id_to_piece(t)
        assert entry[token].rank == 1  # greedy


def test_the_engine_refuses_ids_past_the_vocabulary_or_the_logprob_limit(llm):
    vocab = llm.get_tokenizer().vocab_size
    with pytest.raises(RequestError, match="logprob_token_ids"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, logprob_token_ids=[vocab + 10]), use_tqdm=False)
    with pytest.raises(RequestError, match="logprob_token_ids"):  # max_logprobs=6 bounds the ids too
        llm.generate(["hi"], SamplingParams(max_tokens=1, logprob_token_ids=list(range(7))), use_tqdm=False)
