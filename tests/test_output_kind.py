"""SamplingParams.output_kind (vLLM's RequestOutputKind): what a request's step outputs hold.

CUMULATIVE (the default) gives everything so far at each step; DELTA only what is new
since the last output, so the deltas joined are the cumulative output; FINAL_ONLY one
output when the request ends. Checked on the real engine (a 2-layer random-weight model
with the default model's tokenizer, so the text is real text), through LLMEngine.step,
AsyncLLMEngine.generate and LLM.generate.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.errors import RequestError
from pagedllm.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"
KINDS = RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_default_tokenizer_model) -> LLM:
    return LLM(model=str(tiny_default_tokenizer_model), dtype="float32", device="cpu", block_size=16,
               num_kv_blocks=64)


def _params(kind: RequestOutputKind, **options) -> SamplingParams:
    options = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1,
               **options}
    return SamplingParams(output_kind=kind, **options)


def _steps(llm: LLM, request_id: str, params: SamplingParams) -> list:
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _joined(outputs: list, index: int) -> tuple[str, list, list]:
    pieces = [c for o in outputs for c in o.outputs if c.index == index]
    return ("".join(c.text for c in pieces), [t for c in pieces for t in c.token_ids],
            [lp for c in pieces for lp in c.logprobs])


def test_step_outputs_follow_the_output_kind(llm):
    cumulative = _steps(llm, "cumulative", _params(KINDS.CUMULATIVE))
    final = cumulative[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 12
    delta = _steps(llm, "delta", _params(KINDS.DELTA))
    assert len(delta) == len(cumulative) > 2
    text, tokens, logprobs = _joined(delta, 0)
    assert (text, tokens) == (final.outputs[0].text, final.outputs[0].token_ids) and text
    assert logprobs == final.outputs[0].logprobs
    assert all(len(o.outputs[0].token_ids) >= 1 for o in delta)  # a step's new tokens, not the whole
    assert delta[0].prompt_logprobs == final.prompt_logprobs and all(o.prompt_logprobs is None for o in delta[1:])
    assert delta[-1].finished and not any(o.finished for o in delta[:-1])
    last = delta[-1].outputs[0]
    assert (last.finish_reason, last.cumulative_logprob) == ("length", final.outputs[0].cumulative_logprob)
    only = _steps(llm, "final", _params(KINDS.FINAL_ONLY))
    assert len(only) == 1 and only[0].finished
    assert only[0].outputs[0].token_ids == final.outputs[0].token_ids


def test_deltas_of_parallel_samples_join_to_each_sample(llm):
    sampled = {"n": 2, "temperature": 0.9, "seed": 7, "prompt_logprobs": None, "logprobs": None}
    want = _steps(llm, "samples-c", _params(KINDS.CUMULATIVE, **sampled))[-1]
    delta = _steps(llm, "samples-d", _params(KINDS.DELTA, **sampled))
    for completion in want.outputs:
        pieces = [c for o in delta for c in o.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids


def test_async_streams_apply_the_kind_and_llm_generate_returns_whole_outputs(llm):
    want = llm.generate(PROMPT, _params(KINDS.CUMULATIVE), use_tqdm=False)[0]
    for kind in (KINDS.DELTA, KINDS.FINAL_ONLY):  # LLM.generate: finished, whole outputs whatever the kind
        got = llm.generate(PROMPT, _params(kind), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].text == want.outputs[0].text

    async def main():
        served = AsyncLLMEngine(llm.llm_engine)
        try:
            delta = [o async for o in served.generate("async-delta", PROMPT, _params(KINDS.DELTA, max_tokens=40))]
            final = [o async for o in served.generate("async-final", PROMPT, _params(KINDS.FINAL_ONLY))]
        finally:
            await served.shutdown(0)
        return delta, final

    delta, final = asyncio.run(asyncio.wait_for(main(), 60))
    longer = llm.generate(PROMPT, _params(KINDS.CUMULATIVE, max_tokens=40), use_tqdm=False)[0]
    text, tokens, logprobs = _joined(delta, 0)  # outputs the stream merged are joined too
    assert (text, tokens, logprobs) == (longer.outputs[0].text, longer.outputs[0].token_ids, longer.outputs[0].logprobs)
    assert delta[0].prompt_logprobs == longer.prompt_logprobs and all(o.prompt_logprobs is None for o in delta[1:])
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("bad", [3, -1, True, "delta", 1.0, None])
def test_an_unknown_output_kind_is_a_request_error(bad):
    with pytest.raises(RequestError, match="output_kind: must be RequestOutputKind"):
        SamplingParams(output_kind=bad)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_stream_interval_spaces_the_outputs_and_loses_nothing(llm):
    """stream_interval (vLLM's field): an output once at least that many new tokens exist, and the
    finished one always; with DELTA the pieces still join to the whole."""
    want = _steps(llm, "every", _params(KINDS.CUMULATIVE, max_tokens=10))[-1]
    spaced = _steps(llm, "spaced", _params(KINDS.CUMULATIVE, max_tokens=10, stream_interval=4))
    assert [len(o.outputs[0].token_ids) for o in spaced] == [4, 8, 10]  # one token a step
    assert spaced[-1].finished and spaced[-1].outputs[0].token_ids == want.outputs[0].token_ids
    delta = _steps(llm, "spaced-delta", _params(KINDS.DELTA, max_tokens=10, stream_interval=3))
    assert [len(o.outputs[0].token_ids) for o in delta] == [3, 3, 3, 1]
    assert _joined(delta, 0)[:2] == (want.outputs[0].text, want.outputs[0].token_ids)

    async def main():
        served = AsyncLLMEngine(llm.llm_engine)
        try:
            return [o async for o in served.generate("async-spaced", PROMPT, _params(KINDS.DELTA, max_tokens=10,
                                                                                    stream_interval=4))]
        finally:
            await served.shutdown(0)

    streamed = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(len(o.outputs[0].token_ids) >= 4 for o in streamed[:-1]) and streamed[-1].finished
    assert _joined(streamed, 0)[:2] == (want.outputs[0].text, want.outputs[0].token_ids)


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "2"])
def test_a_stream_interval_below_one_or_not_an_integer_is_a_request_error(bad):
    with pytest.raises(RequestError, match="stream_interval: must be an integer >= 1"):
        SamplingParams(stream_interval=bad)
