"""Paged attention in plain PyTorch: the reference every faster backend is tested
against, and the CPU production path.

Everything that depends only on the batch's shape (which rows decode, the
cache slots each sequence reads, the length mask) is worked out once per
forward pass in a :class:`StepPlan` and reused by every layer: the block
tables are the same for all layers of a step.

Decode tokens (query length 1) are computed together: each sequence's context
is gathered token by token with one ``index_select`` per cache (positions past
a sequence's length read its last valid slot, so no unwritten slot is ever
touched, and are masked out of the softmax), then attended with two batched
matmuls per KV head. Prefill and chunked-prefill sequences are computed one at
a time with ``scaled_dot_product_attention``.

When the optional native kernel (:mod:`pagedllm.native.cpu_ops`) is
available on a CPU, every row (decode and prefill) goes to it instead: it
reads K/V straight from the paged cache.

Quantized caches (8-bit codes plus per-slot, per-head float16 scales; see
:mod:`pagedllm.kv.kv_format`) are quantized on write and dequantized after
the gather, so only the slots a step reads are ever expanded to floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.kv import kv_format
from pagedllm.native import cpu_ops

# Scores (heads x queries x keys) one prefill attention call may materialise:
# 128 MiB in float32, whatever the prompt length.
MAX_SCORES_PER_TILE = 2**25

HeadRows = tuple[tuple[int, int], ...]  # per KV head, the query rows [r0, r1) to compute


@dataclass
class DecodePlan:
    """The decode sequences of a step (query length 1), in batch order.

    rows:    [S] int64 query rows, or None when they are rows ``0 .. S-1``.
    slots:   [S * max_len] int64 flat cache slot of every (sequence, position);
             positions at or past a sequence's length repeat its last slot.
    beyond:  [1, S, 1, max_len] bool, True where a position is past the sequence's length.
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    beyond: torch.Tensor
    num_seqs: int
    max_len: int


@dataclass
class PrefillSeq:
    """One sequence with several new tokens: query rows ``start .. start + q_len``."""

    start: int
    q_len: int
    seq_len: int
    slots: torch.Tensor  # [seq_len] int64 flat cache slot of each context position


@dataclass
class StepPlan:
    """Per-forward-pass indices shared by every layer (see the module docstring)."""

    decode: DecodePlan | None
    prefills: list[PrefillSeq]


class TorchAttentionBackend(AttentionBackend):
    """Reads and writes the ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache."""

    name = "torch"

    def __init__(self, use_native: bool | None = None) -> None:
        # None: use the native kernels when they build on this machine; False: never.
        self.use_native = use_native
        self._write_key: torch.Tensor | None = None
        self._write_targets: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self._plan_metadata: AttentionMetadata | None = None
        self._plan_block_size = 0
        self._plan: StepPlan | None = None
        self._tiles_key: tuple[AttentionMetadata, HeadRows | None] | None = None
        self._tiles: tuple[torch.Tensor, int, torch.Tensor | None] | None = None  # see _work
        self._native_known: tuple[torch.Tensor, tuple, bool] | None = None  # see native_work

    # ---- per-step plan ----------------------------------------------------

    def plan(self, metadata: AttentionMetadata, block_size: int) -> StepPlan:
        """The step's plan, built on the first layer and reused while ``metadata`` is the same object.

        A strong reference to the metadata is kept, so a later object cannot reuse its identity.
        """
        if self._plan_metadata is not metadata or self._plan_block_size != block_size:
            self._plan = build_step_plan(metadata, block_size)
            self._plan_metadata = metadata
            self._plan_block_size = block_size
        return self._plan

    def kv_layout(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """On the CPU, the layout the native kernels read fastest for caches of ``dtype`` on this
        machine (or the one ``PAGEDLLM_KV_LAYOUT`` names: both this path and the kernels read either)."""
        if device.type != "cpu":
            return "token"
        return cpu_ops.preferred_kv_layout(native=self.use_native is not False and cpu_ops.available(), dtype=dtype)

    def _native_enabled(self, query: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
        if query.device.type != "cpu" or self.use_native is False:
            return False
        if not (cpu_ops.available() and cpu_ops.supports(query, k_cache)):
            return False
        # The portable (non-AVX-512) build beats the gathered-context decode
        # path but not SDPA on prefill chunks: 4.8 against 8.6 ms for a decode
        # batch of 64 x 340, 9.9 against 4.2 ms for two 300-token prefills.
        return cpu_ops.vectorized() or metadata.max_query_len == 1

    # ---- contract ---------------------------------------------------------

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
        """Store token t's K/V at flat slot ``slot_mapping[t]``; rows with -1 are dropped.

        On the CPU the native kernel copies (or quantizes) the rows where they
        are; otherwise the kept rows are worked out once per ``slot_mapping``
        object (every layer of a step passes the same one).
        """
        if k_scale is not None:
            self._write_quantized(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        if self.use_native is not False and cpu_ops.can_write_kv(key, value, k_cache, v_cache, slot_mapping):
            cpu_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        rows, slots = self._targets(slot_mapping)
        _store(key, k_cache, rows, slots)
        _store(value, v_cache, rows, slots)

    def _targets(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._write_key is not slot_mapping:
            self._write_targets = _write_targets(slot_mapping)
            self._write_key = slot_mapping
        return self._write_targets

    def _write_quantized(self, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
        caches = (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        if self.use_native is not False and cpu_ops.can_write_kv_quantized(*caches):
            cpu_ops.write_kv_quantized(*caches)
            return
        rows, slots = self._targets(slot_mapping)
        _store_quantized(key, k_cache, k_scale, rows, slots)
        _store_quantized(value, v_cache, v_scale, rows, slots)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # quantized caches only, as in write_kv
        v_scale: torch.Tensor | None = None,
        head_rows: HeadRows | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each sequence's new tokens over its first ``seq_len``
        cached tokens. Padding rows past the last sequence come back as zeros.
        ``head_rows`` (see AttentionBackend.forward) spares the native kernel the rows
        outside each KV head's range; the PyTorch path computes every row."""
        if self._native_enabled(query, k_cache, metadata):
            return self._forward_native(query, k_cache, v_cache, metadata, scale, k_scale, v_scale, head_rows)
        k_cache, v_cache = _Cache.of(k_cache, k_scale), _Cache.of(v_cache, v_scale)
        plan = self.plan(metadata, k_cache.block_size)
        decode = plan.decode
        if decode is not None and decode.rows is None and not plan.prefills and query.shape[0] == decode.num_seqs:
            return self._decode(query, k_cache, v_cache, metadata, decode, scale)  # pure decode step
        out = torch.zeros_like(query)
        if decode is not None:
            q = query if decode.rows is None else query.index_select(0, decode.rows)
            result = self._decode(q[: decode.num_seqs], k_cache, v_cache, metadata, decode, scale)
            if decode.rows is None:
                out[: decode.num_seqs] = result
            else:
                out.index_copy_(0, decode.rows, result)
        for seq in plan.prefills:
            _prefill_one(query, out, k_cache, v_cache, seq, scale)
        return out

    def _decode(self, query, k_cache, v_cache, metadata, decode: DecodePlan, scale: float) -> torch.Tensor:
        return decode_attention(query, k_cache, v_cache, decode, scale)

    def native_work(
        self, query: torch.Tensor, k_cache: torch.Tensor, md: AttentionMetadata, head_rows: HeadRows | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """The native kernel's work list for this step and the rows that hold a sequence
        (built once per step), or None where :meth:`forward` would not run the kernel on
        queries like ``query`` (only its device, dtype, heads and head size are read).
        With ``head_rows`` no tile straddles a range's bound (the ranges' per-tile heads:
        ``cpu_ops.tile_head_ranges``)."""
        # the checks depend on the cache, the queries' dtype and shape, and (for the portable build)
        # whether the step decodes: the same from step to step, so asked once
        key = (self.use_native, query.dtype, query.device, query.shape[1:], md.max_query_len == 1)
        known = self._native_known
        if known is not None and known[0] is k_cache and known[1] == key:
            enabled = known[2]
        else:
            enabled = self._native_enabled(query, k_cache, md)
            self._native_known = (k_cache, key, enabled)
        if not enabled:
            return None
        tiles, num_rows, _ = self._work(query, k_cache, md, head_rows)
        return tiles, num_rows

    def _work(
        self, query, k_cache, md: AttentionMetadata, head_rows: HeadRows | None = None
    ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(tiles, rows that hold a sequence, each tile's KV heads or None for all), built once per
        (metadata, head_rows): every layer of a step asks for the same."""
        key = self._tiles_key
        if key is None or key[0] is not md or key[1] != head_rows:
            per_tile = cpu_ops.tile_tokens(query.shape[1], k_cache.shape[2], query.shape[2])
            num_rows = sum(md.query_lens_host)
            ranges = None
            if head_rows is None:
                tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, per_tile)
            else:
                assert len(head_rows) == k_cache.shape[2], "one (r0, r1) per KV head of the caches"
                breaks = [r for bounds in head_rows for r in bounds if 0 < r < num_rows]
                tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, per_tile, breaks)
                ranges = cpu_ops.tile_head_ranges(tiles, head_rows)
            self._tiles = (tiles, num_rows, ranges)
            self._tiles_key = (md, head_rows)
        return self._tiles

    def _forward_native(
        self, query, k_cache, v_cache, md: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
        head_rows: HeadRows | None = None,
    ) -> torch.Tensor:
        """Every row through the native kernel (those ``head_rows`` leave out excepted); its work
        list is built once per step."""
        tiles, num_rows, ranges = self._work(query, k_cache, md, head_rows)
        out = cpu_ops.paged_attention(
            query, k_cache, v_cache, md.block_tables, tiles, scale, k_scale=k_scale, v_scale=v_scale,
            head_ranges=ranges,
        )
        if num_rows < query.shape[0]:
            out[num_rows:].zero_()  # padding rows
        return out


# ---------------------------------------------------------------- plan building


def build_step_plan(md: AttentionMetadata, block_size: int) -> StepPlan:
    """Host-side bookkeeping plus a handful of small index tensors, once per step."""
    device = md.slot_mapping.device
    query_lens = md.query_lens_host
    starts = _query_starts(query_lens)
    decode_seqs = [i for i, q in enumerate(query_lens) if q == 1]
    decode = None
    if decode_seqs:
        decode = _decode_plan(md, block_size, decode_seqs, [starts[i] for i in decode_seqs], device)
    prefills = []
    for i, q_len in enumerate(query_lens):
        if q_len > 1:
            seq_len = md.seq_lens_host[i]
            positions = torch.arange(seq_len, device=device)
            prefills.append(
                PrefillSeq(starts[i], q_len, seq_len, _slots_of(md.block_tables[i : i + 1], positions[None], block_size)[0])
            )
    return StepPlan(decode, prefills)


def _decode_plan(
    md: AttentionMetadata, block_size: int, seq_ids: list[int], rows: list[int], device: torch.device
) -> DecodePlan:
    num_seqs = len(seq_ids)
    in_order = seq_ids == list(range(num_seqs)) and rows == list(range(num_seqs))
    seq_index = None if in_order else torch.tensor(seq_ids, device=device)
    lens_host = [md.seq_lens_host[i] for i in seq_ids]
    max_len = max(lens_host)
    num_blocks = -(-max_len // block_size)
    tables = md.block_tables[:num_seqs] if seq_index is None else md.block_tables.index_select(0, seq_index)
    tables = tables[:, :num_blocks]  # [S, n]
    lens = torch.tensor(lens_host, device=device)
    positions = torch.arange(max_len, device=device).unsqueeze(0)  # [1, L]
    beyond = positions >= lens.unsqueeze(1)  # [S, L]
    clamped = torch.minimum(positions, (lens - 1).unsqueeze(1))  # [S, L]
    slots = _slots_of(tables, clamped, block_size)
    return DecodePlan(
        rows=None if in_order else torch.tensor(rows, device=device),
        slots=slots.reshape(-1),
        beyond=beyond[None, :, None, :],
        num_seqs=num_seqs,
        max_len=max_len,
    )


def _slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """tables [S, n], positions [S, L] -> flat slots [S, L] int64."""
    blocks = tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _query_starts(query_lens: list[int]) -> list[int]:
    """Host-side prefix sums: the first query row of each sequence."""
    starts, total = [], 0
    for q_len in query_lens:
        starts.append(total)
        total += q_len
    return starts


def _write_targets(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows to store or None for all, their slots) -- padding rows (-1) dropped."""
    slot_mapping = slot_mapping.long()
    if slot_mapping.numel() == 0 or bool((slot_mapping >= 0).all()):
        return None, slot_mapping
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    return keep, slot_mapping.index_select(0, keep)


def _store(new: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor) -> None:
    """cache slot ``slots[i]`` <- ``new[rows[i]]`` (``new[i]`` when rows is None)."""
    src = new if rows is None else new.index_select(0, rows)
    _put_slots(cache, slots, src.to(cache.dtype))


def _put_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache`` ``[num_blocks, block_size, ...]`` at flat ``slots`` <- ``values`` ``[n, ...]``, in
    either KV layout (a KV_LAYOUT_HEAD pool's tensors are permuted views, see KVCache)."""
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)
    else:
        block_size = cache.shape[1]
        cache[slots // block_size, slots % block_size] = values


def _store_quantized(
    new: torch.Tensor,  # [num_tokens, KH, D]
    codes: torch.Tensor,  # [num_blocks, block_size, KH, D] 8-bit
    scales: torch.Tensor,  # [num_blocks, block_size, KH] float16
    rows: torch.Tensor | None,
    slots: torch.Tensor,
) -> None:
    """As :func:`_store`, quantizing each (token, head) vector with its own scale."""
    src = new if rows is None else new.index_select(0, rows)
    new_codes, new_scales = kv_format.quantize_kv(src, codes.dtype)
    _put_slots(kv_format.as_bytes(codes), slots, kv_format.as_bytes(new_codes))
    scales.view(-1, scales.shape[2]).index_copy_(0, slots, new_scales)


@dataclass
class _Cache:
    """One paged cache as the PyTorch paths read it: the tensor, and its scales when 8-bit."""

    data: torch.Tensor  # [num_blocks, block_size, KH, D]
    scale: torch.Tensor | None  # [num_blocks, block_size, KH] float16, quantized caches only

    @staticmethod
    def of(data: torch.Tensor, scale: torch.Tensor | None) -> _Cache:
        return _Cache(data, scale)

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[2]

    @property
    def head_dim(self) -> int:
        return self.data.shape[3]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The vectors at flat ``slots`` [n] -> [n, KH, D] in ``dtype``; only these slots are dequantized."""
        kh, d = self.num_kv_heads, self.head_dim
        if self.scale is None:
            return _gather_tokens(self.data, slots).view(-1, kh, d).to(dtype)
        codes = _gather_tokens(kv_format.as_bytes(self.data), slots).view(self.data.dtype).view(-1, kh, d)
        scales = self.scale.view(-1, kh).index_select(0, slots)  # [n, KH]
        return kv_format.dequantize_kv(codes, scales, dtype)


# ---------------------------------------------------------------- decode


def decode_attention(
    query: torch.Tensor,  # [S, H, D], one row per decode sequence
    k_cache: _Cache,  # [num_blocks, block_size, KH, D]
    v_cache: _Cache,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [S, H, D]
    """Gathered-context decode attention; fp32 arithmetic for half-precision inputs."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.num_kv_heads
    group = num_heads // num_kv_heads
    length = plan.max_len
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    keys = k_cache.gather(plan.slots, compute_dtype).view(num_seqs, length, num_kv_heads, head_dim)
    values = v_cache.gather(plan.slots, compute_dtype).view(num_seqs, length, num_kv_heads, head_dim)
    q = (query.to(compute_dtype) * scale).view(num_seqs, num_kv_heads, group, head_dim)
    scores = query.new_empty((num_kv_heads, num_seqs, group, length), dtype=compute_dtype)
    for h in range(num_kv_heads):
        # keys[:, :, h] is [S, L, D] with row stride KH*D: a valid strided operand, no copy
        torch.bmm(q[:, h], keys[:, :, h].transpose(1, 2), out=scores[h])
    scores.masked_fill_(plan.beyond, float("-inf"))
    probs = scores.softmax(dim=-1)  # [KH, S, G, L]
    result = query.new_empty((num_kv_heads, num_seqs, group, head_dim), dtype=compute_dtype)
    for h in range(num_kv_heads):
        torch.bmm(probs[h], values[:, :, h], out=result[h])
    # [KH, S, G, D] -> [S, KH * G, D]
    return result.permute(1, 0, 2, 3).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KH, D] (either KV layout), slots [n] -> [n, KH * D]."""
    if not cache.is_contiguous():
        block_size = cache.shape[1]
        return cache[slots // block_size, slots % block_size].reshape(slots.shape[0], -1)
    flat = cache.view(-1, cache.shape[2] * cache.shape[3])
    return flat.index_select(0, slots)


# ---------------------------------------------------------------- prefill


def _prefill_one(
    query: torch.Tensor,  # [num_tokens, H, D]
    out: torch.Tensor,
    k_cache: _Cache,
    v_cache: _Cache,
    seq: PrefillSeq,
    scale: float,
) -> None:
    """Several new tokens of one sequence at positions ``seq_len - q_len .. seq_len - 1``.

    Queries go in tiles of at most :data:`MAX_SCORES_PER_TILE` scores (heads x
    queries x keys): a masked ``scaled_dot_product_attention`` on the CPU
    materialises its score matrix, so a 2,048-token chunk of a 32k prompt
    would otherwise take 2.4 GB per call. Each tile reads only the keys up to
    its last query's position.
    """
    seq_len, q_len, start = seq.seq_len, seq.q_len, seq.start
    num_kv_heads = k_cache.num_kv_heads
    q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
    keys = k_cache.gather(seq.slots, q.dtype).transpose(0, 1)  # [KH, L, D]
    values = v_cache.gather(seq.slots, q.dtype).transpose(0, 1)
    group = q.shape[0] // num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=0)  # [H, L, D]
        values = values.repeat_interleave(group, dim=0)
    if q_len == seq_len and q.shape[0] * q_len * seq_len <= MAX_SCORES_PER_TILE:
        result = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)  # [H, q_len, D]
        out[start : start + q_len] = result.transpose(0, 1)
        return
    tile = max(1, MAX_SCORES_PER_TILE // (q.shape[0] * seq_len))
    for first in range(0, q_len, tile):
        last = min(q_len, first + tile)  # queries first .. last - 1 of this chunk
        num_keys = seq_len - q_len + last  # the last query of the tile sees this many keys
        q_pos = torch.arange(seq_len - q_len + first, num_keys, device=q.device).unsqueeze(1)
        hidden = torch.arange(num_keys, device=q.device).unsqueeze(0) > q_pos  # [tile, num_keys]
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        result = F.scaled_dot_product_attention(
            q[:, first:last], keys[:, :num_keys], values[:, :num_keys], attn_mask=mask, scale=scale
        )  # [H, tile, D]
        out[start + first : start + last] = result.transpose(0, 1)
