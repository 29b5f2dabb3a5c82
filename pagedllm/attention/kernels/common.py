"""Launch-time choices shared by the attention kernels."""

from __future__ import annotations

import os

import torch
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
