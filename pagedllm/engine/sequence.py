"""Sequences and the requests (groups of sequences) they belong to.

A sequence is a token list whose KV is computed up to ``num_computed_tokens``;
the scheduler's only question about it is how far that count lags behind
``num_tokens``. There are no prefill/decode phases: a fresh prompt, a later
chunk, a recompute after preemption and a decode step are all "catch up".

``num_tokens`` counts the tokens the sequence has, known or not: inside an
overlapped engine step a token may still be being drawn on the device
(``num_pending_tokens``); its id is not known yet, so it is in no token list,
hash, detokenizer or stop check, but its position is scheduled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.outputs import (
    CompletionOutput,
    OutputProgress,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no blocks: not yet admitted, or preempted by recompute
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # holds CPU blocks only
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # the request failed (Request.error), or one sequence's grammar reached a dead end (Sequence.error)


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt plus what has been generated for it.

    ``seq_id`` is unique within one engine, which hands ids out (LLMEngine.new_seq_id).
    """

    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    seq_id: int
    sample_index: int = 0
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer when detokenizing
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Tokens drawn on the device and not read yet; they follow token_ids (0 or
    # 1, and 0 between engine steps: only an overlapped step sets it).
    num_pending_tokens: int = 0
    grammar: object | None = None  # GrammarState when the request is constrained (pagedllm.structured)
    # Why this sequence (alone) ended with FinishReason.ERROR: its grammar reached a dead end.
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones: the positions the sequence occupies."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose ids are known (pending ones excluded)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self, sample_index: int, seq_id: int) -> Sequence:
        """A copy under ``seq_id`` that continues independently (its own detokenizer state)."""
        assert self.num_pending_tokens == 0, "a sequence forks only once its tokens are known"
        child = Sequence(
            seq_id=seq_id,
            prompt_len=self.prompt_len,
            token_ids=list(self.token_ids),
            sample_index=sample_index,
            num_computed_tokens=self.num_computed_tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )
        return child


@dataclass(eq=False)
class Request:
    """A user request: one prompt and the sequences generated from it.

    ``seqs`` holds the live sequences; finished ones move to ``finished_seqs``.
    For sampling requests with n or best_of > 1 the prompt is computed once by
    a single sequence and forked when its first token is sampled.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list | None = None
    forked: bool = False  # samples fanned out (only relevant when num_samples > 1)
    # Prompt tokens whose KV seqs[0] computes for every sequence of the request
    # (set when a recomputed multi-sequence request shares its prompt again).
    shared_prefix_len: int = 0
    # While its disk-tier prefix blocks load (time.monotonic()), admission may wait for them.
    prefetch_deadline: float | None = None
    beam: object | None = None  # BeamState for beam search requests
    # what its step outputs hold (RequestOutputKind; the engine's caller may override the params')
    output_kind: int = 0
    # what they handed out so far (DELTA, stream_interval: the params'; 1 where the caller overrides the kind)
    progress: OutputProgress = field(default_factory=OutputProgress)
    grammar: object | None = None  # CompiledGrammar of params.structured_outputs (pagedllm.structured)

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs need logits at every prompt position."""
        return not self.is_beam_search and self.params.prompt_logprobs is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """No prompt block comes from the prefix cache (or a tier): where prompt logprobs need every
        position's logits, or the request asks (``skip_reading_prefix_cache``). The blocks it
        computes are still cached for other requests."""
        if self.is_beam_search:
            return False
        return self.needs_prompt_logits or bool(self.params.skip_reading_prefix_cache)

    @property
    def num_samples(self) -> int:
        if self.is_beam_search:
            return self.params.beam_width
        return self.params.num_samples

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def final_num_tokens(self, max_model_len: int) -> int:
        """The most tokens a sequence of this request reaches: prompt + max_tokens, within max_model_len."""
        max_tokens = self.params.max_tokens
        limit = len(self.prompt_token_ids) + max_tokens if max_tokens is not None else max_model_len
        return min(limit, max_model_len)

    def ends_by_length(self, num_tokens: int, max_model_len: int) -> bool:
        """Whether a sequence of this request that holds ``num_tokens`` tokens is done by length
        (the one place that says so: stop checks, beams and overlapped steps ask here)."""
        return num_tokens >= self.final_num_tokens(max_model_len)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def to_output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=self.error,
        )
