"""A naive dense attention oracle and random paged batches for backend tests.

The oracle never reads the paged cache: it takes each sequence's full K/V as
dense tensors and runs plain softmax attention with a causal mask, so any
indexing mistake in a paged backend shows up as a mismatch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from pagedllm.attention.base import AttentionMetadata


@dataclass
class PagedBatch:
    """Random inputs for one forward pass, plus the dense truth they encode."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    new_key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    new_value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]; old context pre-filled
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per seq [seq_len, num_kv_heads, head_dim] (context + new)
    dense_values: list[torch.Tensor]
    scale: float


def naive_attention(query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Dense causal attention per sequence, computed in float64."""
    md = batch.metadata
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    for i, (seq_len, q_len) in enumerate(zip(md.seq_lens_host, md.query_lens_host)):
        start = int(md.query_start_loc[i])
        q = query[start : start + q_len].double()  # [q_len, H, D]
        k = batch.dense_keys[i].double()  # [seq_len, KH, D]
        v = batch.dense_values[i].double()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def make_paged_batch(
    seq_specs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """Build a batch from (context_len, query_len) per sequence.

    ``context_len`` tokens are already in the cache (a prefix hit, an earlier
    chunk, or decode history); ``query_len`` new tokens arrive this step.
    Block tables are shuffled and non-contiguous; block 0 is never used so a
    table that wrongly reads a zero entry is caught. ``num_padding_tokens``
    extra query rows with slot -1 are appended (their outputs are ignored).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in seq_specs]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)  # garbage everywhere
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    tables, dense_k, dense_v = [], [], []
    queries, new_keys, new_values, slots = [], [], [], []
    for (ctx, q_len), n_blocks in zip(seq_specs, blocks_needed):
        table = [free.pop() for _ in range(n_blocks)]
        tables.append(table)
        seq_len = ctx + q_len
        keys = randn(seq_len, num_kv_heads, head_dim)
        values = randn(seq_len, num_kv_heads, head_dim)
        dense_k.append(keys)
        dense_v.append(values)
        for pos in range(seq_len):
            block, off = table[pos // block_size], pos % block_size
            if pos < ctx:
                k_cache[block, off] = keys[pos]
                v_cache[block, off] = values[pos]
            else:
                slots.append(block * block_size + off)
        queries.append(randn(q_len, num_heads, head_dim))
        new_keys.append(keys[ctx:])
        new_values.append(values[ctx:])
    if num_padding_tokens:
        queries.append(randn(num_padding_tokens, num_heads, head_dim))
        new_keys.append(randn(num_padding_tokens, num_kv_heads, head_dim))
        new_values.append(randn(num_padding_tokens, num_kv_heads, head_dim))
        slots.extend([-1] * num_padding_tokens)
    max_blocks = max(len(t) for t in tables)
    table_tensor = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        table_tensor[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    query_lens = [q for _, q in seq_specs]
    seq_lens = [c + q for c, q in seq_specs]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    dev = torch.device(device)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=table_tensor.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_lens_host=query_lens,
    )
    return PagedBatch(
        query=torch.cat(queries).to(dev),
        new_key=torch.cat(new_keys).to(dev),
        new_value=torch.cat(new_values).to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        metadata=md,
        dense_keys=[k.to(dev) for k in dense_k],
        dense_values=[v.to(dev) for v in dense_v],
        scale=1.0 / math.sqrt(head_dim),
    )
