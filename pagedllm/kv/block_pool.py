"""A pool of fixed-size physical KV blocks with reference counts and a prefix-cache index.

Invariants (checked by :meth:`BlockPool.check_invariants`):

- a block is in the free queue if and only if its ``ref_count`` is 0;
- a block with a ``block_hash`` is the one the hash index maps that hash to,
  and the index holds no other blocks (one block per hash);
- ``num_cached_blocks`` counts the free blocks that still carry a hash.

The pool knows nothing about sequences; :class:`~pagedllm.kv.block_manager.BlockManager`
owns the block tables and decides which blocks to share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pagedllm.errors import BlockManagerError
from pagedllm.kv.prefix_cache import BlockContent, BlockHash


class KVCacheBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V cache.

    ``ref_count`` is the number of block-table entries (over all sequences)
    pointing at the block. ``block_hash`` and ``content`` are set while the
    block is registered in the prefix cache (full, computed, revivable after
    it is freed) and ``None`` otherwise.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "content")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.content: BlockContent | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_count}{cached})"


class BlockPool:
    """``num_blocks`` blocks, an LRU free queue and the hash -> block index.

    The free queue is ordered from next-to-evict (head) to most recently freed
    (tail). A fresh pool hands out blocks 0, 1, 2, ... in order; freed blocks go
    to the tail; allocation takes from the head, evicting a cached block's hash
    when it reuses one.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: Callable[[int, BlockHash, BlockContent], None] | None = None,
    ) -> None:
        """``on_evict(block_id, hash, content)`` runs when allocate() reuses a cached block,
        before its hash is dropped: where a backing store saves the block's KV."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict is a hashed doubly linked list: O(1) pop from the head, push to the
        # tail and delete from the middle on revival (a deque's remove() is O(n)).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._index: dict[BlockHash, KVCacheBlock] = {}
        self._num_cached_blocks = 0
        self.on_evict = on_evict

    # -- queries -----------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_count 0: truly free plus cached-but-evictable."""
        return len(self._free)

    def get_num_cached_blocks(self) -> int:
        """Free blocks that still carry a hash, so a matching prompt can revive them."""
        return self._num_cached_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks with ref_count > 0."""
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free queue from head (evicted next) to tail (freed last)."""
        return list(self._free)

    def hashed_blocks(self) -> list[KVCacheBlock]:
        """Every block the prefix-cache index holds (in use or free), in registration order."""
        return list(self._index.values())

    def touch(self, block_id: int) -> None:
        """Move a free block to the tail of the free queue (most recently used; evicted last)."""
        self._free.move_to_end(block_id)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def lookup(self, block_hash: BlockHash, content: BlockContent) -> KVCacheBlock | None:
        """The cached block holding exactly ``content``, or None.

        Comparing the stored content means a hash collision can only miss.
        """
        block = self._index.get(block_hash)
        if block is None or block.content != content:
            return None
        return block

    # -- reference counting --------------------------------------------------------

    def allocate(self) -> int:
        """Take the head of the free queue with ref_count 1, dropping any hash it held."""
        if not self._free:
            raise BlockManagerError(
                "no free KV blocks left; check can_allocate/can_append_slots first"
            )
        _, block = self._free.popitem(last=False)
        block.ref_count = 1
        if block.block_hash is not None:
            self._num_cached_blocks -= 1
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash, block.content)
            self._evict_hash(block)
        return block.block_id

    def incref(self, block_id: int) -> None:
        """Add one reference; a free (cached) block is revived: unlinked from the queue in O(1)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            if block.block_hash is not None:
                self._num_cached_blocks -= 1
        block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching 0 are appended to the tail in that order, so the first
        one given is the first of them to be evicted: callers pass a sequence's
        table reversed so the end of its chain goes before the shared start.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise BlockManagerError(f"block {block_id} freed while it has no references")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block
                if block.block_hash is not None:
                    self._num_cached_blocks += 1

    # -- prefix-cache index ----------------------------------------------------------

    def register(self, block_id: int, block_hash: BlockHash, content: BlockContent) -> bool:
        """Make a full, computed, in-use block findable by ``block_hash``.

        Returns False (and changes nothing) when caching is off, the block is
        already hashed, or another block holds this hash already: the index
        keeps one block per hash, so a duplicate simply stays unhashed.
        """
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self._index:
            return False
        if block.ref_count == 0:
            raise BlockManagerError(f"block {block_id} is free; only blocks in use can be cached")
        block.block_hash = block_hash
        block.content = content
        self._index[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (returns False) while any block is in use."""
        if self.get_num_used_blocks() > 0:
            return False
        for block in self._index.values():
            block.block_hash = None
            block.content = None
        self._index.clear()
        self._num_cached_blocks = 0
        return True

    def _evict_hash(self, block: KVCacheBlock) -> None:
        del self._index[block.block_hash]
        block.block_hash = None
        block.content = None

    # -- integrity -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken pool invariant."""
        for block_id, block in self._free.items():
            assert block is self.blocks[block_id], f"free queue entry {block_id} is a stale block"
            assert block.ref_count == 0, (
                f"block {block_id} is in the free queue with ref_count {block.ref_count}"
            )
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            if block.ref_count == 0:
                assert block.block_id in self._free, (
                    f"block {block.block_id} has no references but is not free"
                )
            if block.block_hash is not None:
                assert self._index.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the index does not map to it"
                )
            assert (block.block_hash is None) == (block.content is None), (
                f"block {block.block_id}: hash and content disagree"
            )
        for block_hash, block in self._index.items():
            assert block.block_hash == block_hash, (
                f"index maps a hash to block {block.block_id} that lacks it"
            )
        num_cached = sum(1 for b in self._free.values() if b.block_hash is not None)
        assert num_cached == self._num_cached_blocks, (
            f"cached-block count {self._num_cached_blocks} != {num_cached} hashed free blocks"
        )
        num_used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert num_used + len(self._free) == self.num_blocks, (
            f"{num_used} used + {len(self._free)} free != {self.num_blocks} blocks"
        )
        if not self.enable_caching:
            assert not self._index, "prefix caching is off but blocks are hashed"
