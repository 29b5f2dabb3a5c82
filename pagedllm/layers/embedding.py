"""Token embedding and LM head, both split by vocabulary across tensor-parallel ranks.

Rank ``r`` holds the rows of token ids ``[start, end)`` (:func:`shard_range`
of the vocabulary). The embedding looks up the ids it holds, writes zeros for
the others and all-reduces; the LM head computes its ids' logits and gathers
them into the full ``[rows, vocab]`` on the first rank, the only one that samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.distributed import SINGLE_PROCESS, TensorParallelGroup
from pagedllm.layers.linear import (
    DenseLinearMethod,
    PackedWeightHolder,
    _copy_checked,
    bind_dense,
    restore_dense_weight,
)


def vocab_parallel_lookup(input_ids: Tensor, vocab_start: int, vocab_end: int, tp: TensorParallelGroup,
                          lookup) -> Tensor:
    """``lookup(local ids)`` for the ids this rank holds (``[vocab_start, vocab_end)``), zeros for
    the others, summed over the ranks."""
    held = (input_ids >= vocab_start) & (input_ids < vocab_end)
    out = lookup(torch.where(held, input_ids - vocab_start, 0))
    out.masked_fill_(~held.unsqueeze(1), 0.0)
    return tp.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """``ids [T] -> [T, hidden]``; this rank's weight is ``[end - start, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = tp.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size), requires_grad=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.vocab_end, self.tp,
                                     lambda ids: F.embedding(ids, self.weight))

    def load_weight(self, name: str, tensor: Tensor, part: int, what: str) -> None:
        _copy_checked(self.weight.data, tensor[self.vocab_start : self.vocab_end], what)


class ParallelLMHead(PackedWeightHolder):
    """``hidden [N, hidden] -> logits [N, vocab]`` float32, over this rank's vocabulary rows.

    Tied to an embedding, it multiplies by the embedding's weight (no
    parameter of its own); either way its matmul kernel is chosen by
    :func:`dense_matmul` like a dense linear layer's.
    """

    num_parts = 1

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE_PROCESS,
        tied: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = tp.shard(vocab_size)
        self._tied = [tied] if tied is not None else []  # a list: not registered as a submodule
        if tied is None:
            DenseLinearMethod().create_weights(self, hidden_size, self.vocab_end - self.vocab_start, bias=False)
        self.matmul = None

    @property
    def weight_tensor(self) -> Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        # an untied head's packed copy is its only one; a tied one packs the embedding's, which the lookup needs
        bind_dense(self, self.weight_tensor, release=not self._tied)

    def forward(self, hidden: Tensor) -> Tensor | None:
        """The full ``[N, vocab]`` on the first rank; None on the others, which only hand it their columns."""
        float_output = getattr(self.matmul, "float_output", None)
        if float_output is not None and self.tp.size == 1:  # float32 logits straight from the kernel
            return float_output(hidden)
        logits = self.matmul(hidden, self.weight_tensor, None)  # [N, vocab_local]
        gathered = self.tp.gather_columns(logits, self.vocab_size)
        return None if gathered is None else gathered.float()

    def load_weight(self, name: str, tensor: Tensor, part: int, what: str) -> None:
        restore_dense_weight(self)
        _copy_checked(self.weight.data, tensor[self.vocab_start : self.vocab_end], what)
