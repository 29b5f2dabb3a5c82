"""A step's token bitmasks: filled per constrained row, applied to the logits in one op.

The bitmask is ``[rows, ceil(vocab / 32)]`` int32 on the host (xgrammar fills
it there); bit ``j`` of word ``w`` allows token ``32 * w + j``. Rows without a
grammar are not listed in ``rows`` and their logits are left untouched.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedllm.structured.grammar import GrammarState


@dataclass
class GrammarMask:
    """Which logits rows are constrained, and the allowed tokens of each (plain data for the sampler)."""

    bitmask: torch.Tensor  # [num_rows_in_batch, ceil(vocab / 32)] int32, host memory
    rows: list[int]  # rows of the batch that carry a grammar; the others are unmasked

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Sets every forbidden token's logit to -inf, in place, in one batched kernel; returns ``logits``."""
        import xgrammar as xgr

        bitmask = self.bitmask
        if logits.device.type != "cpu":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=self.rows)
        return logits

    def allows_only(self, row: int, token_ids: Collection[int], vocab_size: int) -> bool:
        """Whether ``row`` of the batch allows no token outside ``token_ids`` (of the first ``vocab_size``)."""
        words = self.bitmask[row]  # [ceil(vocab / 32)] int32
        bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]; bit j of word w
        allowed = bits.flatten()[:vocab_size].bool()  # [vocab]
        allowed[[t for t in token_ids if 0 <= t < vocab_size]] = False
        return not bool(allowed.any())


def grammar_mask(states: Sequence[GrammarState | None], vocab_size: int) -> GrammarMask | None:
    """The mask for a batch whose row i samples with ``states[i]``; None when no row has a grammar."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return None
    # -1: all bits set, so a row left unfilled would allow everything (it is never applied).
    bitmask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i in rows:
        states[i].fill_bitmask(bitmask, i)
    return GrammarMask(bitmask, rows)
