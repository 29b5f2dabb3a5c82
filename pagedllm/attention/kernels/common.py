"""Launch-time choices shared by the attention kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Scores are kept in base 2 (exp2 is the native instruction): s * scale * LOG2E.
LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting_bf16(dtype: torch.dtype) -> bool:
    """True when bf16 data runs through Triton's CPU interpreter.

    The interpreter keeps bf16 as raw 16-bit patterns: ``tl.dot`` multiplies
    the patterns, and fp32 -> bf16 casts truncate (a GPU rounds to nearest
    even). The launchers work around both; compiled kernels are unaffected.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) for ``tl.dot`` on inputs of ``dtype``.

    fp16/bf16 multiply natively with fp32 accumulation; fp32 asks for full
    IEEE products (TF32 would miss the fp32 tolerance). Under the interpreter
    bf16 operands are widened to fp32 first (exact: bf16 fits in fp32).
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"attention kernels support float16, bfloat16 and float32, not {dtype}")
    if dtype == torch.float32 or interpreting_bf16(dtype):
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"  # precision is ignored for 16-bit operands


def check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shapes the attention kernels assume; a mismatch here is a caller bug."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one shape and layout")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if k_cache.shape[3] != head_dim or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must match the cache's {k_cache.shape[3]} and be >= 16")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query is {query.dtype} but the KV cache is {k_cache.dtype}")


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, table_row, pos, pos_ok, dims, dim_ok, kv_head_off,
    stride_cb, stride_cs, stride_cd,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V rows ``[len(pos), D]`` of one sequence and KV head at context
    positions ``pos``, gathered token by token through its block-table row
    ``table_row``; rows where ``pos_ok`` is false are zeros."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head_off  # [BLOCK_N]
    kv_off = slot_off[:, None] + dims[None, :] * stride_cd  # [BLOCK_N, D]
    kv_mask = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(
    q, k, v, visible, m_i, l_i, acc, qk_scale,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold one K/V tile into the running softmax state of the query rows ``q``.

    ``visible`` ([rows or 1, BLOCK_N]) says which keys each row may see; scores
    are in base 2 (``qk_scale`` includes log2(e)). Returns the new running max
    ``m_i``, sum ``l_i`` and un-normalised accumulator ``acc`` (all fp32). The
    caller guarantees ``m_i`` stays finite: every row sees a key in its first tile.
    """
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc
