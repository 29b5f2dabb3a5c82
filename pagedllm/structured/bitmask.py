"""A step's token bitmasks: filled per constrained row, applied to the logits in one op.

The bitmask is ``[rows, ceil(vocab / 32)]`` int32 on the host (xgrammar fills
it there); bit ``j`` of word ``w`` allows token ``32 * w + j``. Rows without a
grammar are not listed in ``rows`` and their logits are left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
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
