"""Block tables, sharing (fork, prefix cache), copy-on-write and swapping.

The manager maps each sequence's logical blocks to physical ones and hands the
runner plain instructions (:class:`BlockCopy`, swap pairs); it never touches
tensors. The slot of the token at position ``p`` of a sequence is
``table[p // block_size] * block_size + p % block_size``.

Invariants (checked by :meth:`BlockManager.check_invariants`):

- every device block is either free (ref_count 0) or in use, never both, and
  ``ref_count`` equals the number of table entries pointing at it over all
  sequences on the device; the CPU pool likewise for swapped-out tables;
- a table covers its sequence's slots: ``len(table) * block_size >= num_slots``;
- all sequences referencing a block agree on how many of its slots hold
  tokens: appends into a shared block are copy-on-written first;
- a hashed block holds exactly the full, computed block of tokens its hash
  names, and is never written again;
- tiers: the host tier is the CPU pool's hashed free blocks (swapped-out
  blocks are in use there, so swap takes host-tier blocks LRU first); the
  disk tier's index matches its files (:meth:`DiskTier.check_invariants`).

Tiered prefix cache: when allocation reuses a cached device block, its KV is
queued for copying to the host tier and the disk tier (``take_tier_ops``,
drained by the scheduler before any op decided after); a prefix lookup walks
device, host, then disk (loaded blocks only), and a hit below the device gets
a fresh device block, filled by a tier op and cached on the device at once.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedllm.config import SUPPORTED_BLOCK_SIZES
from pagedllm.errors import BlockManagerError, ConfigError
from pagedllm.kv.block_pool import BlockPool, KVCacheBlock
from pagedllm.kv.prefix_cache import (
    BlockContent,
    BlockHash,
    block_content,
    extra_keys_for,
    hash_content,
)
from pagedllm.kv.stats import KVCacheStats, TierStats, TierTimes
from pagedllm.kv.tiers import DiskState, DiskTier
from pagedllm.step import MemoryOp, MemoryOpKind, can_batch


class BlockCopy(NamedTuple):
    """Copy every layer's slots of device block ``src`` into device block ``dst``.

    A named pair, so it travels as the same ``(src, dst)`` pair as swap mappings.
    """

    src: int
    dst: int


@dataclass
class _SeqBlocks:
    """One sequence's blocks.

    ``block_table`` holds device block ids, or CPU block ids while ``swapped``.
    ``num_slots`` counts token positions covered (not reserved capacity).
    ``block_hashes[i]`` is the content hash of full block ``i`` (a memo that
    survives swaps); blocks ``< num_registered_blocks`` have been offered to
    the prefix cache.
    """

    block_table: list[int]
    num_slots: int
    cache_salt: str | None
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    swapped: bool = False


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass
class _PrefixHit:
    """One block of a cached prefix: where it was found and, on the device or host, which block holds it."""

    block_hash: BlockHash
    content: BlockContent
    tier: Tier
    block: KVCacheBlock | None = None  # the device or CPU block; None on disk


@dataclass
class _TierCounts:
    num_hit_tokens: int = 0
    num_read_blocks: int = 0
    num_written_blocks: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Paged KV memory: a device pool, an optional CPU swap pool and per-sequence tables.

    ``num_blocks`` device blocks of ``block_size`` slots; ``watermark`` is the
    fraction of device blocks kept free when admitting new work
    (``int(watermark * num_blocks)`` blocks), so running sequences can grow.
    Running out of blocks is answered by the ``can_*`` predicates; misuse
    raises :class:`~pagedllm.errors.BlockManagerError`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        enable_host_tier: bool = False,
        disk_tier: DiskTier | None = None,
        block_nbytes: int = 0,
        tier_times: TierTimes | None = None,
    ) -> None:
        """``enable_host_tier``: evicted prefix blocks are kept in the CPU pool's free
        blocks (one pool with swap: a swapped-out request's blocks are in use,
        host-tier blocks are cached-free and evicted LRU). ``disk_tier``: evicted
        prefix blocks are also written there (write-through). ``block_nbytes``
        (bytes of one block's KV) and ``tier_times`` (seconds the worker spent
        on tier copies) only feed the stats."""
        _validate_sizes(num_blocks, block_size, num_cpu_blocks, watermark)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_host_tier = enable_host_tier and enable_prefix_caching and num_cpu_blocks > 0
        self.disk_tier = disk_tier if enable_prefix_caching else None
        self.block_nbytes = block_nbytes
        self.tier_times = tier_times if tier_times is not None else TierTimes()
        self._pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, on_evict=self._on_device_evict)
        self._cpu_pool = BlockPool(num_cpu_blocks, enable_caching=self.enable_host_tier)
        # Tier moves decided since the last take_tier_ops(), in decision order.
        self._tier_ops: list[MemoryOp] = []
        self._tier_counts = {Tier.HOST: _TierCounts(), Tier.DISK: _TierCounts()}
        self._seqs: dict[int, _SeqBlocks] = {}
        self._num_table_entries = 0  # summed table lengths of sequences on the device
        self._peak_used_blocks = 0
        self._peak_table_entries = 0
        self._num_prefix_queries = 0
        self._num_prefix_hits = 0
        self._num_preemptions = 0
        # Device blocks written by copy-on-write or swap-in, for the dashboard's
        # "copied" cells; bounded so that nobody draining it costs nothing.
        self._recent_writes: deque[int] = deque(maxlen=max(num_blocks, 1))

    # -- prefix-cache lookup ---------------------------------------------------------

    def _find_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, prefetch: bool = False
    ) -> tuple[list[_PrefixHit], bool]:
        """(the longest chain of cached full blocks, whether it stops at a block still loading from disk).

        Walks the chained hashes through the tiers: device, then host, then
        disk, where only a block already loaded into host memory is a hit (a
        step never waits on disk). With ``prefetch`` the stored disk blocks
        from there on are queued for loading. The chain never covers the last
        prompt token: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], False
        extra_keys = extra_keys_for(cache_salt)
        num_candidates = max(len(token_ids) - 1, 0) // self.block_size
        hits: list[_PrefixHit] = []
        parent_hash: BlockHash | None = None
        for i in range(num_candidates):
            content = block_content(parent_hash, token_ids, i, self.block_size, extra_keys)
            block_hash = hash_content(content)
            hit = self._lookup_tiers(block_hash, content)
            if hit is None:
                if prefetch and self._disk_state(block_hash, content) is DiskState.STORED:
                    self._prefetch_chain(token_ids, extra_keys, i, parent_hash, num_candidates)
                # (an inline disk tier has loaded it by now: READY, a hit at the next lookup)
                return hits, self._disk_state(block_hash, content) is DiskState.LOADING
            hits.append(hit)
            parent_hash = block_hash
        return hits, False

    def _lookup_tiers(self, block_hash: BlockHash, content: BlockContent) -> _PrefixHit | None:
        block = self._pool.lookup(block_hash, content)
        if block is not None:
            return _PrefixHit(block_hash, content, Tier.DEVICE, block)
        if self.enable_host_tier:
            cpu_block = self._cpu_pool.lookup(block_hash, content)
            if cpu_block is not None:
                return _PrefixHit(block_hash, content, Tier.HOST, cpu_block)
        if self._disk_state(block_hash, content) is DiskState.READY:
            return _PrefixHit(block_hash, content, Tier.DISK)
        return None

    def _disk_state(self, block_hash: BlockHash, content: BlockContent) -> DiskState:
        if self.disk_tier is None:
            return DiskState.ABSENT
        return self.disk_tier.lookup(block_hash, content)

    def _prefetch_chain(
        self, token_ids: Sequence[int], extra_keys: tuple, first: int,
        parent_hash: BlockHash | None, num_candidates: int,
    ) -> None:
        """Queue disk loads for blocks ``first ..`` of the chain, up to the first block no tier holds."""
        for i in range(first, num_candidates):
            content = block_content(parent_hash, token_ids, i, self.block_size, extra_keys)
            block_hash = hash_content(content)
            state = self._disk_state(block_hash, content)
            if state is DiskState.STORED:
                self.disk_tier.prefetch(block_hash)
            elif state is DiskState.ABSENT and self._lookup_tiers(block_hash, content) is None:
                return
            parent_hash = block_hash

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Start loading the disk-tier blocks of this prompt's cached prefix into host memory.

        Called when a request arrives, so its blocks are in memory by the time
        it is admitted. Returns whether some block of the chain is loading.
        """
        return self._find_cached_prefix(token_ids, cache_salt, prefetch=True)[1]

    def is_prefetching(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Whether this prompt's cached prefix stops at a disk block that is still loading."""
        return self._find_cached_prefix(token_ids, cache_salt)[1]

    def prefix_load_state(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[int, BlockHash | None]:
        """(blocks of this prompt's prefix that a tier holds or that are loading from disk, the
        hash of the last of them still loading, or None). Loads finish about in the order they
        were queued, so once that one is done the prefix is in memory, or nearly: a block
        another reader thread still holds, or one evicted meanwhile, is found at the next look."""
        if not self.enable_prefix_caching:
            return 0, None
        extra_keys = extra_keys_for(cache_salt)
        num_blocks, last, parent_hash = 0, None, None
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            content = block_content(parent_hash, token_ids, i, self.block_size, extra_keys)
            block_hash = hash_content(content)
            if self._disk_state(block_hash, content) is DiskState.LOADING:
                last = block_hash
            elif self._lookup_tiers(block_hash, content) is None:
                break
            num_blocks += 1
            parent_hash = block_hash
        return num_blocks, last

    def get_num_cached_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens servable from the prefix cache now, every tier (a multiple of block_size). No side effects."""
        return len(self._find_cached_prefix(token_ids, cache_salt)[0]) * self.block_size

    # -- eviction to the tiers -------------------------------------------------------

    def _on_device_evict(self, block_id: int, block_hash: BlockHash, content: BlockContent) -> None:
        """A cached device block is about to be reused: keep its KV in the host and disk tiers.

        The copy-out ops are queued now, before whatever op or forward pass
        writes the block's new contents (the scheduler drains them first).
        """
        if self.enable_host_tier:
            self._keep_in_host(block_id, block_hash, content)
        if self.disk_tier is not None:
            ticket = self.disk_tier.plan_write(block_hash, content)
            if ticket is not None:
                self._add_tier_op(MemoryOpKind.DISK_TIER_OUT, (block_id, ticket))
                self._tier_counts[Tier.DISK].num_written_blocks += 1

    def _keep_in_host(self, block_id: int, block_hash: BlockHash, content: BlockContent) -> None:
        cpu_block = self._cpu_pool.lookup(block_hash, content)
        if cpu_block is not None:  # still there from an earlier eviction: now the most recent
            if self._cpu_pool.is_free(cpu_block.block_id):
                self._cpu_pool.touch(cpu_block.block_id)
            return
        if self._cpu_pool.get_num_free_blocks() == 0:
            return  # every CPU block holds a swapped-out request
        cpu_id = self._cpu_pool.allocate()  # may evict the least recently used host-tier block
        registered = self._cpu_pool.register(cpu_id, block_hash, content)
        self._cpu_pool.free([cpu_id])
        if not registered:
            return  # another content holds this hash on the host (a collision): keep that one
        self._add_tier_op(MemoryOpKind.HOST_TIER_OUT, (block_id, cpu_id))
        self._tier_counts[Tier.HOST].num_written_blocks += 1

    def _add_tier_op(self, kind: MemoryOpKind, pair: tuple[int, int]) -> None:
        ops = self._tier_ops
        if ops and ops[-1].kind is kind and can_batch(ops[-1].pairs, [pair]):
            ops[-1].pairs.append(pair)
        else:
            ops.append(MemoryOp(kind, [pair]))

    def flush_to_disk(self) -> list[MemoryOp]:
        """Ops writing every cached block of the device and host tiers that the disk lacks (at shutdown,
        so a restarted engine finds whole chains on disk). Apply them before anything else."""
        self._tier_ops.extend(self.take_tier_ops())
        if self.disk_tier is None:
            return self.take_tier_ops()
        for kind, pool in ((MemoryOpKind.DISK_TIER_OUT, self._pool),
                           (MemoryOpKind.HOST_TIER_TO_DISK, self._cpu_pool)):
            for block in pool.hashed_blocks():
                ticket = self.disk_tier.plan_write(block.block_hash, block.content)
                if ticket is not None:
                    self._add_tier_op(kind, (block.block_id, ticket))
        return self.take_tier_ops()

    def take_tier_ops(self) -> list[MemoryOp]:
        """Tier copies decided since the last call, in order; apply them before any op decided after."""
        ops, self._tier_ops = self._tier_ops, []
        return ops

    # -- allocation ------------------------------------------------------------------

    def _num_blocks_to_take(
        self, token_ids: Sequence[int], num_reserved_tokens: int | None, hits: list[_PrefixHit]
    ) -> int:
        """Free-queue blocks a new sequence consumes: fresh ones (tier hits included) plus revived device hits."""
        num_tokens = _reserved(len(token_ids), num_reserved_tokens)
        device_hits = [hit.block for hit in hits if hit.tier is Tier.DEVICE]
        num_fresh = _cdiv(num_tokens, self.block_size) - len(device_hits)
        num_revived = sum(1 for block in device_hits if block.ref_count == 0)
        return num_fresh + num_revived

    def can_allocate(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        num_reserved_tokens: int | None = None,
        num_headroom_blocks: int = 0,
        reuse_cached_prefix: bool = True,
    ) -> bool:
        """Whether ``allocate`` would succeed and still leave the watermark free.

        ``num_headroom_blocks`` more must stay free as well: what the sequences
        already running need to keep growing.
        """
        hits = self._reusable_prefix(token_ids, cache_salt, reuse_cached_prefix)
        num_needed = self._num_blocks_to_take(token_ids, num_reserved_tokens, hits) + num_headroom_blocks
        return self._pool.get_num_free_blocks() - num_needed >= self.watermark_blocks

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        num_reserved_tokens: int | None = None,
        reuse_cached_prefix: bool = True,
    ) -> int:
        """Create ``seq_id``'s table covering ``len(token_ids)`` slots; return the cached-token count.

        Cached device blocks are shared (ref+1, reviving freed ones); host- and
        disk-tier hits get fresh device blocks filled by tier ops (see
        take_tier_ops) and are cached on the device again at once; the rest
        are fresh. With ``num_reserved_tokens`` the table covers that many
        slots up front. The watermark is not enforced here (see can_allocate).
        ``reuse_cached_prefix=False``: every block is fresh and no cache query
        is counted (a sequence that needs logits at every prompt position);
        its full blocks are still registered for others (cache_full_blocks).
        """
        if seq_id in self._seqs:
            raise BlockManagerError(
                f"sequence {seq_id} already has blocks; free it before allocating again"
            )
        hits = self._reusable_prefix(token_ids, cache_salt, reuse_cached_prefix)
        num_needed = self._num_blocks_to_take(token_ids, num_reserved_tokens, hits)
        if num_needed > self._pool.get_num_free_blocks():
            raise BlockManagerError(
                f"sequence {seq_id} needs {num_needed} free KV blocks, "
                f"{self._pool.get_num_free_blocks()} are free; check can_allocate first"
            )
        table = self._take_hits(hits)
        num_total = _cdiv(_reserved(len(token_ids), num_reserved_tokens), self.block_size)
        table += [self._pool.allocate() for _ in range(num_total - len(hits))]
        self._seqs[seq_id] = _SeqBlocks(
            block_table=table,
            num_slots=len(token_ids),
            cache_salt=cache_salt,
            block_hashes=[hit.block_hash for hit in hits],
            num_registered_blocks=len(hits),
        )
        self._num_table_entries += len(table)
        num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and reuse_cached_prefix:
            self._num_prefix_queries += len(token_ids)
            self._num_prefix_hits += sum(self.block_size for hit in hits if hit.tier is Tier.DEVICE)
        self._update_peaks()
        return num_cached_tokens

    def _reusable_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, reuse_cached_prefix: bool
    ) -> list[_PrefixHit]:
        return self._find_cached_prefix(token_ids, cache_salt)[0] if reuse_cached_prefix else []

    def _take_hits(self, hits: list[_PrefixHit]) -> list[int]:
        """Device block ids for the hits, in chain order.

        Device hits are revived and host hits pinned before any block is
        allocated, so the evictions those allocations cause can take neither;
        disk hits are claimed (their host copies reserved) likewise.
        """
        for hit in hits:
            if hit.tier is Tier.DEVICE:
                self._pool.incref(hit.block.block_id)
            elif hit.tier is Tier.HOST:
                self._cpu_pool.incref(hit.block.block_id)
        tickets = {hit.block_hash: self.disk_tier.claim(hit.block_hash) for hit in hits if hit.tier is Tier.DISK}
        table = []
        for hit in hits:
            if hit.tier is Tier.DEVICE:
                table.append(hit.block.block_id)
                continue
            block_id = self._pool.allocate()
            self._pool.register(block_id, hit.block_hash, hit.content)
            if hit.tier is Tier.HOST:
                self._add_tier_op(MemoryOpKind.HOST_TIER_IN, (hit.block.block_id, block_id))
            else:
                self._add_tier_op(MemoryOpKind.DISK_TIER_IN, (tickets[hit.block_hash], block_id))
            counts = self._tier_counts[hit.tier]
            counts.num_hit_tokens += self.block_size
            counts.num_read_blocks += 1
            self._recent_writes.append(block_id)
            table.append(block_id)
        for hit in hits:
            if hit.tier is Tier.HOST:
                self._cpu_pool.free([hit.block.block_id])  # stays cached on the host, now most recent
        return table

    # -- growth and copy-on-write ----------------------------------------------------

    def _append_plan(self, seq: _SeqBlocks, num_new_tokens: int) -> tuple[list[int], int]:
        """(table indices to copy-on-write, blocks to append) for growing by ``num_new_tokens`` slots.

        Every existing shared block the new positions fall into must be made
        private first; normally that is only the last, partial one.
        """
        if num_new_tokens <= 0:
            return [], 0
        first = seq.num_slots // self.block_size
        table = seq.block_table
        last = (seq.num_slots + num_new_tokens - 1) // self.block_size
        # The common decode step: every new slot lands in one block already in
        # the table that this sequence alone holds, so no block changes.
        if first == last and last < len(table) and self._pool.blocks[table[last]].ref_count == 1:
            return [], 0
        end = _cdiv(seq.num_slots + num_new_tokens, self.block_size)
        shared = [
            i
            for i in range(first, min(end, len(table)))
            if self._pool.blocks[table[i]].ref_count > 1
        ]
        return shared, max(end - len(table), 0)

    def can_append_slots(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether ``append_slots`` has the free blocks it needs (the watermark may be used)."""
        seq = self._device_seq(seq_id)
        shared, num_grow = self._append_plan(seq, num_new_tokens)
        return len(shared) + num_grow <= self._pool.get_num_free_blocks()

    def can_append_group(self, num_new_tokens: dict[int, int]) -> bool:
        """Whether the sequences can all grow at once, ``seq_id -> num_new_tokens`` slots each.

        Counts every sequence's copy-on-writes and new blocks as if it grew
        alone: an upper bound, since once one of them copies a block it shares
        with another, the other writes that block in place.
        """
        need = 0
        for seq_id, num_new in num_new_tokens.items():
            shared, num_grow = self._append_plan(self._device_seq(seq_id), num_new)
            need += len(shared) + num_grow
        return need <= self._pool.get_num_free_blocks()

    # -- sizing: the block counts the scheduler and the engine plan with ----------------

    def num_blocks_for_group(self, num_slots: Sequence[int], num_shared_slots: int = 0) -> int:
        """Blocks that sequences of ``num_slots[i]`` slots each hold together.

        With two or more sequences, the full blocks of their first
        ``num_shared_slots`` slots are held once (``fork`` shares them); each
        sequence covers those slots. Pure arithmetic: no table is read.
        """
        num_shared = num_shared_slots // self.block_size if len(num_slots) > 1 else 0
        return num_shared + sum(_cdiv(n, self.block_size) - num_shared for n in num_slots)

    def full_block_slots(self, num_slots: int) -> int:
        """Slots of the full blocks among the first ``num_slots``: what a prefix ``fork`` of a prompt shares."""
        return (num_slots // self.block_size) * self.block_size

    def num_growth_blocks(self, num_target_slots: int, num_held_blocks: int) -> int:
        """Blocks beyond ``num_held_blocks`` that one sequence needs to cover ``num_target_slots`` slots (>= 0)."""
        return max(0, _cdiv(num_target_slots, self.block_size) - num_held_blocks)

    def append_slots(self, seq_id: int, num_new_tokens: int = 1) -> list[BlockCopy]:
        """Extend ``seq_id`` by ``num_new_tokens`` slots (positions n .. n+k-1, n = current count).

        A shared block the new positions land in is replaced by a private one
        first; when it already holds tokens (the block of position n, n not a
        multiple of block_size) a ``BlockCopy(old, new)`` is returned for the
        runner to apply before the forward pass.
        """
        if num_new_tokens < 0:
            raise BlockManagerError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._device_seq(seq_id)
        shared, num_grow = self._append_plan(seq, num_new_tokens)
        if len(shared) + num_grow > self._pool.get_num_free_blocks():
            raise BlockManagerError(
                f"not enough free KV blocks to grow sequence {seq_id}; check can_append_slots"
            )
        if not shared and not num_grow:
            seq.num_slots += num_new_tokens  # no block changed: usage and peaks stay as they are
            return []
        copies = [self._copy_on_write(seq, index) for index in shared]
        seq.block_table += [self._pool.allocate() for _ in range(num_grow)]
        seq.num_slots += num_new_tokens
        self._num_table_entries += num_grow
        self._update_peaks()
        return [copy for copy in copies if copy is not None]

    def append_slot_in_place(self, seq_id: int, position: int) -> list[int] | None:
        """The steady decode step in one lookup: cover ``position`` and return a copy of the table.

        Only when ``position`` is the next one (``== num_slots``) and its slot
        lies in a block of the table that this sequence alone holds, so that no
        block changes (what ``append_slots(seq_id, 1)`` does then). None, with
        nothing changed, otherwise: then ``can_append_slots`` and ``append_slots``.
        """
        seq = self._device_seq(seq_id)
        table = seq.block_table
        index = position // self.block_size
        if (
            position != seq.num_slots
            or index >= len(table)
            or self._pool.blocks[table[index]].ref_count != 1
        ):
            return None
        seq.num_slots = position + 1
        return list(table)

    def _copy_on_write(self, seq: _SeqBlocks, index: int) -> BlockCopy | None:
        """Give ``seq`` a private block at table ``index``; a BlockCopy if the old one held tokens."""
        old = seq.block_table[index]
        new = self._pool.allocate()
        seq.block_table[index] = new
        self._pool.free([old])  # ref_count was > 1, so the other owners keep it
        if seq.num_slots > index * self.block_size:
            self._recent_writes.append(new)
            return BlockCopy(src=old, dst=new)
        return None

    # -- prefix-cache registration ---------------------------------------------------

    def cache_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register every full block whose tokens are all computed in the prefix cache.

        ``token_ids`` is the sequence's whole token list so far (prompt +
        outputs); block ``i`` qualifies when ``i < num_computed_tokens // block_size``.
        Idempotent, incremental (each block is hashed once), and a no-op
        when prefix caching is off or the sequence is swapped out (it has no
        device blocks to publish; they are registered after swap-in).
        """
        seq = self._get_seq(seq_id)
        if not self.enable_prefix_caching or seq.swapped:
            return
        if num_computed_tokens // self.block_size <= seq.num_registered_blocks:
            return  # num_full below is at most this: the cheap test for most decode steps
        num_tokens = min(num_computed_tokens, len(token_ids), seq.num_slots)
        num_full = min(num_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return  # no block became full since the last call (most decode steps)
        extra_keys = extra_keys_for(seq.cache_salt)
        for i in range(seq.num_registered_blocks, num_full):
            parent_hash = seq.block_hashes[i - 1] if i > 0 else None
            content = block_content(parent_hash, token_ids, i, self.block_size, extra_keys)
            if i == len(seq.block_hashes):
                seq.block_hashes.append(hash_content(content))
            self._pool.register(seq.block_table[i], seq.block_hashes[i], content)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached device hash (and the host tier's, when no request is swapped out);
        refused (False) while any device block is in use. The disk tier is kept."""
        if not self._pool.reset_prefix_cache():
            return False
        self._cpu_pool.reset_prefix_cache()
        return True

    # -- fork and free ---------------------------------------------------------------

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None) -> None:
        """Give ``child_id`` the parent's table (every block ref+1) and slot count; no KV is copied.

        With ``num_tokens``, the child shares only the blocks that hold the
        parent's first ``num_tokens`` positions and covers that many slots (a
        prefix fork: how a recomputed group shares its prompt again).
        """
        parent = self._device_seq(parent_id)
        if child_id in self._seqs:
            raise BlockManagerError(
                f"cannot fork {parent_id} onto {child_id}: sequence {child_id} already exists"
            )
        if num_tokens is None:
            table, num_slots = list(parent.block_table), parent.num_slots
        elif 0 <= num_tokens <= parent.num_slots:
            table, num_slots = parent.block_table[: _cdiv(num_tokens, self.block_size)], num_tokens
        else:
            raise BlockManagerError(
                f"cannot fork the first {num_tokens} tokens of sequence {parent_id}, "
                f"which covers {parent.num_slots} slots"
            )
        for block_id in table:
            self._pool.incref(block_id)
        num_full = num_slots // self.block_size
        self._seqs[child_id] = _SeqBlocks(
            block_table=table,
            num_slots=num_slots,
            cache_salt=parent.cache_salt,
            block_hashes=list(parent.block_hashes[:num_full]),
            num_registered_blocks=min(parent.num_registered_blocks, num_full),
        )
        self._num_table_entries += len(table)
        self._update_peaks()

    def free(self, seq_id: int) -> None:
        """Release ``seq_id`` (on the device or swapped out); blocks at ref 0 return to their pool.

        The table is freed back to front, so the end of a cached chain is
        evicted before its start (which other prompts are likelier to share).
        """
        seq = self._get_seq(seq_id)
        if seq.swapped:
            self._cpu_pool.free(reversed(seq.block_table))
        else:
            self._pool.free(reversed(seq.block_table))
            self._num_table_entries -= len(seq.block_table)
        del self._seqs[seq_id]

    # -- swapping --------------------------------------------------------------------

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """Whether the CPU pool can take every distinct block of the group."""
        seqs = self._group(seq_ids, swapped=False)
        return len(_distinct_blocks(seqs)) <= self._cpu_pool.get_num_free_blocks()

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group to the CPU pool; return (device_block, cpu_block) pairs, each block once.

        Blocks shared within the group stay shared on the CPU. The runner must
        copy these pairs before any device block is written again.
        """
        if not self.can_swap_out(seq_ids):
            raise BlockManagerError(
                "not enough free CPU blocks to swap the group out; check can_swap_out"
            )
        seqs = self._group(seq_ids, swapped=False)
        mapping = self._move_group(seqs, src=self._pool, dst=self._cpu_pool)
        self._num_table_entries -= sum(len(seq.block_table) for seq in seqs)
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Sequence[int], num_headroom_blocks: int = 0) -> bool:
        """Whether the device has the group's distinct blocks free while keeping the watermark.

        ``num_headroom_blocks`` more must be free as well: what the group needs
        to take its next step once it is back.
        """
        seqs = self._group(seq_ids, swapped=True)
        num_needed = len(_distinct_blocks(seqs)) + num_headroom_blocks
        return self._pool.get_num_free_blocks() - num_needed >= self.watermark_blocks

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back; return (cpu_block, device_block) pairs, each block once."""
        seqs = self._group(seq_ids, swapped=True)
        if len(_distinct_blocks(seqs)) > self._pool.get_num_free_blocks():
            raise BlockManagerError(
                "not enough free KV blocks to swap the group in; check can_swap_in"
            )
        mapping = self._move_group(seqs, src=self._cpu_pool, dst=self._pool)
        self._recent_writes.extend(mapping.values())
        self._num_table_entries += sum(len(seq.block_table) for seq in seqs)
        self._update_peaks()
        return list(mapping.items())

    def _move_group(self, seqs: list[_SeqBlocks], src: BlockPool, dst: BlockPool) -> dict[int, int]:
        """Re-home every table of ``seqs`` from ``src`` to ``dst``; return src -> dst block ids.

        Each distinct source block gets one destination block whose ref_count
        is the number of the group's references to it; blocks also used by
        sequences outside the group keep their remaining references.
        """
        mapping: dict[int, int] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id in mapping:
                    dst.incref(mapping[block_id])
                else:
                    mapping[block_id] = dst.allocate()
        for seq in seqs:
            src.free(reversed(seq.block_table))
            seq.block_table = [mapping[block_id] for block_id in seq.block_table]
            seq.swapped = not seq.swapped
            # New device blocks are unhashed; cache_full_blocks registers them again.
            seq.num_registered_blocks = 0
        return mapping

    # -- per-sequence queries ----------------------------------------------------------

    def has_seq(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds blocks, on the device or swapped out."""
        return seq_id in self._seqs

    def is_swapped(self, seq_id: int) -> bool:
        return self._get_seq(seq_id).swapped

    def get_block_table(self, seq_id: int) -> list[int]:
        """A copy of the device block ids of ``seq_id``, logical block order."""
        return list(self._device_seq(seq_id).block_table)

    def get_num_blocks(self, seq_id: int) -> int:
        """Blocks in ``seq_id``'s table (device or CPU), counting shared ones."""
        return len(self._get_seq(seq_id).block_table)

    def get_num_slots(self, seq_id: int) -> int:
        """Token positions ``seq_id`` covers (kept while swapped out)."""
        return self._get_seq(seq_id).num_slots

    def slot_of(self, seq_id: int, position: int) -> int:
        """Cache slot of ``position``: ``table[p // block_size] * block_size + p % block_size``."""
        seq = self._device_seq(seq_id)
        if not 0 <= position < seq.num_slots:
            raise BlockManagerError(
                f"position {position} is outside sequence {seq_id}'s {seq.num_slots} slots"
            )
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    def get_num_free_blocks(self) -> int:
        """Device blocks with ref_count 0: truly free plus cached-evictable."""
        return self._pool.get_num_free_blocks()

    def take_recent_writes(self) -> list[int]:
        """Device blocks written by copy-on-write or swap-in since the last call (oldest first)."""
        writes = list(self._recent_writes)
        self._recent_writes.clear()
        return writes

    def _get_seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(
                f"sequence {seq_id} has no blocks (never allocated, or already freed)"
            )
        return seq

    def _device_seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._get_seq(seq_id)
        if seq.swapped:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        return seq

    def _group(self, seq_ids: Sequence[int], swapped: bool) -> list[_SeqBlocks]:
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockManagerError(f"sequence ids repeat in swap group {list(seq_ids)}")
        seqs = [self._get_seq(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, seqs, strict=True):
            if seq.swapped != swapped:
                where = "swapped out" if seq.swapped else "on the device"
                raise BlockManagerError(f"sequence {seq_id} is already {where}")
        return seqs

    # -- statistics ------------------------------------------------------------------

    def record_preemption(self) -> None:
        """Count one preemption (recompute or swap); whoever preempts calls this."""
        self._num_preemptions += 1

    def reset_peak_stats(self) -> None:
        """Restart the peak counters from the current usage (to measure one workload)."""
        self._peak_used_blocks = self._pool.get_num_used_blocks()
        self._peak_table_entries = self._num_table_entries

    def _update_peaks(self) -> None:
        self._peak_used_blocks = max(self._peak_used_blocks, self._pool.get_num_used_blocks())
        self._peak_table_entries = max(self._peak_table_entries, self._num_table_entries)

    def _block_fills(self) -> dict[int, int]:
        """Device block id -> slots holding tokens, for every block some table uses."""
        fills: dict[int, int] = {}
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            for i, block_id in enumerate(seq.block_table):
                fill = min(max(seq.num_slots - i * self.block_size, 0), self.block_size)
                fills[block_id] = max(fills.get(block_id, 0), fill)
        return fills

    def stats(self) -> KVCacheStats:
        """A snapshot; costs O(total table length)."""
        fills = self._block_fills()
        num_holding = sum(fills.values())
        num_seq_slots = sum(seq.num_slots for seq in self._seqs.values() if not seq.swapped)
        num_used = self._pool.get_num_used_blocks()
        return KVCacheStats(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_free_blocks=self._pool.get_num_free_blocks(),
            num_used_blocks=num_used,
            num_cached_blocks=self._pool.get_num_cached_blocks(),
            peak_used_blocks=self._peak_used_blocks,
            num_shared_blocks=sum(1 for b in fills if self._pool.blocks[b].ref_count > 1),
            num_allocated_slots=num_used * self.block_size,
            num_slots_holding_tokens=num_holding,
            num_slots_saved_by_sharing=num_seq_slots - num_holding,
            peak_blocks_without_sharing=self._peak_table_entries,
            prefix_cache_queries=self._num_prefix_queries,
            prefix_cache_hits=self._num_prefix_hits,
            num_preemptions=self._num_preemptions,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=self._cpu_pool.get_num_free_blocks(),
            num_swapped_out_seqs=sum(1 for seq in self._seqs.values() if seq.swapped),
            tiers=self._tier_stats(),
        )

    def _tier_stats(self) -> tuple[TierStats, ...]:
        """Host and disk tier figures (only the tiers that are on)."""
        tiers = []
        nbytes, times = self.block_nbytes, self.tier_times
        if self.enable_host_tier:
            counts = self._tier_counts[Tier.HOST]
            num_blocks = self._cpu_pool.get_num_cached_blocks()
            tiers.append(TierStats(
                name="host", num_blocks=num_blocks, num_bytes=num_blocks * nbytes,
                num_hit_tokens=counts.num_hit_tokens, num_read_bytes=counts.num_read_blocks * nbytes,
                num_written_bytes=counts.num_written_blocks * nbytes,
                read_seconds=times.host_read_seconds, write_seconds=times.host_write_seconds,
            ))
        disk = self.disk_tier
        if disk is not None:
            counts, c = self._tier_counts[Tier.DISK], disk.counters
            tiers.append(TierStats(
                name="disk", num_blocks=disk.num_blocks, num_bytes=disk.num_bytes if disk.enabled else 0,
                num_hit_tokens=counts.num_hit_tokens, num_read_bytes=c.num_read_bytes,
                num_written_bytes=c.num_written_bytes,
                read_seconds=c.read_seconds, write_seconds=c.write_seconds + times.disk_copy_seconds,
            ))
        return tuple(tiers)

    # -- integrity -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError with a message on the first broken invariant (see module doc)."""
        self._pool.check_invariants()
        self._cpu_pool.check_invariants()
        if self.disk_tier is not None:
            self.disk_tier.check_invariants()
        device = [seq for seq in self._seqs.values() if not seq.swapped]
        swapped = [seq for seq in self._seqs.values() if seq.swapped]
        _check_refs(self._pool, device, "device")
        _check_refs(self._cpu_pool, swapped, "CPU")
        assert self._num_table_entries == sum(len(s.block_table) for s in device), (
            "table-entry count drifted"
        )
        for seq_id, seq in self._seqs.items():
            assert len(seq.block_table) * self.block_size >= seq.num_slots, (
                f"sequence {seq_id}: {len(seq.block_table)} blocks cannot hold {seq.num_slots} slots"
            )
            assert seq.num_registered_blocks <= len(seq.block_hashes), (
                f"sequence {seq_id}: registered blocks beyond its known hashes"
            )
            if not seq.swapped:
                self._check_seq_hashes(seq_id, seq)

    def _check_seq_hashes(self, seq_id: int, seq: _SeqBlocks) -> None:
        """A hashed block in a table is full and, where the sequence knows block i's hash, carries it.

        (A fork child may not know yet: its parent can register a shared block later.)
        """
        for i, block_id in enumerate(seq.block_table):
            block_hash = self._pool.blocks[block_id].block_hash
            if block_hash is None:
                continue
            assert (i + 1) * self.block_size <= seq.num_slots, (
                f"sequence {seq_id}: hashed block {block_id} at index {i} is not full"
            )
            assert i >= len(seq.block_hashes) or seq.block_hashes[i] == block_hash, (
                f"sequence {seq_id}: block {block_id} at index {i} carries another prefix's hash"
            )


def _reserved(num_tokens: int, num_reserved_tokens: int | None) -> int:
    """Slots to cover up front: the prompt, or the reservation when one is given."""
    if num_reserved_tokens is None:
        return num_tokens
    if num_reserved_tokens < num_tokens:
        raise BlockManagerError(
            f"num_reserved_tokens={num_reserved_tokens} is less than the prompt's {num_tokens} tokens"
        )
    return num_reserved_tokens


def _distinct_blocks(seqs: list[_SeqBlocks]) -> set[int]:
    return {block_id for seq in seqs for block_id in seq.block_table}


def _check_refs(pool: BlockPool, seqs: list[_SeqBlocks], where: str) -> None:
    """ref_count == number of table entries pointing at the block; no table points at a free block."""
    counts = Counter(block_id for seq in seqs for block_id in seq.block_table)
    for block in pool.blocks:
        num_refs = counts.get(block.block_id, 0)
        assert block.ref_count == num_refs, (
            f"{where} block {block.block_id}: ref_count {block.ref_count} but {num_refs} table entries"
        )
        assert (num_refs == 0) == pool.is_free(block.block_id), (
            f"{where} block {block.block_id}: free-queue membership disagrees with {num_refs} references"
        )
    assert set(counts) <= set(range(pool.num_blocks)), f"a {where} table points outside the pool"


def _validate_sizes(
    num_blocks: int, block_size: int, num_cpu_blocks: int, watermark: float
) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ConfigError(
            f"block_size={block_size!r} is not supported; choose one of {list(SUPPORTED_BLOCK_SIZES)}"
        )
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
        raise ConfigError(f"num_cpu_blocks must be an integer >= 0, got {num_cpu_blocks!r}")
    if not 0.0 <= watermark < 1.0:
        raise ConfigError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
