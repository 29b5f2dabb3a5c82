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
  names, and is never written again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedllm.config import SUPPORTED_BLOCK_SIZES
from pagedllm.errors import BlockManagerError, ConfigError
from pagedllm.kv.block_pool import BlockPool, KVCacheBlock
from pagedllm.kv.prefix_cache import BlockHash, block_content, extra_keys_for, hash_content
from pagedllm.kv.stats import KVCacheStats


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
    ) -> None:
        _validate_sizes(num_blocks, block_size, num_cpu_blocks, watermark)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self._pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
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
        self, token_ids: Sequence[int], cache_salt: str | None
    ) -> list[tuple[BlockHash, KVCacheBlock]]:
        """The longest chain of cached full blocks, never covering the last token.

        The last prompt token is always recomputed: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        extra_keys = extra_keys_for(cache_salt)
        num_candidates = max(len(token_ids) - 1, 0) // self.block_size
        hits: list[tuple[BlockHash, KVCacheBlock]] = []
        parent_hash: BlockHash | None = None
        for i in range(num_candidates):
            content = block_content(parent_hash, token_ids, i, self.block_size, extra_keys)
            block_hash = hash_content(content)
            block = self._pool.lookup(block_hash, content)
            if block is None:
                break
            hits.append((block_hash, block))
            parent_hash = block_hash
        return hits

    def get_num_cached_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens servable from the prefix cache now (a multiple of block_size). No side effects."""
        return len(self._find_cached_prefix(token_ids, cache_salt)) * self.block_size

    # -- allocation ------------------------------------------------------------------

    def _num_blocks_to_take(
        self, token_ids: Sequence[int], num_reserved_tokens: int | None, hits: list
    ) -> int:
        """Free-queue blocks a new sequence consumes: fresh ones plus revived cached hits."""
        num_tokens = _reserved(len(token_ids), num_reserved_tokens)
        num_fresh = _cdiv(num_tokens, self.block_size) - len(hits)
        num_revived = sum(1 for _, block in hits if block.ref_count == 0)
        return num_fresh + num_revived

    def can_allocate(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        num_reserved_tokens: int | None = None,
        num_headroom_blocks: int = 0,
    ) -> bool:
        """Whether ``allocate`` would succeed and still leave the watermark free.

        ``num_headroom_blocks`` more must stay free as well: what the sequences
        already running need to keep growing.
        """
        hits = self._find_cached_prefix(token_ids, cache_salt)
        num_needed = self._num_blocks_to_take(token_ids, num_reserved_tokens, hits) + num_headroom_blocks
        return self._pool.get_num_free_blocks() - num_needed >= self.watermark_blocks

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        num_reserved_tokens: int | None = None,
    ) -> int:
        """Create ``seq_id``'s table covering ``len(token_ids)`` slots; return the cached-token count.

        Cached prefix blocks are shared (ref+1, reviving freed ones); the rest
        are fresh. With ``num_reserved_tokens`` the table covers that many
        slots up front. The watermark is not enforced here (see can_allocate).
        """
        if seq_id in self._seqs:
            raise BlockManagerError(
                f"sequence {seq_id} already has blocks; free it before allocating again"
            )
        hits = self._find_cached_prefix(token_ids, cache_salt)
        num_needed = self._num_blocks_to_take(token_ids, num_reserved_tokens, hits)
        if num_needed > self._pool.get_num_free_blocks():
            raise BlockManagerError(
                f"sequence {seq_id} needs {num_needed} free KV blocks, "
                f"{self._pool.get_num_free_blocks()} are free; check can_allocate first"
            )
        # Revive the hits before taking fresh blocks so eviction cannot take them.
        for _, block in hits:
            self._pool.incref(block.block_id)
        num_total = _cdiv(_reserved(len(token_ids), num_reserved_tokens), self.block_size)
        table = [block.block_id for _, block in hits]
        table += [self._pool.allocate() for _ in range(num_total - len(hits))]
        self._seqs[seq_id] = _SeqBlocks(
            block_table=table,
            num_slots=len(token_ids),
            cache_salt=cache_salt,
            block_hashes=[block_hash for block_hash, _ in hits],
            num_registered_blocks=len(hits),
        )
        self._num_table_entries += len(table)
        num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self._num_prefix_queries += len(token_ids)
            self._num_prefix_hits += num_cached_tokens
        self._update_peaks()
        return num_cached_tokens

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
        """Drop every cached hash; refused (False) while any device block is in use."""
        return self._pool.reset_prefix_cache()

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
        )

    # -- integrity -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError with a message on the first broken invariant (see module doc)."""
        self._pool.check_invariants()
        self._cpu_pool.check_invariants()
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
