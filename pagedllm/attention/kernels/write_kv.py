"""Scatter new K/V rows into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by k_cache and v_cache
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEADS_PAD: tl.constexpr,  # next power of two >= num_kv_heads
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim
):
    """Copy one token's K and V (all KV heads) into its cache slot.

    Grid: ``(num_tokens,)``. Program ``t`` reads ``slot = slot_mapping[t]``; if the
    slot is -1 (a padding row) it writes nothing, otherwise it stores the
    ``[num_kv_heads, head_dim]`` tile of ``key[t]`` / ``value[t]`` at
    ``cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]``.
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]  # [1, HEAD_DIM_PAD]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store ``key``/``value`` rows at their slots; rows with slot -1 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
