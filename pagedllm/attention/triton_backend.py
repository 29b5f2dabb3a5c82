"""Triton attention backend for CUDA.

Importing this module imports triton (an ImportError here becomes a
ConfigError in the registry). The same code path runs on CPU tensors when
``TRITON_INTERPRET=1`` is set before triton is imported, which is how the
tests exercise it on machines without a GPU.

Dispatch per forward pass:

- ``max_query_len == 1`` (decode only): the split-K paged decode kernel,
  with the number of splits planned from host ints only.
- otherwise: the varlen causal kernel, which also handles decode rows mixed
  into a prefill batch.

Quantized KV (int8, fp8_e4m3, fp8_e5m2; ``base.py``): ``write_kv`` quantizes
as it scatters, and both attention kernels dequantize each K/V tile in
registers (no dequantized copy of the cache). Unquantized caches compile the
kernels with ``KV_FORMAT="none"``, which removes every quantized branch.

CUDA graphs: the kernels read lengths, tables and slots from device tensors;
the host only sizes grids (decode: ``num_seqs``, ``num_kv_heads`` and the split
count planned from ``max_seq_len``). Any split count is correct for any
context, so a decode graph captured at one ``max_seq_len`` replays correctly
at others. The varlen grid depends on ``max_query_len``; do not replay it.
"""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.kernels.common import interpreting_bf16
from pagedllm.attention.kernels.paged_decode import DecodeTiling, paged_decode, plan_num_splits
from pagedllm.attention.kernels.paged_prefill import paged_prefill
from pagedllm.attention.kernels.write_kv import write_kv as _write_kv

# Programs per streaming multiprocessor the decode split plan aims for. Measured
# on an H200 (132 SMs, head dim 128, 8 KV heads; docs/benchmarks.md, "GPU"):
# bandwidth peaks at about 512 programs, so batches of 64+ run unsplit, 32 in
# 2 splits and 16 in 4; every extra split past that only adds partial writes.
_PROGRAMS_PER_SM = 4
# Without a GPU (the interpreter) there are no SMs to fill; a few splits still
# exercise the split-K path on long contexts.
_CPU_TARGET_PROGRAMS = 16


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels; the cache layout of ``base.py``.

    Decode split-K plan: enough splits that about ``target_programs`` programs
    run (default: 4 per SM on CUDA, 16 on the CPU interpreter), at most
    ``max_num_splits``, and none shorter than ``min_split_tokens`` tokens.
    ``decode_tiling`` overrides the decode kernel's launch shape (for tuning).
    """

    name = "triton"

    def __init__(
        self,
        *,
        min_split_tokens: int = 256,
        max_num_splits: int = 16,
        target_programs: int | None = None,
        decode_tiling: DecodeTiling | None = None,
    ) -> None:
        self.min_split_tokens = min_split_tokens
        self.max_num_splits = max_num_splits
        self.target_programs = target_programs
        self.decode_tiling = decode_tiling
        self._device_targets: dict[torch.device, int] = {}

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
        k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float16
        v_scale: torch.Tensor | None = None,
    ) -> None:
        _write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # quantized caches only, as in write_kv
        v_scale: torch.Tensor | None = None,
        head_rows: tuple[tuple[int, int], ...] | None = None,  # a hint only: every row is computed
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # The interpreter truncates fp32 -> bf16 stores; let torch round instead.
        out_dtype = torch.float32 if interpreting_bf16(query.dtype) else query.dtype
        # Padding rows (beyond the sequences' tokens) are never written by the
        # kernels; zero them so they cannot carry NaN garbage downstream.
        padded = sum(metadata.query_lens_host) < query.shape[0]
        alloc = torch.zeros if padded else torch.empty
        out = alloc(query.shape, dtype=out_dtype, device=query.device)  # [num_tokens, num_heads, head_dim]
        if metadata.num_seqs == 0:
            return out.to(query.dtype)
        if metadata.is_decode_only:
            num_splits = self.num_decode_splits(metadata, k_cache.shape[2], query.device)
            paged_decode(
                query, k_cache, v_cache,
                metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                scale, num_splits, out, self.decode_tiling, k_scale, v_scale,
            )
        else:
            paged_prefill(
                query, k_cache, v_cache,
                metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                scale, metadata.max_query_len, out, k_scale, v_scale,
            )
        return out.to(query.dtype)

    def num_decode_splits(self, metadata: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
        """Split count for a decode batch; depends on host ints only (graph-safe)."""
        return plan_num_splits(
            metadata.num_seqs,
            num_kv_heads,
            metadata.max_seq_len,
            target_programs=self._target_programs_for(device),
            min_split_tokens=self.min_split_tokens,
            max_num_splits=self.max_num_splits,
        )

    def _target_programs_for(self, device: torch.device) -> int:
        if self.target_programs is not None:
            return self.target_programs
        if device not in self._device_targets:
            if device.type == "cuda":
                num_sms = torch.cuda.get_device_properties(device).multi_processor_count
                self._device_targets[device] = _PROGRAMS_PER_SM * num_sms
            else:
                self._device_targets[device] = _CPU_TARGET_PROGRAMS
        return self._device_targets[device]
