"""KVCache: block copies, swap round trips and the memory arithmetic."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv.block_manager import BlockCopy
from pagedllm.kv.kv_cache import KVCache


def _filled_cache(num_cpu_blocks: int = 0) -> KVCache:
    cache = KVCache(
        num_layers=3,
        num_blocks=6,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
        num_cpu_blocks=num_cpu_blocks,
    )
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return cache


def test_layout():
    cache = _filled_cache(num_cpu_blocks=2)
    assert len(cache.layers) == 3
    for k, v in cache.layers:
        assert k.shape == v.shape == (6, 4, 2, 8)
    for k, v in cache.cpu_layers:
        assert k.shape == v.shape == (2, 4, 2, 8)
        assert k.device.type == "cpu"


def test_copy_blocks_copies_every_layer_and_leaves_others():
    cache = _filled_cache()
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    # block 1 is both read (-> 4) and written (from 0): sources are read first
    cache.copy_blocks([BlockCopy(1, 4), BlockCopy(0, 1), (2, 5)])  # named or plain pairs
    for (k, v), (k0, v0) in zip(cache.layers, before, strict=True):
        assert torch.equal(k[4], k0[1]) and torch.equal(v[4], v0[1])
        assert torch.equal(k[1], k0[0]) and torch.equal(v[1], v0[0])
        assert torch.equal(k[5], k0[2]) and torch.equal(v[5], v0[2])
        for untouched in (0, 2, 3):
            assert torch.equal(k[untouched], k0[untouched])
            assert torch.equal(v[untouched], v0[untouched])


def test_copy_blocks_empty_is_noop():
    cache = _filled_cache()
    before = cache.layers[0][0].clone()
    cache.copy_blocks([])
    assert torch.equal(cache.layers[0][0], before)


def test_swap_out_then_in_round_trips():
    cache = _filled_cache(num_cpu_blocks=3)
    original = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.swap_out([(5, 0), (2, 2)])
    for (k_cpu, v_cpu), (k0, v0) in zip(cache.cpu_layers, original, strict=True):
        assert torch.equal(k_cpu[0], k0[5]) and torch.equal(v_cpu[0], v0[5])
        assert torch.equal(k_cpu[2], k0[2]) and torch.equal(v_cpu[2], v0[2])
    for k, v in cache.layers:  # the device blocks get reused by someone else
        k.zero_()
        v.zero_()
    cache.swap_in([(0, 1), (2, 3)])
    for (k, v), (k0, v0) in zip(cache.layers, original, strict=True):
        assert torch.equal(k[1], k0[5]) and torch.equal(v[1], v0[5])
        assert torch.equal(k[3], k0[2]) and torch.equal(v[3], v0[2])
        assert not k[0].any() and not k[4].any()


def test_swap_without_cpu_pool_raises():
    cache = _filled_cache()
    with pytest.raises(RuntimeError):
        cache.swap_out([(0, 0)])


def test_bytes_and_num_blocks_for_memory():
    kw = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    per_block = KVCache.bytes_per_block(**kw)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert KVCache.bytes_per_block(**{**kw, "dtype": torch.bfloat16}) == per_block // 2
    assert KVCache.num_blocks_for_memory(per_block * 10, **kw) == 10
    assert KVCache.num_blocks_for_memory(per_block * 10 + per_block - 1, **kw) == 10
    assert KVCache.num_blocks_for_memory(per_block - 1, **kw) == 0
    assert KVCache.num_blocks_for_memory(-5, **kw) == 0
