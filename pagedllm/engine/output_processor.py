"""After the worker's step: append its tokens, fork samples, rank beams, check stop conditions.

The worker samples (pagedllm.worker); what comes back is plain data
(:class:`~pagedllm.step.StepResult`): tokens and the logprobs asked for.
The per-sequence Python here is bookkeeping (append, stop checks, detokenize).
"""

from __future__ import annotations

import time

from pagedllm.engine.beam import beam_output, beam_step
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import FinishReason, Request, SeqStatus, Sequence
from pagedllm.engine.step_builder import StepBuilder
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.step import PromptLogprob, SampledToken, StepResult
from pagedllm.structured.grammar import GrammarState
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer


def can_sample_ahead(request: Request) -> bool:
    """Whether the request's next step may be scheduled before this step's token is read.

    Its sampling must not depend on the token still being drawn (no penalties
    over the outputs), and a token must not fan out into forks or beams or
    carry top logprobs, whose bookkeeping needs the host to see every step.
    """
    params = request.params
    return (
        not request.is_beam_search
        and params.num_samples == 1
        and params.num_logprobs is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        # a bad word of several tokens is banned by the tokens just generated
        and not any(len(seq) > 1 for seq in params.bad_words_token_ids or ())
    )


_DEAD_END_TAIL_TOKENS = 16  # of an output whose grammar dead-ended, the end quoted in the error


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, steps: StepBuilder, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.steps = steps
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.new_seq_id = steps.new_seq_id  # the engine's sequence ids (the builder names forks with them too)
        self._num_new_tokens = 0

    def take_num_new_tokens(self) -> int:
        n, self._num_new_tokens = self._num_new_tokens, 0
        return n

    # ---- sequences --------------------------------------------------------

    def new_sequence(self, request: Request, sample_index: int) -> Sequence:
        seq = Sequence(
            prompt_len=len(request.prompt_token_ids),
            token_ids=list(request.prompt_token_ids),
            seq_id=self.new_seq_id(),
            sample_index=sample_index,
        )
        if request.grammar is not None:
            seq.grammar = GrammarState.start(request.grammar)
        self._init_seq_state(request, seq)
        return seq

    def _init_seq_state(self, request: Request, seq: Sequence) -> None:
        params = request.params
        if request.is_beam_search:
            return
        if params.num_logprobs is not None:
            seq.logprobs = []
        if params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )

    # ---- one step ---------------------------------------------------------

    def process(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Consume the step's result; returns the requests that changed."""
        sampled = {token.seq_id: token for token in result.sampled}
        beams = {candidates.seq_id: candidates for candidates in result.beams}
        beam_rows: dict[str, list] = {}
        touched: dict[str, Request] = {}
        for chunk, (request, seq) in zip(out.chunks, out.entries):
            if chunk.all_logits:
                self._record_prompt_logprobs(request, result.prompt_logprobs.get(seq.seq_id, []))
            if chunk.needs_logits and not seq.is_finished and not request.is_finished:
                if request.is_beam_search:
                    beam_rows.setdefault(request.request_id, []).append((seq, beams[seq.seq_id]))
                else:
                    for target in self._fan_out(request, seq):
                        self._accept(request, target, sampled[target.seq_id])
                touched[request.request_id] = request
        for rid, rows in beam_rows.items():
            beam_step(self, touched[rid], rows)
        return list(touched.values())

    def can_launch(self, out: SchedulerOutput) -> bool:
        """Whether the step's tokens may be read later (see ``can_sample_ahead``): every row
        allows it and some sequence draws a token."""
        has_job = False
        for chunk, (request, seq) in zip(out.chunks, out.entries):
            if chunk.all_logits or not can_sample_ahead(request):
                return False
            if seq.grammar is not None and seq.num_pending_tokens:
                return False  # its mask needs the token still being drawn
            has_job = has_job or (chunk.needs_logits and not seq.is_finished and not request.is_finished)
        return has_job

    def launched_jobs(self, out: SchedulerOutput) -> list[tuple[Request, Sequence]]:
        """The (request, sequence) pairs that draw a token in a launched step."""
        return [
            (request, seq) for chunk, (request, seq) in zip(out.chunks, out.entries)
            if chunk.needs_logits and not seq.is_finished and not request.is_finished
        ]

    def finish_launched(self, jobs: list[tuple[Request, Sequence]], result: StepResult) -> list[Request]:
        """Append a launched step's tokens; returns the requests that changed.

        A sequence that finished or was aborted since the step was launched
        gets nothing: the step computed a position it will never use.
        """
        sampled = {token.seq_id: token for token in result.sampled}
        touched: dict[str, Request] = {}
        for request, seq in jobs:
            if seq.is_finished or request.is_finished:
                continue
            self._accept(request, seq, sampled[seq.seq_id])
            touched[request.request_id] = request
        return list(touched.values())

    def _fan_out(self, request: Request, seq: Sequence) -> list[Sequence]:
        """The first token of an n>1 request: fork the prompt's sequence into its samples
        (under the ids the step gave their draws)."""
        child_ids = self.steps.fork_ids.pop(seq.seq_id, None)
        if request.forked or request.params.num_samples == 1 or child_ids is None:
            return [seq]
        request.forked = True
        targets = [seq]
        for index, child_id in enumerate(child_ids, start=1):
            child = seq.fork(index, seq_id=child_id)
            self._init_seq_state(request, child)
            self.scheduler.fork_seq(seq, child)
            request.seqs.append(child)
            targets.append(child)
        return targets

    def count_new_tokens(self, request: Request, num_tokens: int) -> None:
        """Token accounting and first/last-token times for the request's metrics."""
        self._num_new_tokens += num_tokens
        now = time.monotonic()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now

    def _accept(self, request: Request, seq: Sequence, sampled: SampledToken) -> None:
        token = sampled.token_id
        seq.token_ids.append(token)
        if seq.num_pending_tokens:
            # The next step was scheduled before this token was read (LLMEngine's overlapped steps).
            seq.num_pending_tokens -= 1
        seq.cumulative_logprob += sampled.logprob
        self.count_new_tokens(request, 1)
        if seq.logprobs is not None:
            seq.logprobs.append(self._position_logprobs(sampled))
        if seq.grammar is not None and not seq.grammar.accept(token):
            self._fail_grammar(request, seq, token)
            return
        stop_str = seq.detokenizer.add_tokens([token]) if seq.detokenizer is not None else None
        self._check_stop(request, seq, token, stop_str)

    def _fail_grammar(self, request: Request, seq: Sequence, token: int) -> None:
        """A token the grammar forbids was drawn: a safety net; the sampler never leaves a constrained row
        without an allowed token (a finished grammar wins over the min_tokens ban)."""
        request.error = f"token {token} is not allowed by the request's structured_outputs grammar"
        seq.finish_reason = FinishReason.ERROR
        seq.grammar = None
        self.scheduler.finish_seq(request, seq)

    def _position_logprobs(self, sampled: SampledToken) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        top = sampled.top_logprobs or []
        ranks = sampled.top_ranks if sampled.top_ranks is not None else range(1, len(top) + 1)
        for rank, (tid, lp) in zip(ranks, top, strict=True):
            entry[tid] = Logprob(lp, rank, self.tokenizer.id_to_piece(tid))
        if sampled.token_id not in entry:
            entry[sampled.token_id] = Logprob(sampled.logprob, sampled.rank, self.tokenizer.id_to_piece(sampled.token_id))
        return entry

    def _check_stop(self, request: Request, seq: Sequence, token: int, stop_str: str | None) -> None:
        params = request.params
        num_output_tokens = seq.num_output_tokens
        past_min = num_output_tokens >= params.min_tokens
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_str
        elif past_min and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif past_min and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = FinishReason.STOP  # the grammar took its stop token: nothing may follow
        elif request.ends_by_length(seq.num_tokens, self.max_model_len):
            seq.finish_reason = FinishReason.LENGTH
        elif seq.grammar is not None and seq.grammar.is_dead_end:
            # No token may follow, not even a stop: end here rather than draw from an empty mask.
            seq.finish_reason, seq.error = FinishReason.ERROR, self._dead_end_message(request, seq)
        else:
            return
        seq.grammar = None
        self.scheduler.finish_seq(request, seq)
        if request.is_finished:
            request.metrics.finished_time = time.monotonic()

    def _dead_end_message(self, request: Request, seq: Sequence) -> str:
        kind = request.params.structured_outputs.kind
        kind = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
        tail = self.tokenizer.decode(seq.output_token_ids[-_DEAD_END_TAIL_TOKENS:], skip_special_tokens=False)
        more = "..." if seq.num_output_tokens > _DEAD_END_TAIL_TOKENS else ""
        count = f"{seq.num_output_tokens} token{'s' if seq.num_output_tokens != 1 else ''}"
        return (f"the {kind} reached a dead end after {count}: no token may follow "
                f"{more}{tail!r}, and that output is not a complete match")

    def _record_prompt_logprobs(self, request: Request, entries: list[PromptLogprob]) -> None:
        """Logprobs of prompt tokens 1..; token 0 gets None. A recomputed chunk adds nothing twice."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        for e in entries:
            if len(request.prompt_logprobs) != e.position:
                continue
            entry: dict[int, Logprob] = {}
            for rank, (tid, lp) in enumerate(e.top_logprobs, start=1):
                entry[tid] = Logprob(lp, rank, self.tokenizer.id_to_piece(tid))
            if e.token_id not in entry:
                entry[e.token_id] = Logprob(e.logprob, e.rank, self.tokenizer.id_to_piece(e.token_id))
            request.prompt_logprobs.append(entry)

    # ---- outputs ----------------------------------------------------------

    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's cumulative output, or None while there is nothing to show yet."""
        if request.is_beam_search:
            return beam_output(self, request)
        finished = request.status == SeqStatus.FINISHED
        params = request.params
        if params.num_samples > 1 and (params.best_of or 0) > params.n and not finished:  # not beam search
            return None  # best_of picks the winners at the end
        seqs = request.seqs
        if len(seqs) == 1:  # the usual request: nothing to order or pick
            output = self._completion(seqs[0], 0, finished)
            if not finished and not output.token_ids and request.error is None:
                return None
            return request.to_output([output], finished)
        if len(seqs) > 1:
            seqs = sorted(seqs, key=lambda s: s.sample_index)
        if finished and params.best_of and params.best_of > params.n:
            # A sample whose grammar dead-ended is incomplete: it ranks below every sample that is not.
            seqs = sorted(seqs, key=lambda s: (s.error is None, s.cumulative_logprob), reverse=True)[: params.n]
        outputs = [self._completion(seq, index, finished) for index, seq in enumerate(seqs)]
        if not outputs or (not finished and all(not o.token_ids for o in outputs)):
            if request.error is None:
                return None
        return request.to_output(outputs, finished)

    def _completion(self, seq: Sequence, index: int, request_finished: bool) -> CompletionOutput:
        if seq.detokenizer is None:
            text = ""
        elif seq.is_finished or request_finished:
            text = seq.detokenizer.flush()
        else:
            text = seq.detokenizer.text
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            error=seq.error,
        )
