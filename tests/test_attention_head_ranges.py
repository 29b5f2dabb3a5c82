"""Attention of a sub-range of the local KV heads per tile (tensor parallelism splits one KV
head's query rows between two ranks): ``cpu_ops.make_tiles(breaks=...)``,
``cpu_ops.tile_head_ranges``, the kernels' ``head_ranges`` and ``forward(head_rows=...)``.

A row a range covers must come out with the same bits as without ranges; the rows of the heads
it leaves out must not be written at all (checked through an output buffer filled with NaN)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from attention_reference import make_paged_batch
from native_paths import LIBRARY_PARAMS, built_library

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kv import kv_format
from pagedllm.kv.kv_cache import in_layout
from pagedllm.native import cpu_ops

native_only = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native CPU kernels")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
GROUP = NUM_HEADS // NUM_KV_HEADS

# (context, new tokens) per sequence, and the row R at which KV head 1's range ends (mid-tile,
# mid-sequence where a sequence has several rows)
STEPS = {
    "decode": ([(333, 1), (64, 1), (1, 1), (17, 1), (130, 1), (95, 1), (40, 1), (3, 1)], 3),
    "prefill": ([(20, 45)], 20),
    "mixed": ([(0, 37), (50, 1), (333, 1), (15, 1), (20, 17), (0, 1), (7, 9)], 45),
}
CACHES = {  # name: (query dtype, cache dtype)
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "int8-float32": (torch.float32, torch.int8),
    "int8-bfloat16": (torch.bfloat16, torch.int8),
}


def head_row_sets(rows: int, split: int) -> list[tuple[tuple[int, int], ...]]:
    """Head 0 every row, head 1 rows [0, split), head 2 none; and the complement of that."""
    return [((0, rows), (0, split), (0, 0)), ((0, 0), (split, rows), (0, rows))]


@pytest.fixture(scope="module", params=LIBRARY_PARAMS)
def library(request):
    yield from built_library(request.param)


@contextlib.contextmanager
def nan_outputs(monkeypatch):
    """Within: torch.empty hands out NaN-filled tensors, so rows a kernel leaves unwritten stay NaN."""
    empty = torch.empty
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
        yield


def _caches(batch, cache_dtype: torch.dtype, layout: str = "token") -> dict:
    """The batch's K/V (the new tokens written) as paged_attention's keyword arguments."""
    md = batch.metadata
    write = TorchAttentionBackend(use_native=False).write_kv
    if cache_dtype in (torch.float32, torch.bfloat16):
        k, v, scales = batch.k_cache, batch.v_cache, {}
        write(batch.new_key, batch.new_value, k, v, md.slot_mapping)
    else:
        (k, k_scale), (v, v_scale) = (kv_format.quantize_kv(c, cache_dtype) for c in (batch.k_cache, batch.v_cache))
        write(batch.new_key, batch.new_value, k, v, md.slot_mapping, k_scale, v_scale)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    return {"k_cache": in_layout(k, layout, values=False), "v_cache": in_layout(v, layout, values=True), **scales}


def _rows_of(head_rows, rows: int) -> torch.Tensor:
    """[rows, KH] bool: whether KV head h's range holds row r."""
    r = torch.arange(rows)[:, None]
    bounds = torch.tensor(head_rows)
    return (bounds[:, 0] <= r) & (r < bounds[:, 1])


def _assert_only_covered_rows(out: torch.Tensor, full: torch.Tensor, head_rows) -> None:
    """out equals full bit for bit on the (row, KV head) pairs head_rows covers; elsewhere NaN (unwritten)."""
    covered = _rows_of(head_rows, full.shape[0]).repeat_interleave(GROUP, dim=1)  # [rows, H]
    assert torch.equal(out[covered], full[covered])
    assert bool(out[~covered].isnan().all()), "a row outside its head's range was written"


# ---------------------------------------------------------------- make_tiles(breaks=...)


@pytest.mark.parametrize("step", list(STEPS))
def test_breaks_split_tiles_and_cover_every_row_once(step):
    specs, split = STEPS[step]
    seq_lens, query_lens = [c + q for c, q in specs], [q for _, q in specs]
    rows = sum(query_lens)
    default = cpu_ops.make_tiles(seq_lens, query_lens, 16)
    assert torch.equal(cpu_ops.make_tiles(seq_lens, query_lens, 16, breaks=()), default)
    starts = [sum(query_lens[:i]) for i in range(len(specs))]
    # a break at a sequence's first row (or at 0 or past the rows) changes nothing
    assert torch.equal(cpu_ops.make_tiles(seq_lens, query_lens, 16, breaks=[*starts, rows, rows + 5]), default)
    breaks = [split, split + 1, 7, 7]
    tiles = cpu_ops.make_tiles(seq_lens, query_lens, 16, breaks=breaks)
    covered = []
    for seq, first_row, first_len, count in tiles.tolist():
        assert 1 <= count <= 16
        assert not any(first_row < b < first_row + count for b in breaks), (first_row, count)
        assert starts[seq] <= first_row and first_row + count <= starts[seq] + query_lens[seq]
        assert first_len == seq_lens[seq] - query_lens[seq] + (first_row - starts[seq]) + 1
        covered.extend(range(first_row, first_row + count))
    assert sorted(covered) == list(range(rows))
    spans = [first_len + count for _, _, first_len, count in tiles.tolist()]
    assert spans == sorted(spans, reverse=True)


def test_breaks_cut_only_the_tiles_they_fall_in():
    # one sequence of 33 new tokens after 10 cached, 16 per tile, a break at row 11
    tiles = cpu_ops.make_tiles([43], [33], 16, breaks=[11])
    assert sorted(tiles.tolist(), key=lambda t: t[1]) == [[0, 0, 11, 11], [0, 11, 22, 16], [0, 27, 38, 6]]


# ---------------------------------------------------------------- tile_head_ranges


def test_tile_head_ranges_give_each_tile_its_heads():
    tiles = cpu_ops.make_tiles([43, 5, 9], [33, 1, 4], 16, breaks=[11, 34])  # rows 0-32, 33, 34-37

    def by_first_row(head_rows) -> dict[int, tuple[int, int]]:
        ranges = cpu_ops.tile_head_ranges(tiles, head_rows)
        assert ranges.dtype == torch.int32 and ranges.shape == (tiles.shape[0], 2) and ranges.is_contiguous()
        return {first: tuple(r) for (_, first, _, _), r in zip(tiles.tolist(), ranges.tolist())}

    assert by_first_row(((0, 38), (0, 11), (0, 0))) == {0: (0, 2), 11: (0, 1), 27: (0, 1), 33: (0, 1), 34: (0, 1)}
    assert by_first_row(((34, 38), (0, 38), (0, 34))) == {0: (1, 3), 11: (1, 3), 27: (1, 3), 33: (1, 3), 34: (0, 2)}
    assert by_first_row(((0, 0), (5, 5), (38, 38))) == dict.fromkeys((0, 11, 27, 33, 34), (0, 0))
    assert by_first_row(((0, 11), (11, 34), (34, 99))) == {0: (0, 1), 11: (1, 2), 27: (1, 2), 33: (1, 2), 34: (2, 3)}


def test_tile_head_ranges_refuse_heads_that_are_not_consecutive():
    tiles = cpu_ops.make_tiles([43, 5, 9], [33, 1, 4], 16, breaks=[11, 34])
    with pytest.raises(ValueError, match="consecutive"):  # rows 34-37: heads 0 and 2
        cpu_ops.tile_head_ranges(tiles, ((0, 38), (0, 11), (34, 38)))
    with pytest.raises(ValueError, match="consecutive"):  # rows 0-10: heads 0 and 2
        cpu_ops.tile_head_ranges(tiles, ((0, 11), (11, 38), (0, 11)))


def test_tile_head_ranges_refuse_a_tile_across_a_bound():
    tiles = cpu_ops.make_tiles([43], [33], 16)  # rows 0-15, 16-31, 32
    with pytest.raises(ValueError, match="straddles"):
        cpu_ops.tile_head_ranges(tiles, ((0, 33), (0, 20), (0, 0)))
    # with the bound among the breaks it is fine
    tiles = cpu_ops.make_tiles([43], [33], 16, breaks=[20])
    ranges = cpu_ops.tile_head_ranges(tiles, ((0, 33), (0, 20), (0, 0)))
    assert {t[1]: tuple(r) for t, r in zip(tiles.tolist(), ranges.tolist())} == {0: (0, 2), 16: (0, 2), 20: (0, 1)}


# ---------------------------------------------------------------- the kernels


@native_only
@pytest.mark.parametrize("layout", ["token", "head"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("step", list(STEPS))
def test_a_head_range_computes_its_rows_with_the_same_bits_and_no_others(library, monkeypatch, step, cache, layout):
    if HEAD_DIM % library.vector_width():
        pytest.skip("head_dim not a multiple of this path's vector width")
    specs, split = STEPS[step]
    dtype, cache_dtype = CACHES[cache]
    batch = make_paged_batch(specs, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_dim=HEAD_DIM, dtype=dtype, seed=len(specs))
    md = batch.metadata
    caches = _caches(batch, cache_dtype, layout)
    rows = batch.query.shape[0]
    per_tile = cpu_ops.tile_tokens(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)

    def attend(tiles, split_heads, head_ranges=None):
        return cpu_ops.paged_attention(batch.query, block_tables=md.block_tables, tiles=tiles, scale=batch.scale,
                                       library=library, split_heads=split_heads, head_ranges=head_ranges, **caches)

    default = attend(cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, per_tile), False)
    assert not bool(default.isnan().any())
    for head_rows in head_row_sets(rows, split):
        breaks = [r for bounds in head_rows for r in bounds if 0 < r < rows]
        tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, per_tile, breaks)
        ranges = cpu_ops.tile_head_ranges(tiles, head_rows)
        for split_heads in (False, True):
            full = attend(tiles, split_heads)
            assert torch.equal(full, default), split_heads  # the breaks' tiles: the same bits
            with nan_outputs(monkeypatch):
                out = attend(tiles, split_heads, ranges)
            _assert_only_covered_rows(out, full, head_rows)


@native_only
def test_decode_threads_share_the_covered_heads(library, monkeypatch):
    """A decode-only call weighs each tile by its heads when it splits the tiles between threads
    (a tile with none weighs nothing, and a call with no head at all computes nothing): any
    number of threads, the same bits."""
    specs, split = STEPS["decode"]
    batch = make_paged_batch(specs * 3, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_dim=HEAD_DIM, seed=5)
    md = batch.metadata
    caches = _caches(batch, torch.float32)
    rows = batch.query.shape[0]
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, 1)

    def attend(head_ranges=None):
        return cpu_ops.paged_attention(batch.query, block_tables=md.block_tables, tiles=tiles, scale=batch.scale,
                                       library=library, split_heads=False, head_ranges=head_ranges, **caches)

    full = attend()
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for head_rows in [*head_row_sets(rows, split), ((0, 0),) * NUM_KV_HEADS, ((0, rows), (5, 5), (0, 0))]:
                with nan_outputs(monkeypatch):
                    out = attend(cpu_ops.tile_head_ranges(tiles, head_rows))
                _assert_only_covered_rows(out, full, head_rows)
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------- the backend


@pytest.mark.parametrize("cache", ["float32", "int8-bfloat16"])
@pytest.mark.parametrize("use_native", [False, pytest.param(None, marks=native_only)], ids=["pytorch", "native"])
def test_forward_with_head_rows_matches_on_the_covered_rows(monkeypatch, use_native, cache):
    specs, split = STEPS["mixed"]
    dtype, cache_dtype = CACHES[cache]
    batch = make_paged_batch(specs, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_dim=HEAD_DIM, dtype=dtype, num_padding_tokens=2, seed=9)
    md = batch.metadata
    caches = _caches(batch, cache_dtype)
    rows = sum(md.query_lens_host)
    backend = TorchAttentionBackend(use_native=use_native)
    native = backend.native_work(batch.query, caches["k_cache"], md) is not None
    assert native == (use_native is None and (cpu_ops.vectorized() or md.max_query_len == 1))

    def forward(head_rows=None):
        return backend.forward(batch.query, metadata=md, scale=batch.scale, head_rows=head_rows, **caches)

    full = forward()
    assert torch.count_nonzero(full[rows:]) == 0  # padding rows
    for head_rows in head_row_sets(rows, split):
        for _ in range(2):  # every layer of the step: the work list is built once
            with nan_outputs(monkeypatch):
                out = forward(head_rows)
            assert torch.count_nonzero(out[rows:]) == 0
            if native:
                _assert_only_covered_rows(out[:rows], full[:rows], head_rows)
            else:  # the PyTorch path computes every row
                assert torch.equal(out, full)
        if native:
            tiles, num_rows = backend.native_work(batch.query, caches["k_cache"], md, head_rows)
            assert num_rows == rows and backend.native_work(batch.query, caches["k_cache"], md, head_rows)[0] is tiles
            assert not any(t[1] < split < t[1] + t[3] for t in tiles.tolist())
    assert torch.equal(forward(), full)  # and all heads of every row again
