"""Beam search inside the engine, with HF transformers' semantics.

Each step, every live beam contributes one row of logits. The 2W best
continuations (summed logprobs over all beams) are ranked; continuations that
end a hypothesis (EOS, or the length limit) and rank among the first W become
finished hypotheses scored ``sum_logprob / generated_len ** length_penalty``;
the W best continuations that do not end become the next beams. On the KV
side, a surviving continuation is its parent beam (first child) or a fork of it
(later children): blocks are shared and only the last one is copied on write.
Parents with no surviving child are freed at once.

Scores are kept in float32 tensors and ranked with ``torch.topk`` so that
near-ties break the same way as the reference implementation. Which
hypotheses exist is said by counts and boolean masks, never by a score: the
finished pool holds only real hypotheses (fewer than W until W have ended),
and a continuation that ends never becomes a live beam.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm.engine.sequence import FinishReason, Request, Sequence
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.step import BeamCandidates


@dataclass
class BeamState:
    """A request's beams between steps.

    The finished pool, best first: ``finished_scores[i]`` (length-penalised),
    ``finished_tokens[i]`` (generated ids) and ``finished_logprobs[i]`` (raw
    summed logprob) describe hypothesis i; at most ``width`` of them.
    """

    width: int
    running_scores: torch.Tensor  # [num_live_beams] float32, aligned with request.seqs
    finished_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))  # [num_finished]
    finished_tokens: list[list[int]] = field(default_factory=list)
    finished_logprobs: list[float] = field(default_factory=list)
    improvement_possible: bool = True

    @classmethod
    def start(cls, width: int) -> BeamState:
        return cls(width=width, running_scores=torch.zeros(1))

    @property
    def num_finished(self) -> int:
        return len(self.finished_tokens)

    @property
    def is_full(self) -> bool:
        """Whether ``width`` hypotheses have finished (a later one enters only by beating one)."""
        return self.num_finished == self.width


def beam_step(processor, request: Request, rows: list[tuple[Sequence, BeamCandidates]]) -> None:
    """One step of the request's beams from each beam's best 2W continuations (the worker's).

    The 2W best continuations over all beams are among the union of each
    beam's 2W best, so ranking the candidates equals ranking the whole
    ``[num_beams, vocab]`` score matrix.
    """
    params = request.params
    state: BeamState = request.beam or BeamState.start(params.beam_width)
    request.beam = state
    width = state.width
    beams = [seq for seq, _ in rows]
    num_candidates = min(len(c.token_ids) for _, c in rows)
    candidate_ids = [c.token_ids[:num_candidates] for _, c in rows]
    log_probs = torch.tensor([c.logprobs[:num_candidates] for _, c in rows])  # [num_beams, 2W]
    accumulated = (log_probs + state.running_scores[:, None]).view(-1)
    top_scores, top_index = torch.topk(accumulated, k=min(2 * width, accumulated.numel()))
    parents = (top_index // num_candidates).tolist()
    tokens = [candidate_ids[p][i % num_candidates] for p, i in zip(parents, top_index.tolist())]

    # (with a grammar, the worker masked each beam's forbidden continuations to -inf first)
    gen_len = beams[0].num_output_tokens + 1  # length of every candidate
    ends = _candidate_ends(processor, request, beams[0], tokens, gen_len)
    _update_finished(state, request, beams, parents, tokens, top_scores, ends, gen_len)
    # The next beams: the best W continuations that go on (not ended; allowed, under a grammar).
    goes_on = (~ends & torch.isfinite(top_scores)).nonzero().flatten()  # [num_going_on], rank order
    keep_scores, best = torch.topk(top_scores[goes_on], k=min(width, goes_on.numel()))
    keep = goes_on[best]
    if keep.numel() == 0:
        processor.scheduler.finish_request(request, FinishReason.STOP)
        request.metrics.finished_time = time.monotonic()
        return
    _update_improvement(state, params, keep_scores, gen_len)

    done = (
        not state.improvement_possible
        or (state.is_full and params.early_stopping is True)
        or bool(ends.all())
    )
    if done:
        processor.scheduler.finish_request(request, FinishReason.STOP)
        request.metrics.finished_time = time.monotonic()
        return
    _advance_beams(processor, request, beams, [parents[i] for i in keep.tolist()],
                   [tokens[i] for i in keep.tolist()])
    state.running_scores = keep_scores.clone()
    processor.count_new_tokens(request, len(request.seqs))


def at_limit(request: Request, beam: Sequence, max_model_len: int) -> bool:
    """Whether the beam's next token is its last by length (every beam has the same length)."""
    return request.ends_by_length(beam.num_tokens + 1, max_model_len)


def stop_ids(params, eos_token_ids) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def _candidate_ends(processor, request: Request, beam: Sequence, tokens: list[int], gen_len: int) -> torch.Tensor:
    limit = at_limit(request, beam, processor.max_model_len)
    stops = stop_ids(request.params, processor.eos_token_ids)
    return torch.tensor([limit or t in stops for t in tokens], dtype=torch.bool)


def _update_finished(state, request, beams, parents, tokens, top_scores, ends, gen_len) -> None:
    """Continuations among the first W that end (and are allowed) join the finished pool,
    which keeps its W best.

    None joins once the search is settled: no improvement is possible, or the
    pool is full and ``early_stopping`` is True.
    """
    params = request.params
    width = state.width
    settled = not state.improvement_possible or (state.is_full and params.early_stopping is True)
    if settled:
        return
    # (a continuation a grammar forbids has score -inf: never a hypothesis)
    joins = ends & (torch.arange(len(tokens)) < width) & torch.isfinite(top_scores)
    joining = joins.nonzero().flatten().tolist()  # rank order
    if not joining:
        return
    scores = top_scores[joining] / (gen_len ** params.length_penalty)
    merged = torch.cat([state.finished_scores, scores])  # [num_finished + num_joining]
    best = torch.topk(merged, k=min(width, merged.numel())).indices.tolist()
    all_tokens = state.finished_tokens + [beams[parents[i]].output_token_ids + [tokens[i]] for i in joining]
    all_logprobs = state.finished_logprobs + top_scores[joining].tolist()
    state.finished_scores = merged[best].clone()
    state.finished_tokens = [all_tokens[i] for i in best]
    state.finished_logprobs = [all_logprobs[i] for i in best]


def _update_improvement(state: BeamState, params, keep_scores: torch.Tensor, gen_len: int) -> None:
    """Whether a live beam can still beat the worst finished hypothesis; while the pool
    has room, any finished hypothesis is an improvement."""
    if not state.is_full:
        return
    if params.early_stopping == "never" and params.length_penalty > 0.0:
        hypothetical_len = params.max_tokens
    else:
        hypothetical_len = gen_len
    best_running = keep_scores[0] / (hypothetical_len ** params.length_penalty)
    state.improvement_possible = state.improvement_possible and bool(best_running > state.finished_scores.min())


def _advance_beams(processor, request: Request, beams: list[Sequence], parents: list[int], tokens: list[int]) -> None:
    """Surviving continuations become the live beams: reuse or fork parents, free the rest."""
    scheduler = processor.scheduler
    used: set[int] = set()
    new_seqs: list[Sequence] = []
    pending: list[tuple[Sequence, int]] = []
    for parent_index, token in zip(parents, tokens):
        parent = beams[parent_index]
        if parent_index in used:
            child = parent.fork(sample_index=0, seq_id=processor.new_seq_id())
            scheduler.fork_seq(parent, child)
        else:
            used.add(parent_index)
            child = parent
        new_seqs.append(child)
        pending.append((child, token))
    for i, beam in enumerate(beams):
        if i not in used:
            scheduler.free_seq(beam)
            beam.grammar = None
    # Append only after every fork, so a fork copies its parent (and its grammar state) before the parent grows.
    for seq, token in pending:
        seq.token_ids.append(token)
        if seq.grammar is not None:
            accepted = seq.grammar.accept(token)
            assert accepted, "the beam's mask allowed a token its grammar rejects"
    request.seqs = new_seqs


def beam_output(processor, request: Request) -> RequestOutput | None:
    if not request.is_finished:
        return None
    state: BeamState | None = request.beam
    outputs = []
    if state is not None:
        eos = set(processor.eos_token_ids) | set(request.params.stop_token_ids)
        for tokens, logprob in zip(state.finished_tokens, state.finished_logprobs):
            ended_by_stop = bool(tokens) and tokens[-1] in eos and not request.params.ignore_eos
            outputs.append(
                CompletionOutput(
                    index=len(outputs),
                    text=processor.tokenizer.decode(tokens, skip_special_tokens=request.params.skip_special_tokens),
                    token_ids=list(tokens),
                    cumulative_logprob=float(logprob),
                    finish_reason="stop" if ended_by_stop else "length",
                )
            )
    return request.to_output(outputs, finished=True)
