"""Paged decode attention: one query token per sequence, split-K over the context.

Each program owns one (sequence, KV head, split). It loads the whole group of
query heads that share that KV head as the rows of a small matrix, so every K/V
tile is read from memory once per group rather than once per query head.

Split-K: a sequence's context of ``seq_len`` tokens is cut into ``num_splits``
equal chunks (each rounded up to a whole number of ``BLOCK_N`` tiles), computed
on the device from ``seq_len``. Every split writes its un-normalised softmax
state (running max ``m``, running sum ``l``, accumulator ``acc``) to fp32
scratch; a second kernel merges the splits. The grid depends only on host ints
(``num_seqs``, ``num_kv_heads``, ``num_splits``), and the kernels read lengths
from device tensors, so a launch recorded in a CUDA graph with ``num_splits``
planned for the largest context stays correct for any shorter one.
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
def _decode_split_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when not SPLIT
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32; written when SPLIT
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16; read only when KV_FORMAT != "none"
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by k_cache and v_cache
    stride_sb, stride_ss, stride_sh,  # shared by k_scale and v_scale
    stride_bt,
    stride_ot, stride_oh, stride_od,
    num_heads,
    num_splits,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the query tile (>= 16 for tl.dot)
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    SPLIT: tl.constexpr,  # write partial state instead of the final output
    DOT_DTYPE: tl.constexpr,  # operand dtype for tl.dot (see common.dot_operands)
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "none" or the 8-bit format of the codes (common.KV_FORMATS)
    SCALE_PROBS: tl.constexpr,  # quantized V: scale probabilities, not the V tile (common.quantized_softmax_step)
):
    """Attention of one query-head group over one chunk of one sequence's context.

    Grid: ``(num_seqs, num_kv_heads, num_splits)``. Program ``(s, h, p)`` takes the
    query row ``query_start_loc[s]`` (none: it exits), heads ``h * GROUP .. h * GROUP + GROUP - 1``
    (a ``[GROUP_PAD, HEAD_DIM_PAD]`` tile, padding rows zero), and walks context
    tokens ``[p * chunk, min((p + 1) * chunk, seq_len))`` ``BLOCK_N`` at a time,
    gathering each token's K/V row through ``block_tables[s]``. Softmax runs
    online in fp32. With ``SPLIT`` it stores (m, l, acc) for the merge kernel;
    otherwise (one split) it stores ``acc / l`` straight into ``out``. With a
    quantized cache each tile's codes and scales are loaded and the scales
    applied in registers (``common.quantized_softmax_step``).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:
        return  # a sequence with no query row this step
    token = token.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Equal chunks per sequence, whole tiles each, so no tile straddles two splits.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    ctx_start = split * chunk
    ctx_end = tl.minimum(ctx_start + chunk, seq_len)

    rows = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    row_ok = rows < GROUP
    dim_ok = dims < head_dim
    heads = kv_head * GROUP + rows  # query head of each row

    q_ptrs = query_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for start in range(ctx_start, ctx_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        pos_ok = pos < ctx_end
        # Every tile holds at least one valid position, so the running max stays finite.
        if KV_FORMAT == "none":
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, pos, pos_ok, dims, dim_ok, kv_head_off,
                stride_cb, stride_cs, stride_cd, BLOCK_SIZE,
            )  # [BLOCK_N, D] each
            m_i, l_i, acc = online_softmax_step(
                q, k, v, pos_ok[None, :], m_i, l_i, acc, qk_scale, DOT_DTYPE, DOT_PRECISION
            )
        else:
            k_codes, v_codes, k_scale, v_scale = load_quantized_kv_tile(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, pos, pos_ok, dims, dim_ok,
                kv_head.to(tl.int64), stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
                BLOCK_SIZE, DOT_DTYPE,
            )  # [BLOCK_N, D] codes each, [BLOCK_N] scales each
            m_i, l_i, acc = quantized_softmax_step(
                q, k_codes, v_codes, k_scale, v_scale, pos_ok[None, :], m_i, l_i, acc, qk_scale,
                DOT_DTYPE, DOT_PRECISION, SCALE_PROBS,
            )

    if SPLIT:
        part_row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_m_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=row_ok)
        acc_ptrs = part_acc_ptr + part_row[:, None] * head_dim + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # A zero-length sequence (a padded batch slot) yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_merge_kernel(
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    stride_ot, stride_oh, stride_od,
    num_heads,
    num_splits,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Merge the split states of one (sequence, query head) into its output row.

    Grid: ``(num_seqs, num_heads)``. With ``M = max_p m[p]`` and weights
    ``w[p] = 2 ** (m[p] - M)`` (zero for empty splits, whose ``m`` is -inf), the
    output is ``sum_p w[p] * acc[p] / sum_p w[p] * l[p]``.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:
        return  # no query row: the split kernel wrote no partials either
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    dim_ok = dims < head_dim

    row = (seq.to(tl.int64) * num_heads + head) * num_splits + splits  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + row, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * head_dim + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]

    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty
    w = tl.exp2(m - m_max)  # [SPLITS_PAD]
    total = tl.sum(w * sums, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]

    o_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def plan_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    *,
    target_programs: int,
    min_split_tokens: int = 256,
    max_num_splits: int = 16,
) -> int:
    """How many chunks to cut each context into.

    As many splits as keep the program count at or under ``target_programs``
    (to fill the device when the batch is small; a batch that alone reaches
    the target runs unsplit), but no split shorter than ``min_split_tokens``
    (the merge and partial writes would dominate).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = target_programs // programs
    by_length = triton.cdiv(max(max_seq_len, 1), min_split_tokens)
    return max(1, min(wanted, by_length, max_num_splits))


@dataclass(frozen=True)
class DecodeTiling:
    """Launch shape of the split kernel.

    block_n: context tokens per loop step (a power of two >= 16 for tl.dot;
    any relation to the cache block size works, tokens are gathered one by one).
    """

    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def default(block_size: int, dtype: torch.dtype, quantized: bool = False) -> DecodeTiling:
        # 64 tokens x 128 dims of bf16 K plus V is 32 KiB per step; fp32 halves
        # the tile to keep the same bytes in flight, and spreads it over 8 warps:
        # its IEEE dots run on FMA units, and with 4 warps they spill registers
        # at head_dim 128 (benchmarks/kernel_compile.py, sm_90).
        if dtype == torch.float32:
            return DecodeTiling(block_n=max(32, block_size), num_warps=8)
        if quantized:
            # 8-bit codes. Compiled for sm_90 with Triton 3.9 and 3.6 (GPU images
            # ship 3.6), every format at head dim 64 and 128: 32 tokens on 4 warps
            # never spilled (64-127 registers); 64 on 4 or 8 warps and 128 on 8
            # spilled 4-32 bytes in some cases. Not yet timed on a GPU.
            return DecodeTiling(block_n=max(32, block_size))
        return DecodeTiling(block_n=max(64, block_size))


def paged_decode(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    num_splits: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    tiling: DecodeTiling | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp16; quantized caches
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (every sequence has one query token, or none) into ``out``.

    A quantized cache (int8 / fp8 codes, ``attention/base.py``) comes with its
    ``k_scale``/``v_scale``; the kernel dequantizes tile by tile.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_attention_inputs(query, k_cache, v_cache)
    scales = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    dot_dtype, dot_precision = dot_operands(query.dtype)
    head_dim_pad = triton.next_power_of_2(head_dim)
    tiling = tiling or DecodeTiling.default(block_size, query.dtype, scales.kv_format != "none")
    split = num_splits > 1
    if split:
        part_m, part_l, part_acc = _split_partials(num_seqs, num_heads, num_splits, head_dim, query.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, part_m, part_l, part_acc, scales.k_scale, scales.v_scale,
        scale * LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *scales.strides,
        block_tables.stride(0),
        *out.stride(),
        num_heads,
        num_splits,
        head_dim,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=tiling.block_n,
        SPLIT=split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        KV_FORMAT=scales.kv_format,
        SCALE_PROBS=dot_dtype != tl.float16,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if split:
        _merge_partials(part_m, part_l, part_acc, query_start_loc, out)
    return out


def _split_partials(num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device):
    """float32 scratch for split-K: running max and sum [S, H, splits], accumulator [S, H, splits, D]."""
    part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    return part_m, part_l, part_acc


def _merge_partials(part_m, part_l, part_acc, query_start_loc, out) -> None:
    """Combine each (sequence, head)'s split-K partials into its row of ``out``."""
    num_seqs, num_heads, num_splits, head_dim = part_acc.shape
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_m, part_l, part_acc, query_start_loc, out,
        *out.stride(),
        num_heads,
        num_splits,
        head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
