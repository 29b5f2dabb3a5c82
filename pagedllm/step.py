"""The step contract between the engine and its workers: plain, picklable data.

The engine (scheduler, block manager, stop checks, detokenizer) and the
:class:`~pagedllm.worker.worker.Worker` (model, KV tensors, sampler) import
this module and nothing of each other. A worker keeps a persistent batch of
the sequences it has seen, so a step carries only what changed:

* a sequence's token list, prompt length and sampling parameters once,
  when the worker first meets it (:class:`NewSequence`);
* per scheduled chunk, its position, token count, the tokens the worker does
  not already hold (None when it does: the prompt it was sent, or the token
  it sampled itself) and the change to its block table
  (:class:`ScheduledSeq`); in a steady decode step that is a few integers per
  sequence, whatever the context length;
* the memory operations to carry out first, in order, and the sequences to
  forget.

A step's result carries sampled tokens and the logprobs that were asked
for, never full logits (:class:`StepResult`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class MemoryOpKind(enum.Enum):
    SWAP_OUT = "swap_out"  # pairs are (device block, cpu block)
    SWAP_IN = "swap_in"  # pairs are (cpu block, device block)
    COPY = "copy"  # pairs are (src, dst) device blocks: copy-on-write
    # The tiered prefix cache. The host tier lives in the same CPU pool as swap.
    HOST_TIER_OUT = "host_tier_out"  # (device block, cpu block): keep an evicted block's KV in host memory
    HOST_TIER_IN = "host_tier_in"  # (cpu block, device block): a host-tier prefix hit
    DISK_TIER_OUT = "disk_tier_out"  # (device block, write ticket): hand a host copy to the disk writer
    DISK_TIER_IN = "disk_tier_in"  # (read ticket, device block): a prefetched disk-tier hit
    HOST_TIER_TO_DISK = "host_tier_to_disk"  # (cpu block, write ticket): saving the host tier at shutdown


@dataclass
class MemoryOp:
    kind: MemoryOpKind
    pairs: list[tuple[int, int]]


def can_batch(done: list[tuple[int, int]], new: list[tuple[int, int]]) -> bool:
    """Whether ``new`` pairs may join the op of ``done`` pairs (one batched gather and scatter):
    none of them reads or rewrites a block that op writes."""
    written = {dst for _, dst in done}
    return all(src not in written and dst not in written for src, dst in new)


@dataclass
class NewSequence:
    """A sequence the worker has not seen: everything it keeps about it, sent once.

    ``token_ids`` are the tokens known so far (prompt, plus outputs for a fork
    or a sequence the worker forgot); ``sample_index`` seeds its generator.
    """

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams | BeamSearchParams
    sample_index: int = 0


@dataclass
class ScheduledSeq:
    """One sequence's chunk of this step.

    Positions ``start_pos .. start_pos + num_tokens - 1`` are computed.
    ``token_ids`` is None when the worker holds those tokens already.
    The block table from index ``block_table_start`` on becomes
    ``new_block_ids`` (empty and equal to the table's length: unchanged).
    ``sample_targets``: when the chunk ends its sequence's known tokens and
    logits are wanted, the sequences that get a token drawn from its last
    row, as (seq_id, sample_index); more than one when an n > 1 request forks
    its samples there. ``num_beam_candidates`` > 0 asks instead for the best
    continuations of a beam (token ids and logprobs). ``prompt_logprobs``
    asks for the logprobs of the prompt tokens after each of its positions.
    ``allowed_token_bitmask`` (structured outputs): the tokens the sequence's
    grammar allows next, bit ``j`` of word ``w`` allowing token ``32 w + j``
    (``ceil(vocab / 32)`` int32 words, xgrammar's layout, as bytes in native
    order); the others get -inf before sampling, or in a beam's log-softmax
    before its candidates are picked.
    """

    seq_id: int
    start_pos: int
    num_tokens: int
    token_ids: list[int] | None
    block_table_start: int
    new_block_ids: list[int]
    sample_targets: list[tuple[int, int]] = field(default_factory=list)
    num_beam_candidates: int = 0
    prompt_logprobs: bool = False
    allowed_token_bitmask: bytes | None = None


@dataclass
class StepInput:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    memory_ops: list[MemoryOp] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)


@dataclass
class SampledToken:
    """A drawn token with its logprob under the unprocessed distribution.

    ``rank`` and ``top_logprobs`` (best first, ``params.logprobs`` of them; or the
    ``params.logprob_token_ids`` in their order, each with its rank in ``top_ranks``)
    are set only for sequences whose parameters ask for logprobs.
    """

    seq_id: int
    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    top_ranks: list[int] | None = None  # the ranks of top_logprobs' tokens; None: 1, 2, ... (best first)


@dataclass
class BeamCandidates:
    """A beam's best continuations: token ids and log-softmax values (after temperature), best first."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float]


@dataclass
class PromptLogprob:
    """The logprob of prompt token ``position`` given the tokens before it."""

    position: int
    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)
    beams: list[BeamCandidates] = field(default_factory=list)
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)  # by seq_id
