"""The worker's persistent batch: what it keeps about every sequence between steps.

Filled from :class:`~pagedllm.step.StepInput` messages, so each step needs to
say only what changed (see pagedllm.step). Tokens the worker drew in a step
whose results were not read yet live on the device; :meth:`InputBatch.chunks`
marks where they go and the worker fills them in from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.step import NewSequence, ScheduledSeq, StepInput


@dataclass
class SeqState:
    """A sequence as the worker knows it: tokens (prompt first), block table, parameters."""

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams | BeamSearchParams
    sample_index: int
    block_table: list[int]


@dataclass
class BatchChunk:
    """A scheduled chunk with its tokens resolved (the shape ``build_model_inputs`` reads).

    ``token_ids[-1]`` is not known on the host when ``token_on_device``: the
    worker takes it from the previous step's draw.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    needs_logits: bool
    all_logits: bool
    token_on_device: bool


class InputBatch:
    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def update(self, step: StepInput) -> None:
        """Forget finished sequences, add new ones, apply each chunk's tokens and block table change."""
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            self.add(new)
        for chunk in step.scheduled:
            state = self.seqs[chunk.seq_id]
            state.block_table[chunk.block_table_start :] = chunk.new_block_ids
            if chunk.token_ids is not None:
                del state.token_ids[chunk.start_pos :]
                state.token_ids.extend(chunk.token_ids)

    def add(self, new: NewSequence) -> None:
        self.seqs[new.seq_id] = SeqState(list(new.token_ids), new.prompt_len, new.params, new.sample_index, [])

    def chunks(self, step: StepInput) -> list[BatchChunk]:
        """The step's chunks over the batch; call after :meth:`update`."""
        return [self._chunk(chunk) for chunk in step.scheduled]

    def _chunk(self, chunk: ScheduledSeq) -> BatchChunk:
        state = self.seqs[chunk.seq_id]
        end = chunk.start_pos + chunk.num_tokens
        on_device = end == len(state.token_ids) + 1  # the last token is still being read back
        if on_device:
            assert chunk.num_tokens == 1, "only a decode token can come from the device"
            tokens = [0]  # overwritten on the device before the forward pass
        else:
            tokens = state.token_ids[chunk.start_pos : end]
        return BatchChunk(
            chunk.seq_id, tokens, chunk.start_pos, state.block_table,
            needs_logits=bool(chunk.sample_targets) or chunk.num_beam_candidates > 0,
            all_logits=chunk.prompt_logprobs, token_on_device=on_device,
        )
