"""Paged attention in plain PyTorch: the reference every faster backend is tested
against, and the CPU production path.

Decode tokens (query length 1) of a batch are computed together: their blocks
are gathered by block table into one padded tensor with a single index op and
attended with a length mask. Prefill and chunked-prefill sequences are
computed one at a time with ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Reads and writes the ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
    ) -> None:
        """Store token t's K/V at flat slot ``slot_mapping[t]``; rows with -1 are dropped."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, KH, D]
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        flat_k[slots] = key[keep].to(k_cache.dtype)
        flat_v[slots] = value[keep].to(v_cache.dtype)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each sequence's new tokens over its first ``seq_len``
        cached tokens. Padding rows past the last sequence come back as zeros."""
        out = torch.zeros_like(query)
        starts = _query_starts(metadata.query_lens_host)
        decode_seqs = [i for i, q in enumerate(metadata.query_lens_host) if q == 1]
        if decode_seqs:
            rows = [starts[i] for i in decode_seqs]
            _decode_batch(query, out, k_cache, v_cache, metadata, decode_seqs, rows, scale)
        for i, q_len in enumerate(metadata.query_lens_host):
            if q_len > 1:
                _prefill_one(query, out, k_cache, v_cache, metadata, i, starts[i], scale)
        return out


def _query_starts(query_lens: list[int]) -> list[int]:
    """Host-side prefix sums: the first query row of each sequence."""
    starts, total = [], 0
    for q_len in query_lens:
        starts.append(total)
        total += q_len
    return starts


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, KH, D]
    tables: torch.Tensor,  # [S, n] block ids
) -> torch.Tensor:  # [S, n * block_size, KH, D]
    num_seqs, num_blocks = tables.shape
    gathered = cache[tables.long()]  # [S, n, block_size, KH, D]
    return gathered.reshape(num_seqs, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3])


def _decode_batch(
    query: torch.Tensor,  # [num_tokens, H, D]
    out: torch.Tensor,  # [num_tokens, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    seq_ids: list[int],
    rows: list[int],
    scale: float,
) -> None:
    """One query token per sequence, all sequences at once (padded to the longest)."""
    device = query.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = query.shape[1]
    lens_host = [md.seq_lens_host[i] for i in seq_ids]
    max_len = max(lens_host)
    num_blocks = -(-max_len // block_size)
    seq_index = torch.tensor(seq_ids, device=device)
    row_index = torch.tensor(rows, device=device)
    tables = md.block_tables.index_select(0, seq_index)[:, :num_blocks]  # [S, n]
    keys = _gather_blocks(k_cache, tables)[:, :max_len]  # [S, L, KH, D]
    values = _gather_blocks(v_cache, tables)[:, :max_len]
    group = num_heads // num_kv_heads
    num_seqs = len(seq_ids)
    q = query.index_select(0, row_index).view(num_seqs, num_kv_heads, group, head_dim)
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = q.to(compute_dtype)
    keys = keys.permute(0, 2, 3, 1).to(compute_dtype)  # [S, KH, D, L]
    values = values.permute(0, 2, 1, 3).to(compute_dtype)  # [S, KH, L, D]
    scores = torch.matmul(q, keys) * scale  # [S, KH, G, L]
    lens = torch.tensor(lens_host, device=device)
    beyond = torch.arange(max_len, device=device).unsqueeze(0) >= lens.unsqueeze(1)  # [S, L]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    result = torch.matmul(probs, values)  # [S, KH, G, D]
    out.index_copy_(0, row_index, result.reshape(num_seqs, num_heads, head_dim).to(out.dtype))


def _prefill_one(
    query: torch.Tensor,  # [num_tokens, H, D]
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    seq: int,
    start: int,
    scale: float,
) -> None:
    """Several new tokens of one sequence at positions ``seq_len - q_len .. seq_len - 1``."""
    seq_len, q_len = md.seq_lens_host[seq], md.query_lens_host[seq]
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    table = md.block_tables[seq : seq + 1, :num_blocks]  # [1, n]
    keys = _gather_blocks(k_cache, table)[0, :seq_len].transpose(0, 1)  # [KH, L, D]
    values = _gather_blocks(v_cache, table)[0, :seq_len].transpose(0, 1)
    q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
    group = q.shape[0] // keys.shape[0]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=0)  # [H, L, D]
        values = values.repeat_interleave(group, dim=0)
    mask = None
    if q_len != seq_len:
        # a later chunk or a prefix hit: query i sits at position offset + i
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, L]
    result = F.scaled_dot_product_attention(
        q,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )  # [H, q_len, D]
    out[start : start + q_len] = result.transpose(0, 1)
