"""A plain-data snapshot of the KV memory manager's utilisation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheStats:
    """KV-cache utilisation at one moment; block counts are device blocks unless named cpu.

    Slots are token positions (``block_size`` per block). A block shared by
    several sequences is counted once in every ``num_*_blocks`` and
    ``num_slots_holding_tokens`` figure. ``prefix_cache_*`` count prompt
    tokens; ``peak_*`` are maxima since the manager was created.
    """

    block_size: int
    num_blocks: int
    num_free_blocks: int  # ref_count 0: truly free + cached-evictable
    num_used_blocks: int  # ref_count > 0
    num_cached_blocks: int  # free but still revivable by a prefix hit
    peak_used_blocks: int
    num_shared_blocks: int  # ref_count > 1
    num_allocated_slots: int  # num_used_blocks * block_size
    num_slots_holding_tokens: int  # slots of used blocks that hold some sequence's token
    num_slots_saved_by_sharing: int  # sum of per-sequence slots minus the distinct slots
    peak_blocks_without_sharing: int  # peak of the summed block-table lengths
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens served from the cache
    num_preemptions: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_swapped_out_seqs: int

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def slot_utilization(self) -> float:
        """Fraction of allocated slots that hold a token; 1.0 when nothing is allocated."""
        if self.num_allocated_slots == 0:
            return 1.0
        return self.num_slots_holding_tokens / self.num_allocated_slots

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over query tokens; 0.0 before the first query."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
