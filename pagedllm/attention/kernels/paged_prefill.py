"""Paged varlen attention: causal attention for any mix of query lengths.

Serves prefill, chunked prefill, prefix-cache hits and batches that mix those
with decode rows. Query token ``i`` of a sequence sits at position
``seq_len - query_len + i`` and sees context positions ``0 ..`` its own, read
through the block table (its own K/V were written to the cache beforehand).

Rows of a program's query tile are (token, head) pairs: ``BLOCK_Q`` tokens times
the ``GROUP_PAD`` query heads that share one KV head, so each K/V tile is loaded
once for the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.attention.kernels.common import (
    LOG2E,
    check_attention_inputs,
    dot_operands,
    kv_scale_args,
    load_kv_tile,
    load_quantized_kv_tile,
    online_softmax_step,
    quantized_softmax_step,
)


@triton.jit
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16; read only when KV_FORMAT != "none"
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by k_cache and v_cache
    stride_sb, stride_ss, stride_sh,  # shared by k_scale and v_scale
    stride_bt,
    stride_ot, stride_oh, stride_od,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows of the query tile: BLOCK_Q * GROUP_PAD
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    DOT_DTYPE: tl.constexpr,  # operand dtype for tl.dot (see common.dot_operands)
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "none" or the 8-bit format of the codes (common.KV_FORMATS)
):
    """Causal attention of one query tile of one sequence, for one KV head's group.

    Grid: ``(num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)``. Program
    ``(s, t, h)`` takes query tokens ``t * BLOCK_Q ..`` of sequence ``s`` (it exits
    at once if the sequence has fewer) and heads ``h * GROUP ..``, as a
    ``[BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD]`` tile whose row ``r`` is token
    ``r // GROUP_PAD``, head ``r % GROUP_PAD``. It walks context positions
    ``0 .. last query position of the tile`` ``BLOCK_N`` at a time through
    ``block_tables[s]``, masks keys after each row's position, keeps an fp32
    online softmax, and stores the normalised rows into ``out``. With a
    quantized cache each tile's codes and scales are loaded and the scales
    applied in registers (``common.quantized_softmax_step``).
    """
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - query_len  # tokens cached before this step

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token within the sequence
    group_idx = rows % GROUP_PAD
    row_ok = (q_idx < query_len) & (group_idx < GROUP)
    q_pos = ctx_len + q_idx  # [BLOCK_M] position of each row's token
    heads = kv_head * GROUP + group_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < head_dim

    tokens = (q_start + q_idx).to(tl.int64)
    q_ptrs = query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys past the tile's last query position are masked for every row.
    last_q = tl.minimum((q_tile + 1) * BLOCK_Q, query_len)
    kv_end = ctx_len + last_q
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_ok = pos < kv_end
        # Position 0 is in the first tile and visible to every row, so after
        # the first step m_i is finite and fully masked later tiles add nothing.
        if KV_FORMAT == "none":
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, pos, pos_ok, dims, dim_ok, kv_head_off,
                stride_cb, stride_cs, stride_cd, BLOCK_SIZE,
            )  # [BLOCK_N, D] each
            causal = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]  # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = online_softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, DOT_DTYPE, DOT_PRECISION)
        else:
            k_codes, v_codes, k_scale, v_scale = load_quantized_kv_tile(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, pos, pos_ok, dims, dim_ok,
                kv_head.to(tl.int64), stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
                BLOCK_SIZE, DOT_DTYPE,
            )  # [BLOCK_N, D] codes each, [BLOCK_N] scales each
            causal = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            m_i, l_i, acc = quantized_softmax_step(
                q, k_codes, v_codes, k_scale, v_scale, causal, m_i, l_i, acc, qk_scale,
                DOT_DTYPE, DOT_PRECISION, SCALE_PROBS=False,
            )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@dataclass(frozen=True)
class PrefillTiling:
    """Launch shape of the varlen kernel.

    group_pad: query heads per tile row group (next power of two >= GROUP);
    block_q: query tokens per program; block_n: context tokens per loop step.
    """

    group_pad: int
    block_q: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def default(group: int, dtype: torch.dtype, block_size: int) -> PrefillTiling:
        # About 64 query rows per program (tokens x heads of one group) and 64
        # context tokens per step. fp32 halves both (its IEEE dots run on FMA
        # units and spill registers at 64 x 128 on sm_90) and uses 8 warps.
        group_pad = triton.next_power_of_2(group)
        if dtype == torch.float32:
            return PrefillTiling(group_pad, max(1, 32 // group_pad), max(32, block_size), num_warps=8)
        return PrefillTiling(group_pad, max(1, 64 // group_pad), max(64, block_size))


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp16; quantized caches
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention through the block tables into ``out``.

    A quantized cache comes with its ``k_scale``/``v_scale`` (as in ``paged_decode``).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_attention_inputs(query, k_cache, v_cache)
    scales = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    dot_dtype, dot_precision = dot_operands(query.dtype)
    tiling = PrefillTiling.default(group, query.dtype, block_size)
    grid = (num_seqs, triton.cdiv(max_query_len, tiling.block_q), num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scales.k_scale, scales.v_scale,
        scale * LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *scales.strides,
        block_tables.stride(0),
        *out.stride(),
        head_dim,
        GROUP=group,
        GROUP_PAD=tiling.group_pad,
        BLOCK_Q=tiling.block_q,
        BLOCK_M=tiling.block_q * tiling.group_pad,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=tiling.block_n,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        KV_FORMAT=scales.kv_format,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return out
