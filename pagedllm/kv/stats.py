"""A plain-data snapshot of the KV memory manager's utilisation."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    prefix_cache_hits: int  # prompt tokens served from device blocks (tier hits: ``tiers``)
    num_preemptions: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_swapped_out_seqs: int
    tiers: tuple[TierStats, ...] = field(default=())  # host / disk tiers that are on

    def tier(self, name: str) -> TierStats | None:
        """The tier called ``name`` ("host" or "disk"), None when it is off."""
        return next((t for t in self.tiers if t.name == name), None)

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


@dataclass(frozen=True)
class TierStats:
    """One tier of the prefix cache below the device (``name``: host | disk).

    ``num_blocks``/``num_bytes``: what it holds now; ``num_hit_tokens``:
    prompt tokens served from it; bytes read and written and the seconds
    spent on them are totals since start (disk: by its background threads).
    """

    name: str
    num_blocks: int
    num_bytes: int
    num_hit_tokens: int
    num_read_bytes: int
    num_written_bytes: int
    read_seconds: float
    write_seconds: float


@dataclass
class TierTimes:
    """Seconds the worker spends copying tier blocks on the step path (mutable, filled by the worker).

    ``disk_copy_seconds``: taking the host copy a disk write starts from.
    On CUDA these time the launches of copies the stream runs later.
    """

    host_read_seconds: float = 0.0
    host_write_seconds: float = 0.0
    disk_copy_seconds: float = 0.0
