"""TorchAttentionBackend against the dense oracle in tests/attention_reference.py."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_paged_batch, naive_attention

from pagedllm.attention.torch_backend import TorchAttentionBackend

ATOL = 1e-5


def _run(batch):
    backend = TorchAttentionBackend()
    md = batch.metadata
    backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, md.slot_mapping)
    return backend.forward(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)


def _num_real_rows(batch) -> int:
    return sum(batch.metadata.query_lens_host)


def _assert_matches_oracle(batch):
    out = _run(batch)
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
def test_matches_naive_attention(block_size, num_heads, num_kv_heads, kind):
    batch = make_paged_batch(
        SPECS[kind],
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        seed=block_size + num_heads,
    )
    _assert_matches_oracle(batch)


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
