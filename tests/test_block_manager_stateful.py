"""Random interleavings of every BlockManager operation, checked after each step.

Besides ``BlockManager.check_invariants()``, a fake runner keeps the token each
KV slot holds (device and CPU), applies ``BlockCopy`` and swap instructions the
way the real runner must, and checks that every live sequence reads back
exactly its own tokens through its block table. That catches a wrong prefix
hit, a missing copy-on-write or a lost swap as a content mismatch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.errors import BlockManagerError
from pagedllm.kv import prefix_cache
from pagedllm.kv.block_manager import BlockCopy, BlockManager

BS = 8
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 8
# Prompts start with a prefix of one of these, so prefix-cache hits are common.
BASES = [list(range(100 * k, 100 * k + 3 * BS)) for k in range(3)]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BS, num_cpu_blocks=NUM_CPU_BLOCKS, watermark=0.0625)
        self.tokens: dict[int, list[int]] = {}  # seq id -> token at each slot position
        self.family: dict[int, int] = {}  # seq id -> id of the sequence it was forked from first
        self.device_kv: dict[int, int] = {}  # device slot -> token written there
        self.cpu_kv: dict[int, int] = {}  # CPU slot -> token
        self.next_seq_id = 0

    # -- helpers ---------------------------------------------------------------------

    def device_ids(self) -> list[int]:
        return sorted(s for s in self.tokens if not self.manager.is_swapped(s))

    def swapped_ids(self) -> list[int]:
        return sorted(s for s in self.tokens if self.manager.is_swapped(s))

    def write(self, seq_id: int, start: int) -> None:
        """The fake forward pass: store tokens[start:] into their slots."""
        for position in range(start, len(self.tokens[seq_id])):
            self.device_kv[self.manager.slot_of(seq_id, position)] = self.tokens[seq_id][position]

    def copy_block(self, src_kv: dict, src: int, dst_kv: dict, dst: int) -> None:
        for offset in range(BS):
            value = src_kv.get(src * BS + offset)
            dst_kv.pop(dst * BS + offset, None)
            if value is not None:
                dst_kv[dst * BS + offset] = value

    def apply_tier_ops(self) -> None:
        """Tier copies the manager queued (none without tiers); the tiered machine applies them."""
        assert self.manager.take_tier_ops() == []

    def new_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    # -- rules -----------------------------------------------------------------------

    @rule(
        base=st.sampled_from(range(len(BASES))),
        num_prefix=st.one_of(st.sampled_from([BS, 2 * BS, 3 * BS]), st.integers(0, 3 * BS)),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from([None, None, "s"]),
        computed=st.booleans(),
    )
    def allocate(self, base, num_prefix, suffix, salt, computed):
        prompt = BASES[base][:num_prefix] + suffix
        if prompt:
            self.manager.prefetch(prompt, salt)  # what the scheduler does when a request arrives
        if not prompt or not self.manager.can_allocate(prompt, salt):
            return
        expected = self.manager.get_num_cached_tokens(prompt, salt)
        seq_id = self.new_id()
        num_cached = self.manager.allocate(seq_id, prompt, salt)
        self.apply_tier_ops()
        assert num_cached == expected
        assert num_cached % BS == 0 and num_cached <= (len(prompt) - 1) // BS * BS
        self.tokens[seq_id] = list(prompt)
        self.family[seq_id] = seq_id
        # Cached positions must already hold this prompt's tokens; the rest are computed now.
        for position in range(num_cached):
            assert self.device_kv[self.manager.slot_of(seq_id, position)] == prompt[position]
        self.write(seq_id, num_cached)
        if computed:
            self.manager.cache_full_blocks(seq_id, prompt, len(prompt))

    @precondition(lambda self: self.device_ids())
    @rule(
        data=st.data(),
        new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=3),
        computed=st.booleans(),
    )
    def append(self, data, new_tokens, computed):
        seq_id = data.draw(st.sampled_from(self.device_ids()))
        if not self.manager.can_append_slots(seq_id, len(new_tokens)):
            return
        start = len(self.tokens[seq_id])
        copies = self.manager.append_slots(seq_id, len(new_tokens))
        self.apply_tier_ops()
        assert all(isinstance(copy, BlockCopy) for copy in copies)
        for copy in copies:
            self.copy_block(self.device_kv, copy.src, self.device_kv, copy.dst)
        self.tokens[seq_id] += new_tokens
        assert self.manager.get_num_slots(seq_id) == len(self.tokens[seq_id])
        self.write(seq_id, start)
        if computed:
            self.manager.cache_full_blocks(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]))

    @precondition(lambda self: self.device_ids())
    @rule(data=st.data())
    def cache_full_blocks(self, data):
        seq_id = data.draw(st.sampled_from(self.device_ids()))
        num_computed = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.manager.cache_full_blocks(seq_id, self.tokens[seq_id], num_computed)

    @precondition(lambda self: self.device_ids())
    @rule(data=st.data())
    def fork(self, data):
        parent_id = data.draw(st.sampled_from(self.device_ids()))
        child_id = self.new_id()
        self.manager.fork(parent_id, child_id)
        self.tokens[child_id] = list(self.tokens[parent_id])
        self.family[child_id] = self.family[parent_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        """Finishing and aborting look the same to the manager, on the device or swapped out."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id], self.family[seq_id]

    @rule(seq_id=st.integers(-3, -1))
    def free_unknown(self, seq_id):
        try:
            self.manager.free(seq_id)
        except BlockManagerError:
            return
        raise AssertionError("freeing an unknown sequence must raise BlockManagerError")

    @precondition(lambda self: self.device_ids())
    @rule(data=st.data())
    def swap_out(self, data):
        root = self.family[data.draw(st.sampled_from(self.device_ids()))]
        group = [s for s in self.device_ids() if self.family[s] == root]
        if not self.manager.can_swap_out(group):
            return
        pairs = self.manager.swap_out(group)
        self.apply_tier_ops()
        assert len({d for d, _ in pairs}) == len(pairs) == len({c for _, c in pairs})
        for device_block, cpu_block in pairs:
            self.copy_block(self.device_kv, device_block, self.cpu_kv, cpu_block)

    @precondition(lambda self: self.swapped_ids())
    @rule(data=st.data())
    def swap_in(self, data):
        root = self.family[data.draw(st.sampled_from(self.swapped_ids()))]
        group = [s for s in self.swapped_ids() if self.family[s] == root]
        if not self.manager.can_swap_in(group):
            return
        pairs = self.manager.swap_in(group)
        self.apply_tier_ops()
        assert len({c for c, _ in pairs}) == len(pairs) == len({d for _, d in pairs})
        for cpu_block, device_block in pairs:
            self.copy_block(self.cpu_kv, cpu_block, self.device_kv, device_block)

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll:  # rare: a reset wipes out the prefix hits the other rules build up
            return
        idle = self.manager.stats().num_used_blocks == 0
        assert self.manager.reset_prefix_cache() == idle

    # -- checks ----------------------------------------------------------------------

    @invariant()
    def manager_is_consistent(self):
        self.manager.check_invariants()
        stats = self.manager.stats()
        assert stats.num_free_blocks + stats.num_used_blocks == NUM_BLOCKS
        assert stats.num_swapped_out_seqs == len(self.swapped_ids())
        assert stats.num_slots_saved_by_sharing >= 0

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id in self.device_ids():
            for position, token in enumerate(self.tokens[seq_id]):
                assert self.device_kv.get(self.manager.slot_of(seq_id, position)) == token, (
                    f"sequence {seq_id} position {position}"
                )
        for seq_id in self.swapped_ids():
            table = self.manager._seqs[seq_id].block_table
            for position, token in enumerate(self.tokens[seq_id]):
                slot = table[position // BS] * BS + position % BS
                assert self.cpu_kv.get(slot) == token, (
                    f"swapped sequence {seq_id} position {position}"
                )

    def teardown(self):
        for seq_id in sorted(self.tokens):
            self.manager.free(seq_id)
        self.manager.check_invariants()
        stats = self.manager.stats()
        assert self.manager.get_num_free_blocks() == NUM_BLOCKS  # truly free + cached
        assert stats.num_used_blocks == 0
        assert stats.num_free_cpu_blocks == NUM_CPU_BLOCKS


class WeakHash:
    """Mixin for a state machine: a hash that collides constantly while it runs, so
    collisions may only cost hits, never serve another prefix's block."""

    def __init__(self) -> None:
        self._real_hash = prefix_cache.hash_block_tokens
        prefix_cache.hash_block_tokens = lambda parent, token_ids, extra: bytes([token_ids[0] % 3])
        super().__init__()

    def teardown(self):
        try:
            super().teardown()
        finally:
            prefix_cache.hash_block_tokens = self._real_hash


class WeakHashBlockManagerMachine(WeakHash, BlockManagerMachine):
    """The same machine with a hash that collides constantly: collisions may only cost hits."""


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _SETTINGS
TestBlockManagerWeakHash = WeakHashBlockManagerMachine.TestCase
TestBlockManagerWeakHash.settings = _SETTINGS
