"""Launch-time choices and tile helpers shared by the attention kernels.

Quantized KV (``attention/base.py``): the cache holds 8-bit codes and a float16
scale per slot and KV head. The kernels take the format as the constexpr
``KV_FORMAT`` ("none", "int8", "fp8_e4m3", "fp8_e5m2"); with "none" every
quantized branch is compiled out and the scale arguments are never read, so
unquantized caches run the same code as before quantization existed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    if query.dtype != k_cache.dtype and k_cache.dtype not in KV_FORMATS:
        raise ValueError(f"query is {query.dtype} but the KV cache is {k_cache.dtype}")


# Cache dtype -> the kernels' KV_FORMAT name, for quantized caches.
KV_FORMATS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass(frozen=True)
class KVScaleArgs:
    """What a launcher passes a kernel about the cache's format.

    kv_format: the ``KV_FORMAT`` constexpr. k_scale/v_scale: the
    ``[num_blocks, block_size, num_kv_heads]`` float16 scales, or (format
    "none") the caches themselves as placeholder pointers the kernel never
    reads. strides: the scales' (block, slot, head) strides, shared by both.
    """

    kv_format: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    strides: tuple[int, int, int]


def kv_scale_args(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] float16
    v_scale: torch.Tensor | None,
) -> KVScaleArgs:
    """Check that the scales match the cache's format and shape; a mismatch is a caller bug."""
    kv_format = KV_FORMATS.get(k_cache.dtype)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if kv_format is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} KV cache is not quantized; pass k_scale=None, v_scale=None")
        return KVScaleArgs("none", k_cache, v_cache, (0, 0, 0))
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} (quantized) KV cache needs k_scale and v_scale")
    expected = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != expected or s.dtype != torch.float16:
            raise ValueError(f"{name} must be float16 of shape {list(expected)}, not {s.dtype} {list(s.shape)}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share one layout")
    return KVScaleArgs(kv_format, k_scale, v_scale, tuple(k_scale.stride()))


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
def load_quantized_kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, pos, pos_ok, dims, dim_ok, kv_head,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K/V codes and scales of a quantized cache at context positions ``pos``.

    Returns ``k_codes``, ``v_codes`` ``[len(pos), D]`` as ``DOT_DTYPE`` (exact:
    every int8, e4m3 and e5m2 value is a float16 and a bfloat16) and
    ``k_scale``, ``v_scale`` ``[len(pos)]`` fp32. The scales are applied to the
    scores and probabilities (``quantized_softmax_step``), one product per key
    instead of one per element, so no dequantized tile is ever materialised.
    fp8 codes load as Triton's fp8 types, whose conversion is one hardware
    instruction on sm_89+ and exact in the interpreter. Rows where ``pos_ok``
    is false are zeros with scale 0.
    """
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    slot_off = block * stride_cb + offset * stride_cs + kv_head * stride_ch  # [BLOCK_N]
    kv_off = slot_off[:, None] + dims[None, :] * stride_cd  # [BLOCK_N, D]
    kv_mask = pos_ok[:, None] & dim_ok[None, :]
    scale_off = block * stride_sb + offset * stride_ss + kv_head * stride_sh  # [BLOCK_N]
    k_scale = tl.load(k_scale_ptr + scale_off, mask=pos_ok, other=0.0).to(tl.float32)
    v_scale = tl.load(v_scale_ptr + scale_off, mask=pos_ok, other=0.0).to(tl.float32)
    k_codes = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v_codes = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    return k_codes, v_codes, k_scale, v_scale


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


@triton.jit
def quantized_softmax_step(
    q, k_codes, v_codes, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_PROBS: tl.constexpr,
):
    """``online_softmax_step`` for a tile from ``load_quantized_kv_tile``.

    Scores: the dot runs on the K codes and each key's column is then scaled
    by its ``k_scale`` (equal to the dot with dequantized K: the scale is
    constant over head_dim). Values, ``sum_j p_j * v_scale_j * code_j``, one of two ways:

    - ``SCALE_PROBS``: ``dot(p * v_scale, codes)``, one product per (row, key):
      the cheaper way when rows are few (decode: one query-head group). Only for
      bf16 / fp32 operands, whose range holds ``p * v_scale``; in fp16 it would
      fall into subnormals.
    - otherwise: the V tile is dequantized in registers (code * scale in fp32,
      then ``DOT_DTYPE``, values of the model dtype's magnitude): one product
      per (key, dim); fewer live registers when the rows are many (prefill).
    """
    s = tl.dot(q, tl.trans(k_codes), input_precision=DOT_PRECISION)  # [rows, BLOCK_N]
    s = s * (k_scale * qk_scale)[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALE_PROBS:
        p_scaled = p * v_scale[None, :]
        pv = tl.dot(p_scaled.to(DOT_DTYPE), v_codes, input_precision=DOT_PRECISION)  # [rows, D]
    else:
        v = (v_codes.to(tl.float32) * v_scale[:, None]).to(DOT_DTYPE)  # [BLOCK_N, D]
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
