"""TorchAttentionBackend against the dense oracle in tests/attention_reference.py."""

from __future__ import annotations

import subprocess

import pytest
import torch
from attention_reference import make_paged_batch, naive_attention

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.native import cpu_ops

ATOL = 1e-5


def _run(batch, use_native=None):
    backend = TorchAttentionBackend(use_native=use_native)
    md = batch.metadata
    backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    return backend.forward(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)


def _num_real_rows(batch) -> int:
    return sum(batch.metadata.query_lens_host)


def _assert_matches_oracle(batch, use_native=None):
    out = _run(batch, use_native)
    rows = _num_real_rows(batch)
    expected = naive_attention(batch.query[:rows], batch)
    assert out.shape == batch.query.shape
    assert (out[:rows] - expected[:rows]).abs().max().item() <= ATOL


SPECS = {
    "prefill_only": [(0, 7), (0, 33), (0, 1), (0, 16)],
    "decode_only": [(5, 1), (40, 1), (15, 1), (0, 1), (63, 1)],
    "prefix_offsets": [(16, 5), (3, 30), (31, 2)],
    "mixed": [(0, 20), (12, 1), (7, 9), (64, 1), (0, 1), (33, 17)],
}


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("use_native", [False, None])  # the pure-PyTorch path, then the default
def test_matches_naive_attention(block_size, num_heads, num_kv_heads, kind, use_native):
    batch = make_paged_batch(
        SPECS[kind],
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        seed=block_size + num_heads,
    )
    _assert_matches_oracle(batch, use_native)


@pytest.mark.parametrize("kind", ["mixed", "decode_only"])
def test_padding_rows_are_ignored(kind):
    batch = make_paged_batch(SPECS[kind], block_size=16, num_padding_tokens=5, seed=3)
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    _assert_matches_oracle(batch)
    # only the real slots changed; the padded rows wrote nowhere
    slots = batch.metadata.slot_mapping
    real = slots[slots >= 0]
    changed_k = (batch.k_cache != k_before).flatten(2).any(-1).flatten().nonzero().flatten()
    changed_v = (batch.v_cache != v_before).flatten(2).any(-1).flatten().nonzero().flatten()
    assert set(changed_k.tolist()) <= set(real.tolist())
    assert set(changed_v.tolist()) <= set(real.tolist())


def test_write_kv_puts_each_token_at_its_slot():
    batch = make_paged_batch([(3, 9), (0, 20), (17, 1)], block_size=8, num_padding_tokens=2, seed=7)
    k_before = batch.k_cache.clone()
    TorchAttentionBackend().write_kv(
        batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping
    )
    block_size = batch.k_cache.shape[1]
    touched = set()
    for t, slot in enumerate(batch.metadata.slot_mapping.tolist()):
        if slot < 0:
            continue
        touched.add(slot)
        block, offset = divmod(slot, block_size)
        assert torch.equal(batch.k_cache[block, offset], batch.new_key[t])
        assert torch.equal(batch.v_cache[block, offset], batch.new_value[t])
    flat_now = batch.k_cache.flatten(0, 1)
    flat_before = k_before.flatten(0, 1)
    for slot in range(flat_now.shape[0]):
        if slot not in touched:
            assert torch.equal(flat_now[slot], flat_before[slot])


def test_bfloat16_close_to_oracle():
    batch = make_paged_batch(SPECS["mixed"], block_size=16, dtype=torch.bfloat16, seed=11)
    out = _run(batch)
    expected = naive_attention(batch.query, batch)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max().item() < 3e-2


# ---------------------------------------------------------------- native kernel and plan reuse

native_only = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native CPU kernel")


@native_only
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64)])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_native_kernel_matches_oracle(block_size, num_heads, num_kv_heads, head_dim, kind):
    batch = make_paged_batch(
        SPECS[kind], block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, num_padding_tokens=2, seed=block_size + head_dim,
    )
    out = _run(batch, use_native=True)
    rows = _num_real_rows(batch)
    expected = naive_attention(batch.query[:rows], batch)
    assert (out[:rows] - expected).abs().max().item() <= ATOL
    assert torch.count_nonzero(out[rows:]) == 0  # padding rows stay zero


@native_only
def test_native_kernel_bfloat16_matches_torch_path():
    batch = make_paged_batch(SPECS["mixed"], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                             dtype=torch.bfloat16, seed=5)
    k0, v0 = batch.k_cache.clone(), batch.v_cache.clone()
    native = _run(batch, use_native=True)
    batch.k_cache.copy_(k0)
    batch.v_cache.copy_(v0)
    reference = _run(batch, use_native=False)
    assert native.dtype == torch.bfloat16
    assert (native.float() - reference.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("use_native", [False, pytest.param(True, marks=native_only)])
def test_unwritten_slots_are_never_read(use_native):
    """The CPU KV pools are allocated uninitialised: slots past a sequence's length
    (and blocks no table uses) may hold NaN, and must not reach the output."""
    batch = make_paged_batch(SPECS["mixed"], block_size=16, num_heads=6, num_kv_heads=2, seed=13)
    md = batch.metadata
    context = torch.full_like(batch.k_cache, float("nan")), torch.full_like(batch.v_cache, float("nan"))
    for i, (seq_len, q_len) in enumerate(zip(md.seq_lens_host, md.query_lens_host)):
        for pos in range(seq_len - q_len):  # only the already-written context is copied over
            block, offset = md.block_tables[i, pos // 16].item(), pos % 16
            context[0][block, offset] = batch.k_cache[block, offset]
            context[1][block, offset] = batch.v_cache[block, offset]
    batch.k_cache, batch.v_cache = context
    out = _run(batch, use_native)
    rows = _num_real_rows(batch)
    assert torch.isfinite(out).all()
    assert (out[:rows] - naive_attention(batch.query[:rows], batch)).abs().max().item() <= ATOL


LONG_SPECS = [(0, 300), (500, 40), (1000, 1), (37, 100), (15, 1), (0, 17)]


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 8, 128), (32, 4, 128), (32, 1, 128), (4, 2, 48)],
)
def test_native_kernel_long_sequences_and_shapes(dtype, num_heads, num_kv_heads, head_dim):
    """Long prefills span many tiles and contexts many blocks; group sizes from 1 to 32
    change how many tokens a tile holds, head dims 48/64/128 the kernel's unrolling."""
    batch = make_paged_batch(
        LONG_SPECS, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, num_padding_tokens=1, seed=num_heads * head_dim,
    )
    out = _run(batch, use_native=True)
    rows = _num_real_rows(batch)
    expected = naive_attention(batch.query[:rows].double(), batch)
    tolerance = ATOL if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert out.dtype == dtype
    assert (out[:rows].double() - expected).abs().max().item() <= tolerance
    assert torch.count_nonzero(out[rows:]) == 0


@native_only
@pytest.mark.parametrize("split_heads", [True, False])
def test_native_work_split_by_tile_or_by_head(split_heads):
    batch = make_paged_batch(LONG_SPECS, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=29)
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, tokens_per_tile=16)
    out = cpu_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, md.block_tables, tiles, batch.scale, split_heads=split_heads
    )
    assert (out - naive_attention(batch.query.double(), batch)).abs().max().item() <= ATOL


@native_only
@pytest.mark.parametrize("kind", ["mixed", "decode_only"])
def test_portable_build_leaves_prefill_steps_to_pytorch(monkeypatch, kind):
    """Without AVX-512 the native kernel takes decode-only steps; a step with prefill
    chunks goes to SDPA, which is faster there. Both give the oracle's answer."""
    monkeypatch.setattr(cpu_ops, "_vector_width", 1)
    calls = []
    real = cpu_ops.paged_attention
    monkeypatch.setattr(cpu_ops, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = make_paged_batch(SPECS[kind], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=31)
    _assert_matches_oracle(batch)
    assert bool(calls) == (kind == "decode_only")


@native_only
def test_native_tiles_cover_every_row_once():
    seq_lens, query_lens = [40, 7, 100, 1], [33, 1, 100, 1]
    tiles = cpu_ops.make_tiles(seq_lens, query_lens, tokens_per_tile=16)
    covered = []
    for seq, first_row, first_len, rows in tiles.tolist():
        assert 1 <= rows <= 16
        start = sum(query_lens[:seq])
        for i in range(rows):
            row = first_row + i
            covered.append(row)
            # the row's token sits at position seq_len - q_len + (row - start) and sees one more token
            assert first_len + i == seq_lens[seq] - query_lens[seq] + (row - start) + 1
    assert sorted(covered) == list(range(sum(query_lens)))
    spans = [first_len + rows for _, _, first_len, rows in tiles.tolist()]
    assert spans == sorted(spans, reverse=True)  # longest work first


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_native_build_matches_oracle(dtype):
    """The scalar path, compiled for CPUs without AVX2 or AVX-512, computes the same attention."""
    try:
        library = cpu_ops.build_library(isa="scalar")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"compiler cannot build the scalar path: {exc}")
    assert library.vector_width() == 1
    batch = make_paged_batch(
        SPECS["mixed"], block_size=8, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=23
    )
    md = batch.metadata
    TorchAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    tiles = cpu_ops.make_tiles(md.seq_lens_host, md.query_lens_host, tokens_per_tile=5)
    out = cpu_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, md.block_tables, tiles, batch.scale, library=library
    )
    expected = naive_attention(batch.query.double(), batch)
    tolerance = ATOL if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("use_native", [False, pytest.param(True, marks=native_only)])
def test_one_backend_serves_successive_batches(use_native):
    """The per-step plan is cached per metadata object; a new batch must not reuse it."""
    backend = TorchAttentionBackend(use_native=use_native)
    batches = [
        make_paged_batch(SPECS[kind], block_size=16, seed=seed)
        for seed, kind in enumerate(["decode_only", "mixed", "prefill_only", "decode_only"])
    ]
    for batch in batches:
        md = batch.metadata
        for _ in range(2):  # two "layers" of the same step
            backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
            out = backend.forward(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)
            rows = _num_real_rows(batch)
            assert (out[:rows] - naive_attention(batch.query[:rows], batch)).abs().max().item() <= ATOL


@pytest.mark.parametrize("kind", ["prefill_only", "prefix_offsets", "mixed"])
def test_prefill_in_query_tiles_matches_oracle(monkeypatch, kind):
    """A tiny score budget forces several query tiles per sequence (as a long prompt's chunk gets)."""
    from pagedllm.attention import torch_backend

    monkeypatch.setattr(torch_backend, "MAX_SCORES_PER_TILE", 4 * 40)  # 4 heads x 40 keys: one query a tile
    batch = make_paged_batch(SPECS[kind], block_size=8, num_heads=4, num_kv_heads=2, seed=37)
    _assert_matches_oracle(batch, use_native=False)
