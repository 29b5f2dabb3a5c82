"""Beam bookkeeping on hand-made candidates (no model): the finished pool holds real hypotheses only.

The end-to-end oracle is HF transformers (tests/test_sharing.py); these pin the
edge cases that counts and masks decide: a pool that is not full yet, and
continuations a grammar forbids (logprob -inf), which never become hypotheses.
"""

from __future__ import annotations

import itertools
import math

from pagedllm.engine.beam import beam_output, beam_step
from pagedllm.engine.sequence import Request, SeqStatus, Sequence
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import BeamSearchParams
from pagedllm.step import BeamCandidates

EOS = 3
NEG_INF = float("-inf")


class _Scheduler:
    def finish_request(self, request, reason):
        for seq in request.live_seqs():
            seq.finish_reason = reason
        request.status = SeqStatus.FINISHED

    def fork_seq(self, parent, child):
        pass

    def free_seq(self, seq):
        pass


class _Tokenizer:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


class _Processor:
    """What beam_step and beam_output use of the engine's OutputProcessor."""

    def __init__(self):
        self.scheduler = _Scheduler()
        self.tokenizer = _Tokenizer()
        self.max_model_len = 1000
        self.eos_token_ids = (EOS,)
        self.new_seq_id = itertools.count(1).__next__
        self.num_new_tokens = 0

    def count_new_tokens(self, request, n):
        self.num_new_tokens += n


def _request(width: int, max_tokens: int, grammar: bool = False) -> Request:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    request = Request("r", None, [1, 2], params, RequestMetrics(0.0))
    request.seqs.append(Sequence(prompt_len=2, token_ids=[1, 2], seq_id=0))
    if grammar:
        request.grammar = "a grammar"  # beam_step only asks whether there is one
    return request


def _step(processor, request, per_beam: list[list[tuple[int, float]]]) -> None:
    rows = [
        (seq, BeamCandidates(seq.seq_id, [t for t, _ in cands], [lp for _, lp in cands]))
        for seq, cands in zip(request.seqs, per_beam, strict=True)
    ]
    beam_step(processor, request, rows)


def test_the_pool_counts_its_hypotheses_and_an_ended_continuation_never_runs_on():
    processor, request = _Processor(), _request(width=2, max_tokens=5)
    # best continuation ends (EOS): one hypothesis; the next two go on as the beams
    _step(processor, request, [[(EOS, -0.1), (7, -0.5), (8, -0.9), (9, -2.0)]])
    state = request.beam
    assert (state.num_finished, state.is_full) == (1, False)
    assert state.finished_tokens == [[EOS]] and math.isclose(state.finished_logprobs[0], -0.1, rel_tol=1e-6)
    assert [s.output_token_ids for s in request.seqs] == [[7], [8]]
    assert not request.is_finished
    # the second hypothesis fills the pool; a beam worse than both cannot improve: done
    _step(processor, request, [[(EOS, -0.2), (5, -9.0), (6, -9.5), (4, -9.9)], [(6, -9.0), (5, -9.1), (4, -9.2), (EOS, -9.3)]])
    out = beam_output(processor, request)
    assert request.is_finished and state.is_full
    assert [o.token_ids for o in out.outputs] == [[EOS], [7, EOS]]
    assert [o.finish_reason for o in out.outputs] == ["stop", "stop"]


def test_a_forbidden_continuation_at_the_length_limit_is_no_hypothesis():
    processor, request = _Processor(), _request(width=2, max_tokens=1, grammar=True)
    # the only token left is the last by length, and the grammar forbids every candidate
    _step(processor, request, [[(7, NEG_INF), (8, NEG_INF), (9, NEG_INF), (EOS, NEG_INF)]])
    assert request.is_finished
    assert request.beam.num_finished == 0 and beam_output(processor, request).outputs == []


def test_the_beams_text_keeps_special_tokens_only_when_asked():
    """BeamSearchParams.skip_special_tokens (vLLM's field) decides the finished beams' text, with the
    default model's real tokenizer: a beam that ends with EOS shows it only when not skipped."""
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    eos = tokenizer.eos_token_id
    word = tokenizer.encode("Paris", add_special_tokens=False)
    texts = {}
    for skip in (True, False):
        processor = _Processor()
        processor.tokenizer, processor.eos_token_ids = tokenizer, (eos,)
        request = Request("r", None, [1, 2], BeamSearchParams(beam_width=1, max_tokens=len(word) + 1,
                                                             skip_special_tokens=skip), RequestMetrics(0.0))
        request.seqs.append(Sequence(prompt_len=2, token_ids=[1, 2], seq_id=0))
        for token in [*word, eos]:
            others = [t for t in range(4, 10) if t not in (token, eos)][:3]
            _step(processor, request, [[(token, -0.1)] + [(t, -9.0 - t) for t in others]])
        (out,) = beam_output(processor, request).outputs
        assert out.token_ids == [*word, eos] and out.finish_reason == "stop"
        texts[skip] = out.text
    assert texts[True] == "Paris"
    assert texts[False] == "Paris" + tokenizer.decode([eos], skip_special_tokens=False) != "Paris"
