"""Pure functions from a scheduled batch to model input tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows] int64: token rows whose logits are returned
    row_counts: list[int]  # logits rows contributed by each chunk (0, 1, or its length)

    @property
    def every_row(self) -> bool:
        """Whether ``logits_indices`` is every token row in order (the rows are ascending and
        distinct, so as many as the tokens are all of them)."""
        return self.logits_indices.shape[0] == self.input_ids.shape[0]


def build_model_inputs(chunks: Sequence, block_size: int, device: torch.device) -> ModelInputs:
    """Flatten the chunks of one step into the tensors of one forward pass.

    Each chunk has ``token_ids``, ``start_pos``, ``block_table``, ``needs_logits``
    and ``all_logits`` (see ScheduledChunk). Slots come from the block tables:
    ``table[p // block_size] * block_size + p % block_size``.
    """
    if all(len(c.token_ids) == 1 for c in chunks):
        return _decode_inputs(chunks, block_size, device)
    return _chunk_inputs(chunks, block_size, device)


def _chunk_inputs(chunks: Sequence, block_size: int, device: torch.device) -> ModelInputs:
    """:func:`build_model_inputs` for chunks of any length, in array operations."""
    query_lens = [len(c.token_ids) for c in chunks]
    start_positions = [c.start_pos for c in chunks]
    seq_lens = [start + n for start, n in zip(start_positions, query_lens)]
    query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])

    input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=num_tokens)
    # Token j of the flat batch belongs to chunk seq_index[j]; its position is
    # j + (start_pos - query_start) of that chunk: no arange per chunk.
    seq_index = np.repeat(np.arange(len(chunks)), query_lens)
    offsets = np.array(start_positions, dtype=np.int64) - query_start[:-1]  # position - flat index, per chunk
    positions = np.arange(num_tokens) + np.repeat(offsets, query_lens)
    tables = _padded_tables(chunks, np.int64)
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size

    logits_indices, row_counts = _logits_rows(chunks, query_start[:-1].tolist(), query_lens)
    return _model_inputs(
        [slots, input_ids, positions.astype(np.int64, copy=False), logits_indices],
        [tables, np.asarray(seq_lens, dtype=np.int64), query_start],
        query_lens, seq_lens, row_counts, device,
    )


def _decode_inputs(chunks: Sequence, block_size: int, device: torch.device) -> ModelInputs:
    """:func:`build_model_inputs` for a step whose every chunk is one token (a decode step), in
    plain Python over the chunks: the same tensors with a few array builds instead of a dozen
    array operations, which cost most of a batch-1 step's input time with the caches cold."""
    positions = [c.start_pos for c in chunks]
    slots = [c.block_table[p // block_size] * block_size + p % block_size for c, p in zip(chunks, positions)]
    seq_lens = [p + 1 for p in positions]
    row_counts = [1 if c.needs_logits or c.all_logits else 0 for c in chunks]
    rows = [i for i, count in enumerate(row_counts) if count]
    n = len(chunks)
    flat = np.array(slots + [c.token_ids[0] for c in chunks] + positions + rows, dtype=np.int64)
    return _model_inputs(
        [flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n], flat[3 * n :]],
        [_padded_tables(chunks, np.int32), np.array(seq_lens, dtype=np.int32), np.arange(n + 1, dtype=np.int32)],
        [1] * n, seq_lens, row_counts, device,
    )


def _padded_tables(chunks: Sequence, dtype) -> np.ndarray:
    """[num_chunks, max_blocks] block tables, zero padded; one conversion of padded lists beats a
    row copy per chunk."""
    max_blocks = max(len(c.block_table) for c in chunks)
    return np.array([list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks], dtype=dtype)


def _model_inputs(
    int64s: list[np.ndarray], int32s: list[np.ndarray], query_lens: list[int], seq_lens: list[int],
    row_counts: list[int], device: torch.device,
) -> ModelInputs:
    """The tensors on ``device``: ``int64s`` = (slots, input ids, positions, logits rows) as int64,
    ``int32s`` = (block tables, sequence lengths, query start locations) as int32 (any integer
    arrays that fit)."""
    if device.type == "cuda":  # one pinned copy of everything, the int32 ones narrowed there
        moved = to_device([a.astype(np.int64, copy=False) for a in int64s + int32s], device)
        tensors = moved[:4] + [t.to(torch.int32) for t in moved[4:]]
    else:
        tensors = [torch.from_numpy(a.astype(np.int64, copy=False)) for a in int64s]
        tensors += [torch.from_numpy(a.astype(np.int32, copy=False)) for a in int32s]
    slot_mapping, input_ids, positions, logits_indices, tables, seq_lens_dev, query_start_loc = tensors
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens_dev,
        query_start_loc=query_start_loc,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_lens_host=query_lens,
    )
    return ModelInputs(
        input_ids=input_ids,
        positions=positions,
        metadata=metadata,
        logits_indices=logits_indices,
        row_counts=row_counts,
    )


def _logits_rows(chunks: Sequence, starts: list[int], query_lens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Flat token rows whose logits are returned, and how many each chunk contributes (0, 1 or all)."""
    rows: list[int] = []
    row_counts: list[int] = []
    for c, start, n in zip(chunks, starts, query_lens):
        if c.all_logits:
            rows.extend(range(start, start + n))
            row_counts.append(n)
        elif c.needs_logits:
            rows.append(start + n - 1)
            row_counts.append(1)
        else:
            row_counts.append(0)
    return np.array(rows, dtype=np.int64), row_counts


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays as int64 tensors on ``device``.

    On CUDA they travel in one copy from pinned memory, which does not wait
    for the device: a copy from pageable memory waits for all work queued
    before it, and would stall the host behind the previous step's forward
    pass when steps overlap (LLMEngine's async scheduling).
    """
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    sizes = [a.size for a in arrays]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    np.concatenate([a.ravel() for a in arrays], out=staging.numpy())
    flat = staging.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays)]
