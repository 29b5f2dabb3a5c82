"""The block-manager state machine with the host and disk tiers of the prefix cache on.

The fake runner of test_block_manager_stateful also applies the tier moves:
an evicted block's tokens are copied to the host pool or handed to the disk
tier (real files: one int64 tensor of the block's tokens per file), and tier
hits are copied back. Extra steps restart the manager on the same directory
(the disk index is rebuilt from the files), corrupt or swap files, and put
the device under pressure so cached blocks are evicted. After every step the
invariants of every tier hold and every sequence reads back its own tokens,
so a block served with another prefix's KV fails the run; the weak-hash
variant makes hash collisions constant.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_block_manager_stateful import (
    _SETTINGS,
    BS,
    NUM_BLOCKS,
    NUM_CPU_BLOCKS,
    BlockManagerMachine,
    WeakHash,
)

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.tiers import SUFFIX, DiskTier, tier_key
from pagedllm.step import MemoryOpKind

LAYOUT = [((BS,), torch.int64)]  # one "KV tensor": the token ids of the block's slots, -1 for empty
KEY = tier_key(model_identity="fake", dtype="int64", layout=LAYOUT, block_size=BS, tp_rank=0, tp_size=1)
DISK_CAPACITY = 24 * 250  # bytes: room for about two dozen block files, so the disk LRU evicts too
EMPTY = -1


class TieredMachine(BlockManagerMachine):
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pagedllm-tiers-"))
        super().__init__()
        self.manager = self.new_manager()
        self.num_restarts = 0

    def new_manager(self) -> BlockManager:
        self.disk = DiskTier(self.root, KEY, LAYOUT, DISK_CAPACITY, threaded=False)
        return BlockManager(
            NUM_BLOCKS, BS, num_cpu_blocks=NUM_CPU_BLOCKS, watermark=0.0625,
            enable_host_tier=True, disk_tier=self.disk, block_nbytes=BS * 8,
        )

    # -- the fake runner's tier moves ------------------------------------------------

    def apply_tier_ops(self, ops=None) -> None:
        for op in self.manager.take_tier_ops() if ops is None else ops:
            for src, dst in op.pairs:
                if op.kind is MemoryOpKind.HOST_TIER_OUT:
                    self.copy_block(self.device_kv, src, self.cpu_kv, dst)
                elif op.kind is MemoryOpKind.HOST_TIER_IN:
                    self.copy_block(self.cpu_kv, src, self.device_kv, dst)
                elif op.kind in (MemoryOpKind.DISK_TIER_OUT, MemoryOpKind.HOST_TIER_TO_DISK):
                    kv = self.device_kv if op.kind is MemoryOpKind.DISK_TIER_OUT else self.cpu_kv
                    tokens = [kv.get(src * BS + o, EMPTY) for o in range(BS)]
                    self.disk.submit_write(dst, torch.tensor(tokens, dtype=torch.int64).view(torch.uint8))
                elif op.kind is MemoryOpKind.DISK_TIER_IN:
                    tokens = self.disk.take_claimed(src).view(torch.int64)
                    for offset, token in enumerate(tokens.tolist()):
                        self.device_kv.pop(dst * BS + offset, None)
                        if token != EMPTY:
                            self.device_kv[dst * BS + offset] = token
                else:
                    raise AssertionError(f"unexpected tier op {op.kind}")

    # -- tier steps ------------------------------------------------------------------

    @rule(first=st.integers(1000, 1003), num_blocks=st.integers(4, NUM_BLOCKS - 1))
    def evict_to_tiers(self, first, num_blocks):
        """A long prompt of fresh tokens takes much of the device pool, evicting cached blocks."""
        prompt = list(range(first * 100, first * 100 + num_blocks * BS))
        if not self.manager.can_allocate(prompt):
            return
        seq_id = self.new_id()
        self.manager.allocate(seq_id, prompt)
        self.apply_tier_ops()
        self.tokens[seq_id] = prompt
        self.family[seq_id] = seq_id
        self.write(seq_id, 0)
        self.manager.cache_full_blocks(seq_id, prompt, len(prompt))
        self.manager.free(seq_id)
        del self.tokens[seq_id], self.family[seq_id]

    @rule(clean=st.booleans())
    def restart(self, clean):
        """The engine goes away (device and host tiers with it); a new one reindexes the directory.

        A clean shutdown first saves the cached blocks the disk lacks; a crash does not.
        """
        if clean:
            self.apply_tier_ops(self.manager.flush_to_disk())
        for seq_id in sorted(self.tokens):
            self.manager.free(seq_id)
        self.tokens.clear()
        self.family.clear()
        self.device_kv.clear()
        self.cpu_kv.clear()
        before = {p.name for p in self.root.rglob("*" + SUFFIX)}
        self.disk.close()
        self.manager = self.new_manager()
        assert {p.name for p in self.root.rglob("*" + SUFFIX)} <= before
        self.num_restarts += 1

    @precondition(lambda self: any(self.root.rglob("*" + SUFFIX)))
    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip", "swap", "garbage"]))
    def corrupt_file(self, data, how):
        files = sorted(self.root.rglob("*" + SUFFIX))
        path = data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if not raw:
            return  # already truncated to nothing
        if how == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif how == "flip":
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0xFF
        elif how == "swap":  # a sound file of another block under this block's name
            others = [f for f in files if f != path]
            if not others:
                return
            raw = bytearray(data.draw(st.sampled_from(others)).read_bytes())
        else:
            raw = bytearray(b"not a block file")
        path.write_bytes(bytes(raw))


class WeakHashTieredMachine(WeakHash, TieredMachine):
    """Constant collisions: every tier may only miss, never serve another prefix's block."""


def _teardown(self):
    try:
        BlockManagerMachine.teardown(self)
        self.disk.close()
    finally:
        shutil.rmtree(self.root, ignore_errors=True)


TieredMachine.teardown = _teardown

TestTieredBlockManager = TieredMachine.TestCase
TestTieredBlockManager.settings = _SETTINGS
TestTieredBlockManagerWeakHash = WeakHashTieredMachine.TestCase
TestTieredBlockManagerWeakHash.settings = _SETTINGS
