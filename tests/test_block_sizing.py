"""BlockManager's sizing arithmetic against the blocks its own allocate/fork/append really take."""

from __future__ import annotations

import pytest

from pagedllm.kv.block_manager import BlockManager


def _blocks_taken(bm: BlockManager, prompt_len: int, num_slots: list[int]) -> int:
    """Admit a group the way the scheduler does: the first sequence allocates its prompt,
    the others fork its full prompt blocks, then each grows to its slot count."""
    free_before = bm.get_num_free_blocks()
    prompt = list(range(1, prompt_len + 1))
    bm.allocate(0, prompt, reuse_cached_prefix=False)
    bm.append_slots(0, num_slots[0] - prompt_len)
    shared = bm.full_block_slots(prompt_len)
    assert shared % bm.block_size == 0 and prompt_len - bm.block_size < shared <= prompt_len
    for seq_id, n in enumerate(num_slots[1:], start=1):
        bm.fork(0, seq_id, num_tokens=shared)
        bm.append_slots(seq_id, n - shared)
    taken = free_before - bm.get_num_free_blocks()
    for seq_id in range(len(num_slots)):
        bm.free(seq_id)
    return taken


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("prompt_len, num_slots", [
    (5, [5]), (16, [40]), (16, [16, 16]), (17, [17, 30, 64]), (3, [3, 9]), (32, [33, 32, 47, 48]), (40, [41, 70]),
])
def test_group_count_matches_what_allocation_takes(block_size, prompt_len, num_slots):
    bm = BlockManager(256, block_size, enable_prefix_caching=False, watermark=0.0)
    want = _blocks_taken(bm, prompt_len, num_slots)
    assert bm.num_blocks_for_group(num_slots, num_shared_slots=prompt_len) == want
    bm.check_invariants()


def test_one_sequence_shares_nothing_and_growth_is_never_negative():
    bm = BlockManager(8, 16)
    assert bm.num_blocks_for_group([33], num_shared_slots=32) == 3
    assert bm.num_blocks_for_group([]) == 0
    assert bm.num_growth_blocks(33, 2) == 1
    assert bm.num_growth_blocks(32, 2) == 0
    assert bm.num_growth_blocks(1, 5) == 0


@pytest.mark.slow
def test_engine_refuses_a_request_one_block_over_the_cache():
    """The engine's up-front check counts blocks as the manager does: 10 of 10 fit, 13 are refused."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import RequestError

    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=10, block_size=16)
    engine = llm.llm_engine
    prompt = list(range(100, 120))  # 20 tokens: one shared full block
    # 20 + 44 = 64 slots (4 blocks) each: n=3 needs 1 shared + 3 x 3 = 10 blocks, n=4 needs 13
    engine.add_request("fits", prompt, SamplingParams(n=3, max_tokens=44, ignore_eos=True))
    with pytest.raises(RequestError, match="need 13 KV blocks") as info:
        engine.add_request("over", prompt, SamplingParams(n=4, max_tokens=44, ignore_eos=True))
    assert info.value.param == "n"
    engine.abort_request("fits")
