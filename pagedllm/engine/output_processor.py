"""After the forward pass: sample, append tokens, fork samples, check stop conditions.

Works on whole steps: the sampler sees every row of the batch at once; the
per-sequence Python here is bookkeeping (append, stop checks, detokenize).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedllm.engine.beam import beam_output, beam_step
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import FinishReason, Request, SeqStatus, Sequence
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    compute_logprobs,
    on_device,
    top_k_logprobs,
)
from pagedllm.structured.bitmask import GrammarMask, grammar_mask
from pagedllm.structured.grammar import GrammarState
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class PendingSample:
    """A step's tokens drawn on the device and not read yet (see ``OutputProcessor.start_sampling``)."""

    jobs: list[tuple[Request, Sequence]]  # row i of the tensors belongs to jobs[i]
    token_ids: torch.Tensor  # [rows] int64, on the device: the next step's inputs come from here
    logprobs: torch.Tensor  # [rows] fp32: each chosen token's logprob
    ready: torch.cuda.Event | None = None  # on CUDA: recorded after the copies to the host below
    host_token_ids: torch.Tensor | None = None  # pinned host copies, read once ``ready``
    host_logprobs: torch.Tensor | None = None

    def start_copy_to_host(self) -> None:
        """Queue the copies to pinned host memory now, right behind the sampling kernels.

        Reading a CUDA tensor later with .tolist() would wait for everything
        queued on the stream by then, the next step's forward pass included.
        """
        if not self.token_ids.is_cuda:
            return
        self.host_token_ids = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype, pin_memory=True)
        self.host_logprobs = torch.empty(self.logprobs.shape, dtype=self.logprobs.dtype, pin_memory=True)
        self.host_token_ids.copy_(self.token_ids, non_blocking=True)
        self.host_logprobs.copy_(self.logprobs, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def read(self) -> tuple[list[int], list[float]]:
        """(tokens, logprobs) on the host; waits only for this step's own work."""
        if self.ready is None:
            return self.token_ids.tolist(), self.logprobs.tolist()
        self.ready.synchronize()
        return self.host_token_ids.tolist(), self.host_logprobs.tolist()

    def row_of(self) -> dict[int, int]:
        """seq_id -> row, for the sequences that get a token from this step."""
        return {seq.seq_id: i for i, (_, seq) in enumerate(self.jobs)}


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
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
    )


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``; no copy when that is every row in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, on_device(rows, logits.device))


def _grammar_mask(jobs, vocab_size: int) -> GrammarMask | None:
    """The step's token bitmask for the (request, seq, ...) jobs; None when none is constrained."""
    return grammar_mask([job[1].grammar for job in jobs], vocab_size)


def sample_generator(seed: int | None, sample_index: int, device: torch.device) -> torch.Generator | None:
    """Per-sequence generator: sample i of a seeded request draws from its own stream."""
    if seed is None:
        return None
    stream_seed = seed if sample_index == 0 else hash((seed, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(stream_seed)


class OutputProcessor:
    def __init__(
        self, scheduler: Scheduler, tokenizer: Tokenizer, max_model_len: int, device: torch.device
    ) -> None:
        self.scheduler = scheduler
        self.device = device
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._num_new_tokens = 0

    def take_num_new_tokens(self) -> int:
        n, self._num_new_tokens = self._num_new_tokens, 0
        return n

    # ---- sequences --------------------------------------------------------

    def new_sequence(self, request: Request, sample_index: int) -> Sequence:
        seq = Sequence(
            prompt_len=len(request.prompt_token_ids),
            token_ids=list(request.prompt_token_ids),
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
        seq.generator = sample_generator(params.seed, seq.sample_index, self.device)
        if params.logprobs is not None:
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

    def process(self, out: SchedulerOutput, logits: torch.Tensor, row_counts: list[int]) -> list[Request]:
        """Consume the step's logits; returns the requests that changed."""
        jobs: list[tuple[Request, Sequence, int]] = []  # (request, seq, logits row)
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        touched: dict[str, Request] = {}
        row = 0
        for chunk, (request, seq), count in zip(out.chunks, out.entries, row_counts):
            if chunk.all_logits:
                self._record_prompt_logprobs(request, chunk, logits[row : row + count])
            if chunk.needs_logits and not seq.is_finished and not request.is_finished:
                if request.is_beam_search:
                    beam_rows.setdefault(request.request_id, []).append((seq, row + count - 1))
                else:
                    jobs.extend(self._fan_out(request, seq, row + count - 1))
                touched[request.request_id] = request
            row += count
        if jobs:
            self._sample(jobs, logits)
        for rid, rows in beam_rows.items():
            beam_step(self, touched[rid], rows, logits)
        return list(touched.values())

    def start_sampling(self, out: SchedulerOutput, logits: torch.Tensor, row_counts: list[int]) -> PendingSample | None:
        """Draw the step's tokens without reading them back, when every row allows it.

        None when some row needs the host now (see ``can_sample_ahead``); then
        ``process`` handles the step as usual. Otherwise ``finish_sampling``
        reads the tokens later, so the host can schedule and launch the next
        step while this one still runs on the device.
        """
        jobs: list[tuple[Request, Sequence]] = []
        rows: list[int] = []
        row = 0
        for chunk, (request, seq), count in zip(out.chunks, out.entries, row_counts):
            if chunk.all_logits or not can_sample_ahead(request):
                return None
            if seq.grammar is not None and seq.awaits_token:
                return None  # its mask needs the token still being drawn; process() runs once it is read
            if chunk.needs_logits and not seq.is_finished and not request.is_finished:
                jobs.append((request, seq))
                rows.append(row + count - 1)
            row += count
        if not jobs:
            return None
        token_ids, logprobs = self.sampler.sample_tensors(
            _select_rows(logits, rows), self._sampling_rows(jobs), _grammar_mask(jobs, logits.shape[1])
        )
        pending = PendingSample(jobs, token_ids, logprobs)
        pending.start_copy_to_host()
        return pending

    def finish_sampling(self, pending: PendingSample) -> list[Request]:
        """Read the drawn tokens and append them; returns the requests that changed.

        A sequence that finished or was aborted since the step was launched
        gets nothing: the step computed a position it will never use.
        """
        tokens, logprobs = pending.read()  # waits for the device
        touched: dict[str, Request] = {}
        for (request, seq), token, logprob in zip(pending.jobs, tokens, logprobs):
            if seq.is_finished or request.is_finished:
                continue
            self._accept(request, seq, token, logprob, None)
            touched[request.request_id] = request
        return list(touched.values())

    def _fan_out(self, request: Request, seq: Sequence, row: int) -> list[tuple[Request, Sequence, int]]:
        """The first token of an n>1 request: fork the prompt's sequence into its samples."""
        num_samples = request.params.num_samples  # a sampling request: beams never come here
        if request.forked or num_samples == 1:
            return [(request, seq, row)]
        request.forked = True
        jobs = [(request, seq, row)]
        for index in range(1, num_samples):
            child = seq.fork(index)
            self._init_seq_state(request, child)
            self.scheduler.fork_seq(seq, child)
            request.seqs.append(child)
            jobs.append((request, child, row))
        return jobs

    def _sampling_rows(self, jobs) -> list[SamplingRow]:
        """What the sampler needs of each (request, seq, ...) job: the sequence's own token list, not a copy."""
        eos_token_ids = self.eos_token_ids
        return [
            SamplingRow(job[0].params, job[1].token_ids, job[1].prompt_len, job[1].generator, eos_token_ids)
            for job in jobs
        ]

    def _sample(self, jobs: list[tuple[Request, Sequence, int]], logits: torch.Tensor) -> None:
        logits = _select_rows(logits, [row for _, _, row in jobs])
        result = self.sampler(logits, self._sampling_rows(jobs), _grammar_mask(jobs, logits.shape[1]))
        for i, (request, seq, _) in enumerate(jobs):
            self._append(request, seq, result, i)

    def count_new_tokens(self, request: Request, num_tokens: int) -> None:
        """Token accounting and first/last-token times for the request's metrics."""
        self._num_new_tokens += num_tokens
        now = time.monotonic()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now

    def _append(self, request: Request, seq: Sequence, result: SamplerOutput, i: int) -> None:
        token = result.token_ids[i]
        position = self._position_logprobs(token, result, i) if seq.logprobs is not None else None
        self._accept(request, seq, token, result.logprobs[i], position)

    def _accept(
        self, request: Request, seq: Sequence, token: int, logprob: float, position: dict[int, Logprob] | None
    ) -> None:
        if seq.awaits_token:
            # The next step was scheduled before this token was read; it holds
            # the token's place (LLMEngine's overlapped steps).
            seq.token_ids[-1] = token
            seq.awaits_token = False
        else:
            seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        self.count_new_tokens(request, 1)
        if position is not None:
            seq.logprobs.append(position)
        if seq.grammar is not None and not seq.grammar.accept(token):
            self._fail_grammar(request, seq, token)
            return
        stop_str = seq.detokenizer.add_tokens([token]) if seq.detokenizer is not None else None
        self._check_stop(request, seq, token, stop_str)

    def _fail_grammar(self, request: Request, seq: Sequence, token: int) -> None:
        """A token the grammar forbids was drawn (e.g. min_tokens banned the only allowed stop)."""
        request.error = f"token {token} is not allowed by the request's structured_outputs grammar"
        seq.finish_reason = FinishReason.ERROR
        seq.grammar = None
        self.scheduler.finish_seq(request, seq)

    def _position_logprobs(self, token: int, result: SamplerOutput, i: int) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for rank, (tid, lp) in enumerate(result.top_logprobs[i] if result.top_logprobs else [], start=1):
            entry[tid] = Logprob(lp, rank, self.tokenizer.id_to_piece(tid))
        if token not in entry:
            rank = result.ranks[i] if result.ranks else None
            entry[token] = Logprob(result.logprobs[i], rank, self.tokenizer.id_to_piece(token))
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
        elif params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        else:
            return
        seq.grammar = None
        self.scheduler.finish_seq(request, seq)
        if request.is_finished:
            request.metrics.finished_time = time.monotonic()

    def _record_prompt_logprobs(self, request: Request, chunk, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens 1.. from the logits at positions 0..; token 0 gets None."""
        k = request.params.prompt_logprobs
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        prompt = request.prompt_token_ids
        logprobs = compute_logprobs(logits)
        top_vals, top_ids = top_k_logprobs(logprobs, k) if k else (None, None)
        for j in range(logits.shape[0]):
            pos = chunk.start_pos + j + 1
            if pos >= len(prompt) or len(request.prompt_logprobs) > pos:
                continue
            token = prompt[pos]
            row = logprobs[j]
            entry: dict[int, Logprob] = {}
            if top_ids is not None:
                for rank, (tid, lp) in enumerate(zip(top_ids[j].tolist(), top_vals[j].tolist()), start=1):
                    entry[tid] = Logprob(lp, rank, self.tokenizer.id_to_piece(tid))
            if token not in entry:
                rank = int((row > row[token]).sum().item()) + 1
                entry[token] = Logprob(float(row[token]), rank, self.tokenizer.id_to_piece(token))
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
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
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
        )
