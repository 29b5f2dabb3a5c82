"""BlockManager: exact block ids, ref counts and free-queue order for every operation.

Every test ends with ``check_invariants()``. Block size 8 throughout unless stated.
"""

from __future__ import annotations

import math

import pytest

from pagedllm.errors import BlockManagerError, ConfigError
from pagedllm.kv import prefix_cache
from pagedllm.kv.block_manager import BlockCopy, BlockManager

BS = 8


def tokens(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


def refs(manager: BlockManager, *block_ids: int) -> list[int]:
    return [manager._pool.blocks[b].ref_count for b in block_ids]


def free_queue(manager: BlockManager) -> list[int]:
    return manager._pool.free_block_ids()


def make(num_blocks: int = 10, **kwargs) -> BlockManager:
    kwargs.setdefault("watermark", 0.0)
    return BlockManager(num_blocks, BS, **kwargs)


# -- configuration and misuse -------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, 4, 12, 64])
def test_unsupported_block_size_is_a_config_error(block_size):
    with pytest.raises(ConfigError, match="block_size"):
        BlockManager(10, block_size)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_non_positive_num_blocks_is_a_config_error(num_blocks):
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockManager(num_blocks, 16)


def test_double_free_raises():
    manager = make()
    manager.allocate(0, tokens(5))
    manager.free(0)
    with pytest.raises(BlockManagerError, match="sequence 0"):
        manager.free(0)
    with pytest.raises(BlockManagerError):
        manager.free(42)
    manager.check_invariants()


def test_misuse_of_freed_or_existing_sequences_raises():
    manager = make()
    manager.allocate(0, tokens(5))
    manager.allocate(1, tokens(5, 100))
    with pytest.raises(BlockManagerError, match="already"):
        manager.allocate(0, tokens(3))
    with pytest.raises(BlockManagerError, match="already exists"):
        manager.fork(0, 1)
    manager.free(1)
    with pytest.raises(BlockManagerError):
        manager.append_slots(1)
    with pytest.raises(BlockManagerError):
        manager.get_block_table(1)
    with pytest.raises(BlockManagerError):
        manager.fork(1, 2)
    with pytest.raises(BlockManagerError, match="position"):
        manager.slot_of(0, 5)
    assert not manager.has_seq(1) and manager.has_seq(0)
    manager.check_invariants()


def test_running_out_is_answered_by_predicates():
    manager = make(num_blocks=2)
    assert manager.can_allocate(tokens(16))
    assert not manager.can_allocate(tokens(17))
    with pytest.raises(BlockManagerError, match="can_allocate"):
        manager.allocate(0, tokens(17))
    assert not manager.has_seq(0)
    manager.allocate(0, tokens(16))
    assert not manager.can_append_slots(0)
    with pytest.raises(BlockManagerError, match="can_append_slots"):
        manager.append_slots(0)
    assert manager.get_block_table(0) == [0, 1]
    manager.check_invariants()


# -- allocation and growth ------------------------------------------------------------


def test_allocate_covers_every_prompt_slot():
    manager = make()
    assert manager.allocate(0, tokens(20)) == 0
    assert manager.get_block_table(0) == [0, 1, 2]
    assert manager.get_num_slots(0) == 20
    assert refs(manager, 0, 1, 2) == [1, 1, 1]
    assert free_queue(manager) == [3, 4, 5, 6, 7, 8, 9]
    assert manager.slot_of(0, 17) == 2 * BS + 1
    assert manager.get_num_free_blocks() == 7
    manager.check_invariants()


def test_append_across_a_block_boundary():
    manager = make()
    manager.allocate(0, tokens(15))
    assert manager.append_slots(0) == []
    assert manager.get_block_table(0) == [0, 1]
    assert manager.append_slots(0) == []  # position 16 starts block index 2
    assert manager.get_block_table(0) == [0, 1, 2]
    assert manager.slot_of(0, 16) == 2 * BS
    assert manager.append_slots(0, 10) == []  # positions 17..26
    assert manager.get_block_table(0) == [0, 1, 2, 3]
    assert manager.get_num_slots(0) == 27
    assert free_queue(manager) == [4, 5, 6, 7, 8, 9]
    manager.check_invariants()


def test_watermark_is_kept_free_on_admission():
    manager = BlockManager(100, BS, watermark=0.05)
    assert manager.watermark_blocks == 5
    assert manager.can_allocate(tokens(95 * BS))
    assert not manager.can_allocate(tokens(95 * BS + 1))
    manager.check_invariants()


def test_headroom_blocks_stay_free_on_admission_with_the_watermark():
    manager = BlockManager(100, BS, watermark=0.05)
    manager.allocate(0, tokens(10 * BS))
    assert manager.get_num_blocks(0) == 10
    # 90 free: 80 for the prompt + 5 headroom + 5 watermark fits, one block more does not
    assert manager.can_allocate(tokens(80 * BS, 1000), num_headroom_blocks=5)
    assert not manager.can_allocate(tokens(80 * BS + 1, 1000), num_headroom_blocks=5)
    assert not manager.can_allocate(tokens(80 * BS, 1000), num_headroom_blocks=6)
    manager.append_slots(0, 1)  # a table grows one block at a time
    assert manager.get_num_blocks(0) == 11
    manager.check_invariants()


# -- fork and copy-on-write -------------------------------------------------------------


def test_fork_shares_every_block():
    manager = make()
    manager.allocate(0, tokens(11))
    manager.fork(0, 1)
    assert manager.get_block_table(1) == [0, 1]
    assert manager.get_num_slots(1) == 11
    assert refs(manager, 0, 1) == [2, 2]
    assert free_queue(manager) == [2, 3, 4, 5, 6, 7, 8, 9]
    manager.check_invariants()


def test_append_to_a_forked_branch_copies_only_the_partial_block():
    num_prompt, num_appended = 11, 7
    manager = make()
    manager.allocate(0, tokens(num_prompt))
    manager.fork(0, 1)
    copies = manager.append_slots(1, num_appended)
    num_new = math.ceil((num_prompt + num_appended) / BS) - num_prompt // BS
    assert num_new == 2
    assert copies == [BlockCopy(src=1, dst=2)]
    assert manager.get_block_table(1) == [0, 2, 3]  # the copy, then the growth block
    assert manager.get_block_table(0) == [0, 1]
    assert refs(manager, 0, 1, 2, 3) == [2, 1, 1, 1]
    # The other branch now owns block 1 alone and writes in place.
    assert manager.append_slots(0) == []
    assert manager.get_block_table(0) == [0, 1]
    manager.check_invariants()
    manager.free(0)
    assert refs(manager, 0, 1, 2, 3) == [1, 0, 1, 1]
    assert free_queue(manager) == [4, 5, 6, 7, 8, 9, 1]
    assert all(not manager._pool.is_free(b) for b in manager.get_block_table(1))
    manager.check_invariants()


def test_one_slot_appends_write_in_place_only_into_private_blocks():
    manager = make()
    manager.allocate(0, tokens(BS), num_reserved_tokens=3 * BS)  # block 1 reserved, empty
    manager.fork(0, 1)
    manager.reset_peak_stats()
    # Position 8 lands in block 1, which both hold: replaced, nothing to copy.
    assert manager.can_append_slots(1)
    assert manager.append_slots(1) == []
    assert manager.get_block_table(1) == [0, 3, 2]
    assert refs(manager, 0, 1, 2, 3) == [2, 1, 2, 1]
    # Now each owns its block 1 alone and fills it in place, one slot at a time.
    for _ in range(BS - 1):
        assert manager.append_slots(1) == []
        assert manager.append_slots(0) == []
    assert manager.append_slots(0) == []
    assert manager.get_block_table(0) == [0, 1, 2]
    assert manager.get_block_table(1) == [0, 3, 2]
    assert (manager.get_num_slots(0), manager.get_num_slots(1)) == (2 * BS, 2 * BS)
    assert refs(manager, 0, 1, 2, 3) == [2, 1, 2, 1]
    assert free_queue(manager) == [4, 5, 6, 7, 8, 9]
    assert manager.stats().peak_used_blocks == 4
    # Block 2 is still shared, so sequence 1's next slots replace it (nothing to copy).
    assert manager.append_slots(1, 2) == []
    assert manager.get_block_table(1) == [0, 3, 4]
    assert refs(manager, 0, 1, 2, 3, 4) == [2, 1, 1, 1, 1]
    manager.check_invariants()


def test_append_slot_in_place_only_where_no_block_changes():
    manager = make(num_cpu_blocks=4)
    manager.allocate(0, tokens(BS - 2))
    manager.allocate(1, tokens(3, 100))
    # The next position of a private, partial last block: taken, the table comes back.
    assert manager.append_slot_in_place(0, BS - 2) == [0]
    assert manager.get_num_slots(0) == BS - 1
    assert manager.append_slot_in_place(0, BS - 2) is None  # not the next position any more
    assert manager.append_slot_in_place(0, BS) is None
    assert manager.append_slot_in_place(0, BS - 1) == [0]  # the block's last slot
    # Position 8 needs a new block: refused, nothing changed.
    assert manager.append_slot_in_place(0, BS) is None
    assert (manager.get_block_table(0), manager.get_num_slots(0)) == ([0], BS)
    # A shared last block needs a copy-on-write: refused for both owners.
    manager.fork(1, 2)
    assert manager.append_slot_in_place(1, 3) is None
    assert manager.append_slot_in_place(2, 3) is None
    assert (manager.get_num_slots(1), manager.get_num_slots(2)) == (3, 3)
    assert refs(manager, 0, 1) == [1, 2]
    assert free_queue(manager) == [2, 3, 4, 5, 6, 7, 8, 9]
    manager.swap_out([0])
    with pytest.raises(BlockManagerError, match="swapped out"):
        manager.append_slot_in_place(0, BS)
    with pytest.raises(BlockManagerError, match="has no blocks"):
        manager.append_slot_in_place(7, 0)
    manager.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    manager = make()
    manager.allocate(0, tokens(16))
    manager.fork(0, 1)
    assert manager.append_slots(1) == []
    assert manager.get_block_table(1) == [0, 1, 2]
    assert refs(manager, 0, 1, 2) == [2, 2, 1]
    manager.check_invariants()


# -- prefix caching ------------------------------------------------------------------------


def test_identical_prompt_hits_but_never_the_last_token():
    manager = make()
    prompt = tokens(2 * BS)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, num_computed_tokens=len(prompt))
    assert manager.get_num_cached_tokens(prompt) == BS
    assert manager.allocate(1, prompt) == BS
    assert manager.get_block_table(1) == [0, 2]
    assert refs(manager, 0, 1, 2) == [2, 1, 1]
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * BS, BS)
    manager.check_invariants()


def test_longer_prompt_shares_two_full_blocks():
    manager = make()
    prompt = tokens(20)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 20)
    assert manager.allocate(1, prompt) == 16
    assert manager.get_block_table(1) == [0, 1, 3]
    assert refs(manager, 0, 1, 2, 3) == [2, 2, 1, 1]
    assert manager.stats().num_shared_blocks == 2
    manager.check_invariants()


def test_cache_full_blocks_only_registers_computed_full_blocks():
    manager = make()
    prompt = tokens(20)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, num_computed_tokens=10)
    assert manager.get_num_cached_tokens(prompt) == BS
    manager.cache_full_blocks(0, prompt, num_computed_tokens=10)  # idempotent
    manager.cache_full_blocks(0, prompt, num_computed_tokens=20)
    assert manager.get_num_cached_tokens(prompt) == 2 * BS
    assert manager._pool.blocks[2].block_hash is None
    manager.check_invariants()


def test_generated_tokens_become_cacheable():
    manager = make()
    seq = tokens(12)
    manager.allocate(0, seq)
    manager.cache_full_blocks(0, seq, 12)
    for step in range(6):
        manager.append_slots(0)
        seq.append(1000 + step)
        manager.cache_full_blocks(0, seq, len(seq))
    assert manager.get_num_cached_tokens(seq + [7]) == 2 * BS
    manager.check_invariants()


def test_get_num_cached_tokens_has_no_side_effects():
    manager = make()
    prompt = tokens(17)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 17)
    manager.free(0)
    before = (free_queue(manager), manager.stats())
    assert manager.get_num_cached_tokens(prompt) == 2 * BS
    assert manager.can_allocate(prompt)
    assert (free_queue(manager), manager.stats()) == before
    manager.check_invariants()


def test_eviction_takes_the_lru_chain_tail_first():
    manager = make(num_blocks=6)
    prompt = tokens(3 * BS)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, len(prompt))
    manager.free(0)
    assert free_queue(manager) == [3, 4, 5, 2, 1, 0]
    assert manager.stats().num_cached_blocks == 3
    assert manager.allocate(1, tokens(3 * BS, 500)) == 0
    assert manager.get_block_table(1) == [3, 4, 5]
    manager.allocate(2, tokens(BS, 900))
    assert manager.get_block_table(2) == [2]  # the chain's tail goes first
    assert manager._pool.blocks[2].block_hash is None
    assert manager.get_num_cached_tokens(prompt) == 2 * BS
    assert manager.stats().num_cached_blocks == 2
    manager.check_invariants()


def test_freed_cached_chain_is_revived_from_the_middle_of_the_free_queue():
    manager = make(num_blocks=8)
    prompt = tokens(3 * BS)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, len(prompt))
    manager.allocate(1, tokens(2 * BS, 500))
    manager.free(0)
    manager.free(1)
    assert free_queue(manager) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert manager.allocate(2, prompt + [99]) == 3 * BS
    assert manager.get_block_table(2) == [0, 1, 2, 5]
    assert free_queue(manager) == [6, 7, 4, 3]
    assert refs(manager, 0, 1, 2, 5) == [1, 1, 1, 1]
    assert manager.stats().num_cached_blocks == 0
    manager.check_invariants()


def test_can_allocate_counts_revived_blocks_as_consumed():
    manager = make(num_blocks=4)
    prompt = tokens(3 * BS)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, len(prompt))
    manager.free(0)
    assert manager.get_num_free_blocks() == 4
    assert manager.can_allocate(prompt + tokens(BS, 100))  # 3 revived + 1 fresh
    assert not manager.can_allocate(prompt + tokens(2 * BS, 100))  # 3 revived + 2 fresh
    manager.check_invariants()


def test_cache_salt_separates_equal_prompts():
    manager = make()
    prompt = tokens(17)
    manager.allocate(0, prompt, cache_salt="alice")
    manager.cache_full_blocks(0, prompt, 17)
    assert manager.get_num_cached_tokens(prompt) == 0
    assert manager.get_num_cached_tokens(prompt, cache_salt="bob") == 0
    assert manager.get_num_cached_tokens(prompt, cache_salt="alice") == 2 * BS
    assert manager.allocate(1, prompt, cache_salt="bob") == 0
    assert manager.allocate(2, prompt, cache_salt="alice") == 2 * BS
    assert manager.get_block_table(2)[:2] == manager.get_block_table(0)[:2]
    manager.check_invariants()


def test_forced_hash_collision_never_returns_another_prompts_blocks(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, token_ids, extra: b"same")
    manager = make()
    prompt = tokens(17)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 17)
    # Only one block can own the colliding hash; the second stays unhashed.
    assert manager._pool.blocks[0].block_hash == b"same"
    assert manager._pool.blocks[1].block_hash is None
    assert manager.get_num_cached_tokens(tokens(17, 100)) == 0
    assert manager.allocate(1, tokens(17, 100)) == 0
    assert manager.get_block_table(1) == [3, 4, 5]
    # Same first block, different second block under the same (fake) hash: one block only.
    assert manager.allocate(2, prompt[:BS] + tokens(9, 200)) == BS
    assert manager.get_block_table(2)[0] == 0
    manager.check_invariants()


def test_prefix_caching_off_shares_nothing():
    manager = make(enable_prefix_caching=False)
    prompt = tokens(17)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 17)
    assert manager.get_num_cached_tokens(prompt) == 0
    assert manager.allocate(1, prompt) == 0
    assert manager.get_block_table(1) == [3, 4, 5]
    assert all(block.block_hash is None for block in manager._pool.blocks)
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    manager.check_invariants()


def test_reset_prefix_cache():
    manager = make()
    prompt = tokens(17)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 17)
    assert not manager.reset_prefix_cache()
    manager.free(0)
    assert manager.reset_prefix_cache()
    assert manager.get_num_cached_tokens(prompt) == 0
    assert manager.stats().num_cached_blocks == 0
    manager.check_invariants()


# -- reservation (contiguous baselines) --------------------------------------------------


def test_reserved_tokens_allocate_up_front():
    manager = make()
    assert not manager.can_allocate(tokens(10), num_reserved_tokens=11 * BS)
    manager.allocate(0, tokens(10), num_reserved_tokens=4 * BS)
    assert manager.get_block_table(0) == [0, 1, 2, 3]
    assert manager.get_num_slots(0) == 10
    assert manager.stats().slot_utilization == pytest.approx(10 / 32)
    assert manager.append_slots(0, 4 * BS - 10) == []
    assert manager.get_block_table(0) == [0, 1, 2, 3]
    manager.append_slots(0)
    assert manager.get_block_table(0) == [0, 1, 2, 3, 4]
    with pytest.raises(BlockManagerError, match="num_reserved_tokens"):
        manager.allocate(1, tokens(10), num_reserved_tokens=9)
    manager.check_invariants()


def test_fork_inside_a_reservation_copies_only_blocks_holding_tokens():
    manager = make()
    manager.allocate(0, tokens(10), num_reserved_tokens=4 * BS)
    manager.fork(0, 1)
    copies = manager.append_slots(1, 10)  # positions 10..19 touch blocks 1 and 2
    assert copies == [BlockCopy(src=1, dst=4)]
    assert manager.get_block_table(1) == [0, 4, 5, 3]
    assert refs(manager, 0, 1, 2, 3, 4, 5) == [2, 1, 1, 2, 1, 1]
    manager.check_invariants()


# -- swapping ------------------------------------------------------------------------------


def test_swap_round_trip_of_a_forked_group():
    manager = make(num_blocks=8, num_cpu_blocks=4)
    manager.allocate(0, tokens(12))
    manager.fork(0, 1)
    manager.fork(0, 2)
    assert manager.append_slots(1) == [BlockCopy(src=1, dst=2)]
    group = [0, 1, 2]
    assert manager.can_swap_out(group)
    assert manager.swap_out(group) == [(0, 0), (1, 1), (2, 2)]
    assert all(manager.is_swapped(s) for s in group)
    assert [manager.get_num_slots(s) for s in group] == [12, 13, 12]
    assert free_queue(manager) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert [manager._cpu_pool.blocks[b].ref_count for b in range(4)] == [3, 2, 1, 0]
    with pytest.raises(BlockManagerError, match="swapped out"):
        manager.get_block_table(0)
    manager.cache_full_blocks(0, tokens(12), 12)  # no device blocks to publish: a no-op
    stats = manager.stats()
    assert (stats.num_swapped_out_seqs, stats.num_free_cpu_blocks, stats.num_used_blocks) == (
        3,
        1,
        0,
    )
    manager.check_invariants()

    assert manager.can_swap_in(group)
    assert manager.swap_in(group) == [(0, 3), (1, 4), (2, 5)]
    assert [manager.get_block_table(s) for s in group] == [[3, 4], [3, 5], [3, 4]]
    assert refs(manager, 3, 4, 5) == [3, 2, 1]
    assert free_queue(manager) == [6, 7, 2, 1, 0]
    assert manager.stats().num_free_cpu_blocks == 4
    assert manager.append_slots(2) == [BlockCopy(src=4, dst=6)]  # sharing survived
    manager.check_invariants()


def test_swap_needs_room():
    manager = make(num_blocks=4, num_cpu_blocks=1)
    manager.allocate(0, tokens(9))
    assert not manager.can_swap_out([0])
    with pytest.raises(BlockManagerError, match="can_swap_out"):
        manager.swap_out([0])
    manager.allocate(1, tokens(3, 50))
    manager.swap_out([1])
    with pytest.raises(BlockManagerError, match="already swapped out"):
        manager.swap_out([1])
    manager.allocate(2, tokens(2 * BS, 70))
    assert not manager.can_swap_in([1])
    manager.free(1)  # freeing a swapped-out sequence returns its CPU blocks
    assert manager.stats().num_free_cpu_blocks == 1
    manager.check_invariants()


def test_swapped_in_blocks_are_registered_again():
    manager = make(num_blocks=6, num_cpu_blocks=4)
    prompt = tokens(17)
    manager.allocate(0, prompt)
    manager.cache_full_blocks(0, prompt, 17)
    manager.swap_out([0])
    manager.reset_prefix_cache()  # nothing on the device is in use
    manager.swap_in([0])
    assert manager.get_num_cached_tokens(prompt) == 0
    manager.cache_full_blocks(0, prompt, 17)
    assert manager.get_num_cached_tokens(prompt) == 2 * BS
    manager.check_invariants()


# -- statistics ----------------------------------------------------------------------------


def test_stats_count_sharing_and_peaks():
    manager = make(num_blocks=10)
    manager.allocate(0, tokens(20))
    manager.fork(0, 1)
    manager.fork(0, 2)
    assert manager.append_slots(1) == [BlockCopy(src=2, dst=3)]
    manager.record_preemption()
    stats = manager.stats()
    assert stats.num_used_blocks == 4
    assert stats.num_free_blocks == 6
    assert stats.num_shared_blocks == 3  # blocks 0, 1 (ref 3) and 2 (ref 2)
    assert stats.num_allocated_slots == 32
    assert stats.num_slots_holding_tokens == 8 + 8 + 4 + 5
    assert stats.num_slots_saved_by_sharing == (20 + 21 + 20) - 25
    assert stats.peak_blocks_without_sharing == 9
    assert stats.peak_used_blocks == 4
    assert stats.usage == pytest.approx(0.4)
    assert stats.slot_utilization == pytest.approx(25 / 32)
    assert stats.num_preemptions == 1
    for seq_id in (0, 1, 2):
        manager.free(seq_id)
    stats = manager.stats()
    assert (stats.num_used_blocks, stats.peak_used_blocks, stats.peak_blocks_without_sharing) == (
        0,
        4,
        9,
    )
    assert stats.slot_utilization == 1.0
    manager.check_invariants()


def test_check_invariants_catches_a_wrong_ref_count():
    manager = make()
    manager.allocate(0, tokens(5))
    manager._pool.blocks[0].ref_count = 2  # corrupt on purpose
    with pytest.raises(AssertionError, match="ref_count 2 but 1 table entries"):
        manager.check_invariants()


def test_can_append_group_copies_only_blocks_still_shared():
    manager = BlockManager(4, 8, enable_prefix_caching=False, watermark=0.0)
    manager.allocate(0, list(range(1, 13)))  # blocks 0, 1 (1 partial: 4 of 8 slots)
    manager.fork(0, 1)  # both at ref 2
    assert manager.can_append_group({0: 1, 1: 1})  # a copy of block 1 each, at most: 2 free
    manager.append_slots(0, 1)  # 0 copies block 1 on write
    manager.allocate(2, [9])  # the last free block
    assert manager.get_num_free_blocks() == 0
    # each partial block has one holder now: both grow in place, no free block needed
    assert manager.can_append_group({0: 1, 1: 1})
    assert not manager.can_append_group({0: 4, 1: 1})  # 0's fourth new slot starts a block
    assert manager.can_append_group({})
    manager.check_invariants()
