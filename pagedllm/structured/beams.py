"""Grammar constraints on beam search candidates."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pagedllm.structured.bitmask import grammar_mask
from pagedllm.structured.grammar import GrammarState


def constrain_beam_logprobs(
    states: Sequence[GrammarState], log_probs: torch.Tensor, at_limit: bool, stop_ids: Collection[int]
) -> torch.Tensor:
    """``log_probs`` ``[num_beams, vocab]`` (host) with forbidden continuations at -inf, in place.

    Not renormalised: a hypothesis keeps the model's own logprob, as with HF's
    logits processors in beam search. At the length limit only a stop token
    the grammar accepts may come next, so every finished hypothesis is a
    complete match of the grammar rather than one cut short.
    """
    mask = grammar_mask(list(states), log_probs.shape[1])
    mask.apply(log_probs)
    if at_limit:
        stops = torch.zeros(log_probs.shape[1], dtype=torch.bool)
        stops[[t for t in stop_ids if 0 <= t < log_probs.shape[1]]] = True
        log_probs.masked_fill_(~stops, float("-inf"))
    return log_probs
