"""A step's token bitmasks: filled per constrained row, applied to the logits in one op.

The bitmask is ``[rows, ceil(vocab / 32)]`` int32 on the host (xgrammar fills
it there); bit ``j`` of word ``w`` allows token ``32 * w + j``. Rows without a
grammar are not listed in ``rows`` and their logits are left untouched.

Between the engine and the worker one row travels as ``bytes``: its int32
words in native byte order (``4 * ceil(vocab / 32)`` bytes). The engine fills
all of a step's rows into one tensor (``fill_rows``) and the worker joins
them back into one (``mask_from_rows``): no per-word Python on either side.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
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


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_rows(states: Sequence[GrammarState], vocab_size: int) -> list[bytes]:
    """Each state's allowed next tokens as one bitmask row (bytes).

    One library call per row (``GrammarState.next_row``; on a 2-core machine
    that measured faster than xgrammar's batched, multi-threaded fill,
    docs/benchmarks.md), and none for a row already filled at this position
    (the engine fills it right after the token is accepted, to see whether the
    sequence can go on).
    """
    size = 4 * num_words(vocab_size)
    rows = [state.next_row() for state in states]
    assert all(len(row) == size for row in rows), "a grammar's vocabulary differs from the logits' width"
    return rows


def mask_from_rows(rows: Sequence[bytes | None], vocab_size: int) -> GrammarMask | None:
    """The mask of a batch whose row i is ``rows[i]`` (None: unconstrained); None when none is."""
    constrained = [i for i, row in enumerate(rows) if row is not None]
    if not constrained:
        return None
    words = num_words(vocab_size)
    # Built in numpy: torch would split a fill this small across its threads, which costs
    # more than the fill (milliseconds when the cores are busy).
    # -1: all bits set, so an unconstrained row would allow everything (it is never applied).
    bitmask = np.full((len(rows), words), -1, dtype=np.int32)
    joined = b"".join(rows[i] for i in constrained)
    bitmask[constrained] = np.frombuffer(joined, dtype=np.int32).reshape(len(constrained), words)
    return GrammarMask(torch.from_numpy(bitmask), constrained)


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
