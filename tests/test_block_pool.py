"""BlockPool: exact free-queue order, reference counting and the hash index."""

from __future__ import annotations

import pytest

from pagedllm.errors import BlockManagerError
from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_cache import BlockContent, hash_block_tokens


def _content(token_ids: tuple[int, ...], parent: bytes | None = None) -> tuple[bytes, BlockContent]:
    return hash_block_tokens(parent, token_ids, ()), BlockContent(parent, token_ids, ())


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(4)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.free_block_ids() == [3]
    assert [pool.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert pool.get_num_free_blocks() == 1
    assert pool.get_num_used_blocks() == 3
    pool.check_invariants()


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(4)
    for _ in range(4):
        pool.allocate()
    pool.free([2, 0])
    pool.free([3])
    assert pool.free_block_ids() == [2, 0, 3]
    assert pool.allocate() == 2
    assert pool.free_block_ids() == [0, 3]
    pool.check_invariants()


def test_shared_block_returns_only_at_zero_references():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.incref(block_id)
    assert pool.blocks[block_id].ref_count == 2
    pool.free([block_id])
    assert pool.blocks[block_id].ref_count == 1
    assert not pool.is_free(block_id)
    pool.free([block_id])
    assert pool.is_free(block_id)
    assert pool.free_block_ids() == [1, 0]
    pool.check_invariants()


def test_free_without_reference_raises():
    pool = BlockPool(2)
    with pytest.raises(BlockManagerError, match="no references"):
        pool.free([0])
    pool.check_invariants()


def test_allocate_from_empty_pool_raises():
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(BlockManagerError, match="no free KV blocks"):
        pool.allocate()
    pool.check_invariants()


def test_cached_block_is_revived_from_the_middle_of_the_free_queue():
    pool = BlockPool(4)
    ids = [pool.allocate() for _ in range(4)]
    block_hash, content = _content((1, 2))
    assert pool.register(2, block_hash, content)
    pool.free(ids)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert pool.get_num_cached_blocks() == 1
    block = pool.lookup(block_hash, content)
    assert block is not None and block.block_id == 2
    pool.incref(2)
    assert pool.free_block_ids() == [0, 1, 3]
    assert pool.blocks[2].ref_count == 1
    assert pool.blocks[2].content.token_ids == (1, 2)
    assert pool.get_num_cached_blocks() == 0
    pool.check_invariants()


def test_reusing_a_cached_block_evicts_its_hash():
    pool = BlockPool(1)
    pool.allocate()
    block_hash, content = _content((7, 8))
    pool.register(0, block_hash, content)
    pool.free([0])
    assert pool.allocate() == 0
    assert pool.blocks[0].block_hash is None
    assert pool.blocks[0].content is None
    assert pool.lookup(block_hash, content) is None
    assert pool.get_num_cached_blocks() == 0
    pool.check_invariants()


def test_index_keeps_one_block_per_hash():
    pool = BlockPool(2)
    pool.allocate()
    pool.allocate()
    block_hash, content = _content((5,))
    assert pool.register(0, block_hash, content)
    assert not pool.register(1, block_hash, content)
    assert pool.blocks[1].block_hash is None
    pool.check_invariants()


def test_lookup_compares_content_not_just_the_hash():
    pool = BlockPool(1)
    pool.allocate()
    block_hash, content = _content((1, 2, 3))
    pool.register(0, block_hash, content)
    other = BlockContent(None, (9, 9, 9), ())
    assert pool.lookup(block_hash, other) is None
    assert pool.lookup(block_hash, content).block_id == 0
    pool.check_invariants()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(1, enable_caching=False)
    pool.allocate()
    block_hash, content = _content((1,))
    assert not pool.register(0, block_hash, content)
    assert pool.blocks[0].block_hash is None
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    pool.allocate()
    block_hash, content = _content((4,))
    pool.register(0, block_hash, content)
    assert not pool.reset_prefix_cache()
    pool.free([0])
    assert pool.get_num_cached_blocks() == 1
    assert pool.reset_prefix_cache()
    assert pool.get_num_cached_blocks() == 0
    assert pool.lookup(block_hash, content) is None
    assert pool.free_block_ids() == [1, 0]
    pool.check_invariants()


def test_check_invariants_catches_a_free_block_with_references():
    pool = BlockPool(2)
    pool.blocks[1].ref_count = 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="free queue with ref_count 1"):
        pool.check_invariants()
