"""Engine side of the step contract: the scheduler's decisions as a :class:`StepInput`.

The builder remembers what the worker holds (each sequence's block table as
last sent, and which token the worker drew itself), so each message carries
only what changed: a new sequence once, then per step its position, token
count, any tokens the worker lacks and the tail of its block table that
changed. Sequences the scheduler freed since the last step are named once,
and the worker forgets them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from pagedllm.engine.beam import at_limit as beam_at_limit
from pagedllm.engine.beam import stop_ids as beam_stop_ids
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Request, Sequence
from pagedllm.step import NewSequence, ScheduledSeq, StepInput
from pagedllm.structured import bitmask


def _signed_words(words: list[int]) -> list[int]:
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def _table_change(sent: list[int], table: list[int]) -> tuple[int, list[int]]:
    """(first index that changed, the table from there on): appends, copy-on-write, swaps alike."""
    if len(table) >= len(sent) and table[: len(sent)] == sent:
        return len(sent), table[len(sent) :]
    start = next((i for i, (a, b) in enumerate(zip(sent, table)) if a != b), min(len(sent), len(table)))
    return start, table[start:]


class StepBuilder:
    def __init__(
        self, scheduler: Scheduler, new_seq_id: Callable[[], int], vocab_size: int, max_model_len: int,
        eos_token_ids: tuple[int, ...] = (), send_sampled_tokens: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.send_sampled_tokens = send_sampled_tokens
        self.new_seq_id = new_seq_id  # the engine's source of fresh sequence ids (forks get theirs before the step)
        self._step_ids = itertools.count()
        self._tables: dict[int, list[int]] = {}  # seq_id -> block table as the worker holds it
        self._sampled_at: dict[int, int] = {}  # seq_id -> position of the token the worker drew itself
        self.fork_ids: dict[int, list[int]] = {}  # parent seq_id -> ids of the samples it forks into

    def build(self, out: SchedulerOutput) -> StepInput:
        step = StepInput(step_id=next(self._step_ids), memory_ops=list(out.memory_ops))
        step.finished_seq_ids = self._drain_freed()
        constrained: list[tuple[ScheduledSeq, Request, Sequence]] = []
        for chunk, (request, seq) in zip(out.chunks, out.entries):
            scheduled = self._scheduled(step, chunk, request, seq)
            step.scheduled.append(scheduled)
            # a pending token's grammar state is not known yet: its mask comes with grammar_masks() later
            if chunk.needs_logits and seq.grammar is not None and not seq.num_pending_tokens:
                constrained.append((scheduled, request, seq))
        rows = self._allowed_tokens([(request, seq) for _, request, seq in constrained])
        for (scheduled, _, _), row in zip(constrained, rows):
            scheduled.allowed_token_bitmask = row
        return step

    def _drain_freed(self) -> list[int]:
        freed = []
        for seq_id in self.scheduler.take_freed_seq_ids():
            self._sampled_at.pop(seq_id, None)
            if self._tables.pop(seq_id, None) is not None:
                freed.append(seq_id)
        return freed

    def _scheduled(self, step: StepInput, chunk, request: Request, seq: Sequence) -> ScheduledSeq:
        sent = self._tables.get(seq.seq_id)
        num_tokens = chunk.num_tokens
        worker_drew_it = num_tokens == 1 and self._sampled_at.get(seq.seq_id) == chunk.start_pos
        if sent is None:
            assert not seq.num_pending_tokens, "a sequence the worker has not seen has no token in flight"
            step.new_seqs.append(
                NewSequence(seq.seq_id, list(seq.token_ids), seq.prompt_len, request.params, seq.sample_index)
            )
            token_ids, sent = None, []
        elif worker_drew_it:
            token_ids = None  # the worker drew it (and may not have read it back yet)
        else:
            assert not chunk.num_pending_tokens, "a pending token is one the worker drew itself"
            token_ids = list(chunk.token_ids)
        table_start, new_blocks = _table_change(sent, chunk.block_table)
        self._tables[seq.seq_id] = list(chunk.block_table)
        scheduled = ScheduledSeq(
            seq.seq_id, chunk.start_pos, num_tokens, token_ids, table_start, new_blocks,
            prompt_logprobs=chunk.all_logits,
        )
        if chunk.needs_logits:
            self._plan_sampling(scheduled, request, seq, chunk.start_pos + num_tokens)
        return scheduled

    def _plan_sampling(self, scheduled: ScheduledSeq, request: Request, seq: Sequence, position: int) -> None:
        if request.is_beam_search:
            scheduled.num_beam_candidates = 2 * request.params.beam_width
            return
        targets = [(seq.seq_id, seq.sample_index)]
        if request.params.num_samples > 1 and not request.forked:
            children = [self.new_seq_id() for _ in range(1, request.params.num_samples)]
            self.fork_ids[seq.seq_id] = children
            targets += [(child, index) for index, child in enumerate(children, start=1)]
        scheduled.sample_targets = targets
        if not self.send_sampled_tokens:
            self._sampled_at[seq.seq_id] = position

    def grammar_masks(self, out: SchedulerOutput) -> dict[int, bytes]:
        """Bitmask rows of the step's constrained sequences that are still live (seq_id -> row)."""
        live = [
            (request, seq) for chunk, (request, seq) in zip(out.chunks, out.entries)
            if chunk.needs_logits and seq.grammar is not None and not seq.is_finished
        ]
        return {seq.seq_id: row for (_, seq), row in zip(live, self._allowed_tokens(live))}

    def _allowed_tokens(self, entries: list[tuple[Request, Sequence]]) -> list[bytes]:
        """The grammar's bitmask row for each sequence's next token, filled together; a beam
        at its length limit may take only a stop token the grammar accepts (a complete match,
        not a cut one)."""
        if not entries:
            return []
        rows = bitmask.fill_rows([seq.grammar for _, seq in entries], self.vocab_size)
        for i, (request, seq) in enumerate(entries):
            if request.is_beam_search and beam_at_limit(request, seq, self.max_model_len):
                rows[i] = self._only_stops(request, rows[i])
        return rows

    def _only_stops(self, request: Request, row: bytes) -> bytes:
        """``row`` with every token but the request's stop tokens cleared."""
        words = [0] * bitmask.num_words(self.vocab_size)
        for token in beam_stop_ids(request.params, self.eos_token_ids):
            if 0 <= token < self.vocab_size:
                words[token // 32] |= 1 << (token % 32)
        stops = torch.tensor(_signed_words(words), dtype=torch.int32)
        return (torch.frombuffer(bytearray(row), dtype=torch.int32) & stops).numpy().tobytes()
