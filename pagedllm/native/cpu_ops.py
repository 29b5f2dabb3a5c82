"""Optional native kernels for the CPU: paged attention and the layer ops.

The kernels (``cpu_ops.c`` beside this file) are plain C with no PyTorch
headers; they are built with the system C compiler on first use into a
per-user cache directory and called through ``ctypes``. The source is compiled
once per ISA path -- ``scalar`` (portable C), ``avx2`` (AVX2 + FMA, 8-float
vectors), ``avx512`` (AVX-512 F/BW/VL/DQ, 16-float vectors) and ``avx512_bf16``
(avx512 plus the hardware bf16 conversions) -- and at load the best path the
CPU reports is chosen, or the one ``PAGEDLLM_CPU_ISA`` names (an AVX-512
machine can run ``avx2`` and ``scalar`` too, so every path is tested and
benchmarked on one machine). :func:`selected_isa` says which is loaded.

Attention reads K/V straight from the paged cache through the block table (no
gather copy). Its unit of work is a tile: up to 16 consecutive new tokens of
one sequence against one KV head, all query heads of that KV head together; a
decode token is a tile of one, and a prefill token at position ``p`` attends
to the first ``p + 1`` tokens, which is the causal mask. Online softmax,
float32 arithmetic, float32 and bfloat16 caches, and 8-bit caches (int8, fp8
e4m3, fp8 e5m2 codes with per-slot, per-head float16 scales, see
:mod:`pagedllm.kv.kv_format`) dequantized inside the kernel, with float32 or
bfloat16 queries; :func:`write_kv_quantized` quantizes on write exactly as
``kv_format.quantize_kv``. Parallel loops run on the
OpenMP runtime that PyTorch already loaded, so the two share one thread pool.

When no compiler is found, the build fails, or ``PAGEDLLM_NATIVE_OPS=0`` is
set, :func:`available` is False and the pure-PyTorch path is used; the tests
compare the two.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedllm.errors import ConfigError
from pagedllm.native.build_cache import compiled, native_source

logger = logging.getLogger("pagedllm")

MAX_HEAD_DIM = 256
MAX_ROWS = 64  # query rows (tile tokens x heads per KV head) the kernel's buffers hold
MAX_ROW_FLOATS = 8192  # rows x head_dim the kernel's buffers hold
MAX_TILE_TOKENS = 16

_SOURCE_PATH = Path(__file__).with_name("cpu_ops.c")

# 8-bit cache dtype -> the kernels' name suffix
_CODE_SUFFIX = {torch.int8: "i8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_vector_width = 1
_disabled = 0  # > 0 inside disabled()


def available() -> bool:
    """True when the native kernels are built and loaded (builds them on the first call)."""
    global _library, _tried
    if _disabled:
        return False
    if _tried:
        return _library is not None
    with _lock:
        if not _tried:
            _library = _load()
            _tried = True
    return _library is not None


def vectorized() -> bool:
    """Whether the loaded kernels are a vector path (AVX2 or AVX-512), not the scalar one."""
    return available() and _vector_width > 1


@contextlib.contextmanager
def disabled():
    """Within this block :func:`available` is False: everything takes the PyTorch path."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def usable_for(*tensors: torch.Tensor) -> bool:
    """Whether the element-wise kernels apply: CPU tensors of one dtype, float32 or bfloat16."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in (torch.float32, torch.bfloat16)
        and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)
        and available()
    )


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes and dtypes (otherwise use the PyTorch path)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        return False
    group = num_heads // num_kv_heads
    dtypes_ok = (
        query.dtype in _FLOAT_DTYPES if k_cache.dtype in _CODE_SUFFIX
        else k_cache.dtype in _FLOAT_DTYPES and query.dtype == k_cache.dtype
    )
    return (
        dtypes_ok
        and head_dim <= MAX_HEAD_DIM
        and head_dim % _vector_width == 0
        and group <= MAX_ROWS
        and group * head_dim <= MAX_ROW_FLOATS
        and slice_kind(k_cache) in (SLICE_PLAIN, SLICE_HEAD_KEYS)
    )


# The two physical layouts of a K/V pool the kernels read (cpu_ops.c, KV_LAYOUT_*). Either is
# seen from torch as [num_blocks, block_size, num_kv_heads, head_dim]; KV_LAYOUT_HEAD's tensors
# are permuted views of [num_blocks, KH, D, B] (keys) and [num_blocks, KH, B, D] (values).
KV_LAYOUT_TOKEN = 0
KV_LAYOUT_HEAD = 1
# How a tensor lays out each block (slice_kind); the numbers are cpu_ops.c's move_slice kinds.
SLICE_PLAIN, SLICE_HEAD_KEYS, SLICE_HEAD_VALUES = 0, 1, 2


def _strides_match(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """``t`` has these strides, over its dims longer than 1 (the rule ``is_contiguous`` uses).
    (Called per layer each step: the plain comparison first, the per-dim rule only if it fails.)"""
    got = t.stride()
    return got == strides or all(size == 1 or g == w for size, g, w in zip(t.shape, got, strides, strict=True))


def _head_strides(t: torch.Tensor, values: bool) -> tuple[int, ...]:
    _, b, kh, d = t.shape
    return (b * kh * d, d, b * d, 1) if values else (b * kh * d, 1, d * b, b)


def slice_kind(t: torch.Tensor) -> int | None:
    """SLICE_PLAIN for a contiguous tensor; for ``[N, B, KH, D]`` views of a KV_LAYOUT_HEAD
    pool, SLICE_HEAD_KEYS or SLICE_HEAD_VALUES; None for any other layout."""
    if t.is_contiguous():
        return SLICE_PLAIN
    if t.dim() != 4:
        return None
    if _strides_match(t, _head_strides(t, values=False)):
        return SLICE_HEAD_KEYS
    if _strides_match(t, _head_strides(t, values=True)):
        return SLICE_HEAD_VALUES
    return None


def kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """KV_LAYOUT_TOKEN or KV_LAYOUT_HEAD for a K/V pool pair the kernels read; None otherwise.
    (Where a dim of 1 makes both layouts put every element in the same place, TOKEN.)"""
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        return KV_LAYOUT_TOKEN
    if (
        k_cache.dim() == 4 and k_cache.shape == v_cache.shape
        and _strides_match(k_cache, _head_strides(k_cache, values=False))
        and _strides_match(v_cache, _head_strides(v_cache, values=True))
    ):
        return KV_LAYOUT_HEAD
    return None


KV_LAYOUT_ENV = "PAGEDLLM_KV_LAYOUT"  # auto (default), token or head: the CPU pools' layout
# The paths whose decode attention over float32 caches measured faster over KV_LAYOUT_HEAD
# pools: avx2 on AMD Zen 3 (docs/profile.md, twelfth round), the AVX-512 paths on AMD Zen 5
# (seventeenth round; not measured on Intel). Caches of other dtypes keep the token layout: their
# conversions bound them, and on Zen 5 bfloat16 ran 1.2x slower over head-layout pools (on Zen 3
# either layout alike). AMX attention (bfloat16 caches) reads token-major blocks only.
HEAD_LAYOUT_PATHS = frozenset({"avx2", "avx512", "avx512_bf16"})


def preferred_kv_layout(native: bool = True, dtype: torch.dtype = torch.float32) -> str:
    """The layout for CPU KV pools of ``dtype`` (KVCache's ``layout``): ``$PAGEDLLM_KV_LAYOUT``
    when set to token or head; by default head for float32 caches where the native kernels run a
    path of ``HEAD_LAYOUT_PATHS``, token elsewhere (and where ``native`` is False)."""
    value = os.environ.get(KV_LAYOUT_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "token", "head"):
        raise ConfigError(f"{KV_LAYOUT_ENV}={value!r}: use auto, token or head")
    if value != "auto":
        return value
    return "head" if native and dtype == torch.float32 and selected_isa() in HEAD_LAYOUT_PATHS else "token"


def tile_tokens(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query tokens per tile: as many as the kernel's row buffers hold, at most 16."""
    group = num_heads // num_kv_heads
    return max(1, min(MAX_TILE_TOKENS, MAX_ROWS // group, MAX_ROW_FLOATS // (group * head_dim)))


def make_tiles(
    seq_lens: list[int], query_lens: list[int], tokens_per_tile: int, breaks: Sequence[int] = ()
) -> torch.Tensor:
    """The kernel's work list: int32 ``[num_tiles, 4]`` rows of
    (block-table row, first query row, length row 0 sees, query rows).

    Sequence ``i``'s new tokens are query rows ``sum(query_lens[:i]) ...``; its
    token at position ``p`` sees ``p + 1`` tokens. Tiles are ordered longest
    context first, so the parallel loop does not end on one long tile.
    ``breaks``: query rows before which a tile ends (none holds rows on both
    sides of one), so that the tiles either side of a head range's bound can
    compute different KV heads (:func:`tile_head_ranges`).
    """
    if not breaks and all(q == 1 for q in query_lens):  # a decode step: one row per sequence
        order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)  # stable, as below
        return torch.tensor([v for i in order for v in (i, i, seq_lens[i], 1)], dtype=torch.int32).reshape(-1, 4)
    tiles = []
    row = 0
    cuts = sorted(set(breaks))
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        first_len = seq_len - q_len + 1
        ends = [b - row for b in cuts if row < b < row + q_len] + [q_len]
        offset = 0
        for end in ends:  # a run between breaks, in tiles of up to tokens_per_tile
            for start in range(offset, end, tokens_per_tile):
                rows = min(tokens_per_tile, end - start)
                tiles.append((i, row + start, first_len + start, rows))
            offset = end
        row += q_len
    tiles.sort(key=lambda t: -(t[2] + t[3]))
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 4)


def tile_head_ranges(tiles: torch.Tensor, head_rows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each tile's local KV heads for :func:`paged_attention`'s ``head_ranges``: int32
    ``[num_tiles, 2]`` rows ``(lo, hi)``, the heads ``h`` whose rows ``head_rows[h] = (r0, r1)``
    hold the tile's first row (``(0, 0)`` for none).

    ``tiles`` must come from :func:`make_tiles` with every ``r0`` / ``r1`` inside the rows among
    its ``breaks``, so a tile lies on one side of each (ValueError otherwise, as for a tile whose
    heads are not consecutive: the kernel takes a range)."""
    first = tiles[:, 1:2].long()  # [T, 1]
    bounds = torch.tensor(head_rows, dtype=torch.int64).reshape(-1, 2)  # [KH, 2]
    edges = bounds[bounds[:, 0] < bounds[:, 1]].reshape(-1)  # an empty range's bounds bound nothing
    if bool(((first < edges) & (edges < first + tiles[:, 3:4].long())).any()):
        raise ValueError(f"a tile straddles a bound of head_rows {tuple(head_rows)}: make the tiles with them as breaks")
    covered = (bounds[:, 0] <= first) & (first < bounds[:, 1])  # [T, KH]
    heads = torch.arange(bounds.shape[0])
    count = covered.sum(1)
    lo = torch.where(count > 0, torch.where(covered, heads, bounds.shape[0]).amin(1), 0)
    hi = lo + count
    if not torch.equal(covered, (lo[:, None] <= heads) & (heads < hi[:, None])):
        raise ValueError(f"head_rows {tuple(head_rows)} give a tile heads that are not consecutive")
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


def paged_attention(
    query: torch.Tensor,  # [R, H, D], float32 or bfloat16 (like the caches when they are float)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    tiles: torch.Tensor,  # from make_tiles
    scale: float,
    library: ctypes.CDLL | None = None,
    split_heads: bool | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, KH] float16, 8-bit caches only
    v_scale: torch.Tensor | None = None,
    head_ranges: torch.Tensor | None = None,  # [num_tiles, 2] int32, from tile_head_ranges
) -> torch.Tensor:  # [R, H, D], query's dtype; rows no tile covers are left unset
    """Causal paged attention of every query row a tile covers, K/V read in place.

    ``library`` defaults to the one :func:`available` loaded. ``split_heads``
    makes each (tile, KV head) its own work item; by default it is chosen
    from the number of tiles. An 8-bit cache (int8, float8_e4m3fn,
    float8_e5m2) needs its contiguous float16 scales. ``head_ranges``
    (:func:`tile_head_ranges`): tile ``i`` computes only the local KV heads
    ``[lo, hi)`` of row ``i``; its rows of the other heads are left unset."""
    library = library or _library
    assert library is not None, "call available() first"
    num_rows, num_heads, head_dim = query.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables.contiguous()
    tiles = tiles.contiguous()
    out = torch.empty((num_rows, num_heads, head_dim), dtype=query.dtype)
    kernel = library.paged_attention_bf16 if k_cache.dtype == torch.bfloat16 else library.paged_attention_f32
    scales = (None, None)
    if k_cache.dtype in _CODE_SUFFIX:
        kernel = _attention_kernel(library, query.dtype, k_cache.dtype)
        assert k_scale is not None and v_scale is not None, "an 8-bit cache needs its scales"
        assert k_scale.dtype == v_scale.dtype == torch.float16 and k_scale.is_contiguous() and v_scale.is_contiguous()
        scales = (k_scale.data_ptr(), v_scale.data_ptr())
    # Few tiles: one work item per (tile, KV head) keeps every thread busy. Many:
    # one per tile (its KV heads in turn), fewer and longer items.
    if split_heads is None:
        split_heads = tiles.shape[0] < 4 * torch.get_num_threads()
    layout = kv_layout(k_cache, v_cache)
    assert layout is not None, "the K/V caches are in neither layout the kernels read"
    if head_ranges is not None:
        assert head_ranges.dtype == torch.int32 and head_ranges.is_contiguous()
        assert head_ranges.shape == (tiles.shape[0], 2), "one (lo, hi) per tile"
    kernel(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *scales,
        tables.data_ptr(), tables.stride(0), tiles.data_ptr(), tiles.shape[0],
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], layout, scale, int(split_heads),
        None if head_ranges is None else head_ranges.data_ptr(), out.data_ptr(),
    )
    return out


def _attention_kernel(library: ctypes.CDLL, query_dtype: torch.dtype, cache_dtype: torch.dtype):
    name = "paged_attention_" + ("bf16" if query_dtype == torch.bfloat16 else "f32")
    if cache_dtype in _CODE_SUFFIX:
        name += "_" + _CODE_SUFFIX[cache_dtype]
    return getattr(library, name)


# ---------------------------------------------------------------- layer ops


def _kernel(name: str, dtype: torch.dtype, library: ctypes.CDLL | None):
    library = library or _library
    assert library is not None, "call available() first"
    return getattr(library, f"{name}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")


def rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``residual += delta`` in place (when given), then RMSNorm of ``residual`` times ``weight``.

    residual, delta: contiguous ``[rows, n]``; weight ``[n]``; all one dtype. Returns a new ``[rows, n]``.
    """
    assert residual.is_contiguous() and weight.is_contiguous()
    if delta is not None:
        delta = delta.contiguous()
    rows, n = residual.shape
    out = torch.empty_like(residual)
    _kernel("rms_norm", residual.dtype, library)(
        residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, rows, n,
        out.data_ptr(),
    )
    return out


def silu_mul(gate_up: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[rows, 2n]``; returns ``[rows, n]``."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _kernel("silu_mul", gate_up.dtype, library)(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    library: ctypes.CDLL | None = None,
) -> None:
    """Rotate ``x`` ``[rows, heads, head_dim]`` in place (rows may be strided; heads and
    dims contiguous) by the angles at ``positions`` (int64, each below the tables' length)
    of the float32 tables ``[max_position, head_dim / 2]``."""
    rows, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and positions.dtype == torch.int64
    positions = positions.contiguous()
    _kernel("rotary", x.dtype, library)(
        x.data_ptr(), rows, x.stride(0), heads, head_dim, positions.data_ptr(),
        cos_table.data_ptr(), sin_table.data_ptr(),
    )


def can_write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> bool:
    """Whether :func:`write_kv` takes these: CPU tensors of one float32 or bfloat16
    dtype, in a layout it copies directly."""
    return usable_for(key, value, k_cache, v_cache) and _write_kv_layout(key, value, k_cache, v_cache, slots)


def _write_kv_layout(key, value, k_cache, v_cache, slots) -> bool:
    """Rows of contiguous heads (the rows may be strided), caches in a layout the kernels know
    (:func:`kv_layout`), int64 slots."""
    return (
        all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        and kv_layout(k_cache, v_cache) is not None
        and slots.dtype == torch.int64
    )


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    library: ctypes.CDLL | None = None,
) -> None:
    """Token t's key and value ``[rows, KH, D]`` (rows may be strided) into cache slot
    ``slots[t]`` (int64); slot -1 is padding and skipped."""
    rows, kv_heads, head_dim = key.shape
    assert _write_kv_layout(key, value, k_cache, v_cache, slots)
    slots = slots.contiguous()
    _kernel("write_kv", key.dtype, library)(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), rows,
        kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], kv_layout(k_cache, v_cache),
    )


def can_write_kv_quantized(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> bool:
    """Whether :func:`write_kv_quantized` takes these: CPU float32/bfloat16 K/V, an 8-bit
    cache pair, contiguous float16 scales, and the layout :func:`write_kv` copies."""
    return (
        key.device.type == "cpu" and key.dtype in _FLOAT_DTYPES and value.dtype == key.dtype
        and k_cache.device.type == "cpu" and k_cache.dtype in _CODE_SUFFIX and v_cache.dtype == k_cache.dtype
        and key.shape[2] <= MAX_HEAD_DIM
        and all(s.dtype == torch.float16 and s.is_contiguous() for s in (k_scale, v_scale))
        and available()
        and _write_kv_layout(key, value, k_cache, v_cache, slots)
    )


def write_kv_quantized(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, library: ctypes.CDLL | None = None,
) -> None:
    """As :func:`write_kv` into an 8-bit cache: each (token, head) vector quantized with
    its own float16 scale (``k_scale``/``v_scale`` ``[num_blocks, block_size, KH]``),
    bit for bit as ``kv_format.quantize_kv``."""
    library = library or _library
    assert library is not None, "call available() first"
    rows, kv_heads, head_dim = key.shape
    assert _write_kv_layout(key, value, k_cache, v_cache, slots)
    slots = slots.contiguous()
    suffix = ("bf16" if key.dtype == torch.bfloat16 else "f32") + "_" + _CODE_SUFFIX[k_cache.dtype]
    getattr(library, f"write_kv_{suffix}")(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), rows,
        kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
        k_cache.shape[1], kv_layout(k_cache, v_cache),
    )


def hadamard_(x: torch.Tensor, scale: float = 1.0, library: ctypes.CDLL | None = None) -> None:
    """Each ``head_dim`` vector of float32 ``x`` ``[rows, heads, head_dim]`` (rows may be strided;
    heads and dims contiguous; ``head_dim`` a power of two) becomes, in place, its unnormalised
    Walsh-Hadamard transform times ``scale``: bit for bit ``kv_format.hadamard``."""
    library = library or _library
    assert library is not None, "call available() first"
    rows, heads, head_dim = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == head_dim
    library.hadamard_f32(x.data_ptr(), rows, x.stride(0), heads, head_dim, scale)


def argmax_logsumexp(
    logits: torch.Tensor, library: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 ``[rows, n]`` logits: the first index of the maximum (int64,
    as ``argmax``) and ``logsumexp`` (float32), in one pass over the row."""
    argmax, lse, _ = _row_argmax_logsumexp(logits, library, top_logprob=False)
    return argmax, lse


def greedy_pick(logits: torch.Tensor, library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 ``[rows, n]`` logits: the first index of the maximum (int64) and its
    logprob, ``max - logsumexp`` in float32 (the bits of ``logits.gather(argmax) - logsumexp``),
    in one pass over each row."""
    argmax, _, logprob = _row_argmax_logsumexp(logits, library, top_logprob=True)
    return argmax, logprob


def _row_argmax_logsumexp(
    logits: torch.Tensor, library: ctypes.CDLL | None, top_logprob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    library = library or _library
    assert library is not None, "call available() first"
    logits = logits.contiguous()
    rows, n = logits.shape
    argmax = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    logprob = torch.empty(rows, dtype=torch.float32) if top_logprob else None
    library.row_argmax_logsumexp(logits.data_ptr(), rows, n, argmax.data_ptr(), lse.data_ptr(),
                                 None if logprob is None else logprob.data_ptr())
    return argmax, lse, logprob


# Bytes a block move must have before its copies are shared between threads.
PARALLEL_MIN_COPY_BYTES = 1 << 22


def can_move_blocks(tensors: list[torch.Tensor], raws: list[torch.Tensor]) -> bool:
    """Whether :func:`move_blocks` applies: CPU tensors in a layout it knows (:func:`slice_kind`:
    contiguous, or a KV_LAYOUT_HEAD pool's keys or values) and contiguous raw blocks, kernels loaded."""
    return (
        available()
        and all(t.device.type == "cpu" and slice_kind(t) is not None for t in tensors)
        and all(r.device.type == "cpu" and r.dtype == torch.uint8 and r.is_contiguous() for r in raws)
        and len({tuple(t.shape[1:]) for t in tensors if slice_kind(t) != SLICE_PLAIN}) <= 1
    )


def move_blocks(
    tensors: list[torch.Tensor], block_ids: list[int], raws: list[torch.Tensor], *, into_tensors: bool,
    library: ctypes.CDLL | None = None,
) -> None:
    """Raw block ``raws[i]`` (every tensor's slice [block_ids[i]] in its logical order, back to
    back, see ``kv.tiers.pack_block``) into the tensors (``into_tensors``) or out of them into
    ``raws``; one call for every block and tensor. Check :func:`can_move_blocks` first."""
    library = library or _library
    assert library is not None, "call available() first"
    n, nt = len(block_ids), len(tensors)
    rows = [t.stride(0) * t.element_size() for t in tensors]  # bytes per block (dense blocks)
    size = sum(rows)
    for raw in raws:
        assert raw.numel() == size, f"a raw block of {raw.numel()} bytes, the tensors' blocks hold {size}"
    limit = min(t.shape[0] for t in tensors)
    assert all(0 <= b < limit for b in block_ids), "a block id outside the tensors"
    ids = (ctypes.c_int64 * n)(*block_ids)
    raw_ptrs = (ctypes.c_void_p * n)(*(r.data_ptr() for r in raws))
    bases = (ctypes.c_void_p * nt)(*(t.data_ptr() for t in tensors))
    row = (ctypes.c_int64 * nt)(*rows)
    kinds = [slice_kind(t) for t in tensors]
    shaped = [t for t, kind in zip(tensors, kinds) if kind != SLICE_PLAIN]
    shape = (ctypes.c_int64 * 3)(*(shaped[0].shape[1:] if shaped else (0, 0, 0)))
    move = library.scatter_blocks if into_tensors else library.gather_blocks
    move(n, ids, raw_ptrs, nt, bases, row, (ctypes.c_int32 * nt)(*kinds), shape,
         int(n * size >= PARALLEL_MIN_COPY_BYTES))


# ---------------------------------------------------------------- ISA paths, build and load

# One shared object per path, compiled from the same source with these flags;
# cheapest first. A path runs where /proc/cpuinfo lists every flag it needs.
ISA_PATHS = ("scalar", "avx2", "avx512", "avx512_bf16")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_COMPILE_FLAGS = {
    "scalar": (),
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx512_bf16": (*_AVX512_FLAGS, "-mavx512bf16"),
}
_AVX2_CPU = frozenset({"avx2", "fma", "f16c"})
_AVX512_CPU = _AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_CPU_FLAGS_NEEDED = {
    "scalar": frozenset(),
    "avx2": _AVX2_CPU,
    "avx512": _AVX512_CPU,
    "avx512_bf16": _AVX512_CPU | {"avx512_bf16"},
}
ISA_ENV = "PAGEDLLM_CPU_ISA"  # auto (default) or one of ISA_PATHS
# The packed-weight matmuls' path (PAGEDLLM_QUANT_ISA) that a CPU of a class without AVX-512
# runs: forcing "avx2" forces both kernel libraries, so a run stands for an AVX2 machine. The
# AVX-512 paths leave the matmuls to pick their best (VNNI, AMX) as such a CPU would.
_QUANT_PATH_OF_CLASS = {"scalar": "portable", "avx2": "avx2"}


def isa_environment(isa: str) -> dict[str, str]:
    """The environment that runs pagedllm as on a CPU whose best path is ``isa`` (one of ISA_PATHS)."""
    from pagedllm.native.quant_ops import ISA_ENV as QUANT_ISA_ENV

    env = {ISA_ENV: isa}
    if isa in _QUANT_PATH_OF_CLASS:
        env[QUANT_ISA_ENV] = _QUANT_PATH_OF_CLASS[isa]
    return env


def cpu_flags() -> frozenset[str]:
    """The ISA flags the kernel lists for this CPU (Linux ``/proc/cpuinfo``; empty elsewhere).

    Linux drops a flag whose register state the OS does not save, so a listed
    flag is usable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name as the OS reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa_paths() -> tuple[str, ...]:
    """The kernel paths this CPU runs, cheapest first; ``scalar`` always."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("scalar",)
    flags = cpu_flags()
    return tuple(isa for isa in ISA_PATHS if _CPU_FLAGS_NEEDED[isa] <= flags)


def requested_isa() -> str:
    """The path to load: ``$PAGEDLLM_CPU_ISA`` when set (and not ``auto``), else the
    best this CPU runs. Raises ConfigError for an unknown name or one this CPU lacks."""
    from pagedllm.errors import ConfigError

    name = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    runnable = cpu_isa_paths()
    if name == "auto":
        return runnable[-1]
    if name not in ISA_PATHS:
        raise ConfigError(f"{ISA_ENV}={name!r} is not a kernel path; use auto or one of {', '.join(ISA_PATHS)}")
    if name not in runnable:
        missing = sorted(_CPU_FLAGS_NEEDED[name] - cpu_flags())
        raise ConfigError(
            f"{ISA_ENV}={name}: this CPU lacks {', '.join(missing) or 'x86-64'}; "
            f"it runs {', '.join(runnable)}"
        )
    return name


def selected_isa() -> str | None:
    """The path of the loaded kernels (``scalar``, ``avx2``, ...), or None when they are not loaded."""
    return _library.isa_name().decode() if available() else None


@contextlib.contextmanager
def using_isa(isa: str):
    """Within this block the kernels of path ``isa`` are the loaded ones (tests and benchmarks)."""
    global _library, _tried, _vector_width
    if not available():
        raise RuntimeError("the native CPU kernels are not available")
    saved = _library, _vector_width
    library = build_library(isa=isa)
    with _lock:
        _library, _vector_width = library, library.vector_width()
    try:
        yield library
    finally:
        with _lock:
            _library, _vector_width = saved


ATTENTION_AMX_ENV = "PAGEDLLM_ATTENTION_AMX"


def attention_amx(library: ctypes.CDLL | None = None) -> bool:
    """Whether bfloat16 caches' attention runs on AMX-BF16 tiles (the avx512_bf16 path on a CPU
    with AMX, head_dim a multiple of 32 up to 128), unless ``PAGEDLLM_ATTENTION_AMX=0``."""
    library = library or (_library if available() else None)
    return bool(library is not None and library.attention_amx())


@contextlib.contextmanager
def attention_amx_set(on: bool, library: ctypes.CDLL | None = None):
    """Within this block bfloat16 attention takes the AMX tiles (where the CPU has them) or the
    vector path; yields whether the tiles are on (tests and benchmarks)."""
    library = library or _library
    assert library is not None, "call available() first"
    before = library.attention_amx()
    try:
        yield bool(library.set_attention_amx(int(on)))
    finally:
        library.set_attention_amx(before)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDLLM_NATIVE_OPS", "1") == "0":
        return None
    if _compiler() is None or platform.system() != "Linux":
        return None
    isa = requested_isa()  # a bad PAGEDLLM_CPU_ISA is the user's to fix: raise
    try:
        library = build_library(isa=isa)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels (%s) unavailable (%s); using the PyTorch path", isa, exc)
        return None
    global _vector_width
    _vector_width = library.vector_width()
    logger.debug("native CPU kernels: %s path", isa)
    return library


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build_library(extra_flags: tuple[str, ...] = (), isa: str | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load the kernels of path ``isa`` (default:
    :func:`requested_isa`); ``extra_flags`` go to the compiler after the path's own."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    isa = isa or requested_isa()
    if isa not in _COMPILE_FLAGS:
        raise ValueError(f"unknown kernel path {isa!r}; one of {ISA_PATHS}")
    library = ctypes.CDLL(str(_build(compiler, compile_flags(isa, extra_flags))))
    _declare(library)
    return library


def compile_flags(isa: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler flags of path ``isa``'s build (build_cache adds its STRICT_FLAGS)."""
    return ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", *_COMPILE_FLAGS[isa], *extra_flags]


def _declare(library: ctypes.CDLL) -> None:
    """The C signatures, for ctypes."""
    pointer, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    library.vector_width.restype = ctypes.c_int
    library.isa_name.restype = ctypes.c_char_p
    codes = [""] + [f"_{suffix}" for suffix in _CODE_SUFFIX.values()]
    for query_type in ("f32", "bf16"):
        for code in codes:
            fn = getattr(library, f"paged_attention_{query_type}{code}")
            fn.argtypes = [pointer, i64, pointer, pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64,
                           i64, i64, i32, f32, i32, pointer, pointer]
            fn.restype = None
            if code:
                fn = getattr(library, f"write_kv_{query_type}{code}")
                fn.argtypes = [pointer, i64, pointer, i64, pointer, i64, i64, i64, pointer, pointer, pointer, pointer,
                               i64, i32]
                fn.restype = None
    signatures = {
        "rms_norm": [pointer, pointer, pointer, f32, i64, i64, pointer],
        "silu_mul": [pointer, i64, i64, pointer],
        "rotary": [pointer, i64, i64, i64, i64, pointer, pointer, pointer],
        "write_kv": [pointer, i64, pointer, i64, pointer, i64, i64, i64, pointer, pointer, i64, i32],
    }
    library.attention_amx.restype = ctypes.c_int
    library.set_attention_amx.argtypes = [ctypes.c_int]
    library.set_attention_amx.restype = ctypes.c_int
    library.hadamard_f32.argtypes = [pointer, i64, i64, i64, i64, f32]
    library.hadamard_f32.restype = None
    library.hadamard_bf16.argtypes = [pointer, i64, i64, i64, i64, f32, i64, pointer, i64]
    library.hadamard_bf16.restype = None
    library.row_argmax_logsumexp.argtypes = [pointer, i64, i64, pointer, pointer, pointer]
    library.row_argmax_logsumexp.restype = None
    for name in ("scatter_blocks", "gather_blocks"):
        getattr(library, name).argtypes = [i64, pointer, pointer, i64, pointer, pointer, pointer, pointer, i64]
        getattr(library, name).restype = None
    for name, argtypes in signatures.items():
        for suffix in ("f32", "bf16"):
            fn = getattr(library, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile into the cache directory unless an identical build is there already.

    The flags name the instruction set, not this CPU model, so the file is keyed
    on the source, the compiler and the flags."""
    return compiled("cpu_ops", native_source(_SOURCE_PATH), compiler, flags)
