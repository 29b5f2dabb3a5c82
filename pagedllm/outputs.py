"""What the engine returns, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the top-k plus the chosen token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # With finish_reason "error" and no RequestOutput.error: this output's grammar reached a dead end
    # (nothing may follow ``text``, which is not a complete match). Its siblings are not affected.
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class BeamSearchSequence:
    """One hypothesis as vLLM's ``beam_search`` returns it: ``tokens`` and ``text``
    hold the prompt followed by the generated part."""

    tokens: list[int]
    text: str
    cum_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when finish_reason == "error"
    extra: dict = field(default_factory=dict)

    @property
    def sequences(self) -> list[BeamSearchSequence]:
        """``outputs`` in the shape of vLLM's BeamSearchOutput.sequences (best first for beam search)."""
        return [
            BeamSearchSequence(
                tokens=[*self.prompt_token_ids, *o.token_ids],
                text=(self.prompt or "") + o.text,
                cum_logprob=o.cumulative_logprob,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in self.outputs
        ]



class DeltaTracker:
    """Turns cumulative outputs into deltas for one choice (text and token positions sent)."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_tokens = 0

    def take(self, completion: CompletionOutput) -> tuple[str, int, int]:
        """New text, and the [start, end) range of new token positions, since the last call."""
        text = completion.text[self.num_chars :]
        start, end = self.num_tokens, len(completion.token_ids)
        self.num_chars = max(self.num_chars, len(completion.text))
        self.num_tokens = max(self.num_tokens, end)
        return text, start, end


@dataclass
class OutputProgress:
    """What a request's outputs handed out so far: per output index a :class:`DeltaTracker`
    (DELTA outputs), whether the prompt logprobs went out, and the longest completion's tokens in
    the last output handed out (``stream_interval``, the request's)."""

    stream_interval: int = 1
    trackers: dict[int, DeltaTracker] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    sent_tokens: int = 0


def delta_output(progress: OutputProgress, output: RequestOutput) -> RequestOutput:
    """``output`` (cumulative) less what ``progress`` says was handed out: each completion's new
    text, token ids and logprobs (its cumulative logprob and finish reason as they are), the
    prompt logprobs the first time only. Records what it hands out."""
    completions = []
    for c in output.outputs:
        text, start, end = progress.trackers.setdefault(c.index, DeltaTracker()).take(c)
        completions.append(dataclasses.replace(
            c, text=text, token_ids=c.token_ids[start:end],
            logprobs=None if c.logprobs is None else c.logprobs[start:end],
        ))
    prompt_logprobs = None if progress.sent_prompt_logprobs else output.prompt_logprobs
    progress.sent_prompt_logprobs = True
    return dataclasses.replace(output, outputs=completions, prompt_logprobs=prompt_logprobs)


def stream_due(progress: OutputProgress, output: RequestOutput) -> bool:
    """Whether ``output`` (cumulative) holds ``progress.stream_interval`` tokens more than the last
    one handed out (in its longest completion); if so, records it as handed out."""
    tokens = max((len(c.token_ids) for c in output.outputs), default=0)
    if tokens - progress.sent_tokens < progress.stream_interval:
        return False
    progress.sent_tokens = tokens
    return True
