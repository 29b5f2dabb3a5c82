"""A compact picture of the KV pools and the requests using them (the dashboard's data).

One :class:`KVSnapshot` says, for every physical block, what it is doing now
(:class:`CellState`) and how many table entries point at it, and lists the
running, waiting and swapped requests with their block tables in logical
order. It is taken on the engine thread between two steps, so it is
consistent; its cost is O(table entries + hashed blocks) in numpy and C-level
copies, and no Python object is made per block: the cells of a pool travel as
one byte each (:func:`pack_cells`), the tables as little-endian int32.

Cell states (one per device block, one per CPU swap block):

- FREE: ``ref_count`` 0 and no hash;
- USED: one table entry points at it and at least one of its slots holds a token;
- RESERVED: held by tables, but no slot holds a token yet (contiguous
  reservations, a block just appended for the next token);
- SHARED: several table entries point at it (fork, beam, prefix hit);
- CACHED: free, but its hash keeps it revivable by a prefix hit;
- SWAPPED: a CPU block holding a swapped-out sequence's KV;
- COPIED: a device block in use that a copy-on-write or a swap-in wrote
  since the previous snapshot (it wins over the other in-use states).

This module reads the block manager's and the pools' internals: it is the
manager's read-only friend, and nothing here changes them.
"""

from __future__ import annotations

import base64
import enum
import itertools
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from pagedllm.kv.block_manager import BlockManager, _cdiv, _SeqBlocks
from pagedllm.kv.stats import KVCacheStats

REF_SHIFT = 3  # a packed cell is state | min(ref_count, MAX_PACKED_REF) << REF_SHIFT
MAX_PACKED_REF = 31


class CellState(enum.IntEnum):
    FREE = 0
    USED = 1
    SHARED = 2
    CACHED = 3
    SWAPPED = 4
    COPIED = 5
    RESERVED = 6


def pack_cells(states: np.ndarray, ref_counts: np.ndarray) -> bytes:
    """One byte per block: the state in the low 3 bits, the ref count (saturated at 31) above."""
    refs = np.minimum(ref_counts, MAX_PACKED_REF).astype(np.uint8)
    return (states.astype(np.uint8) | (refs << REF_SHIFT)).tobytes()


def unpack_cells(packed: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(states [num_blocks] uint8, ref counts [num_blocks] uint8, saturated at 31)."""
    cells = np.frombuffer(packed, dtype=np.uint8)
    return cells & 0b111, cells >> REF_SHIFT


@dataclass(frozen=True)
class SeqView:
    """One sequence's blocks: device ids in logical order (CPU ids while ``swapped``)."""

    seq_id: int
    block_table: tuple[int, ...]
    num_slots: int  # token positions the table covers
    swapped: bool


@dataclass(frozen=True)
class RequestView:
    """A request as the dashboard lists it.

    ``num_cached_tokens`` prompt tokens came from the prefix cache: the first
    ``num_cached_tokens // block_size`` blocks of each table were hits.
    ``seqs`` are the live sequences holding blocks (none while waiting).
    """

    request_id: str
    status: str  # running | waiting | swapped
    kind: str  # sample | beam
    num_samples: int  # n / best_of, or the beam width
    prompt_len: int
    num_tokens: int  # the longest live sequence, prompt included
    num_cached_tokens: int
    seqs: tuple[SeqView, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Both pools' cells and the requests at one moment (see the module docstring)."""

    time: float  # seconds since the epoch
    block_size: int
    device_cells: bytes  # [num_blocks] packed cells
    cpu_cells: bytes  # [num_cpu_blocks] packed cells
    requests: tuple[RequestView, ...]
    counters: dict[str, float] = field(default_factory=dict)

    def cell_counts(self) -> dict[str, int]:
        """Device blocks per state name, plus ``swapped`` for the CPU pool's blocks in use."""
        states, _ = unpack_cells(self.device_cells)
        counts = np.bincount(states, minlength=len(CellState))
        result = {state.name.lower(): int(counts[state]) for state in CellState}
        cpu_states, _ = unpack_cells(self.cpu_cells)
        result["swapped"] = int(np.count_nonzero(cpu_states == CellState.SWAPPED))
        return result

    def to_json(self) -> dict:
        """Plain JSON: pools as deflate+base64 packed cells, all tables as one deflated int32 blob."""
        seqs = [seq for request in self.requests for seq in request.seqs]
        blob = np.fromiter(
            itertools.chain.from_iterable(seq.block_table for seq in seqs),
            dtype="<i4",
            count=sum(len(seq.block_table) for seq in seqs),
        )
        offset = 0
        requests = []
        for request in self.requests:
            seq_json = []
            for seq in request.seqs:
                seq_json.append([seq.seq_id, offset, len(seq.block_table), seq.num_slots, int(seq.swapped)])
                offset += len(seq.block_table)
            requests.append({
                "id": request.request_id, "status": request.status, "kind": request.kind,
                "n": request.num_samples, "prompt_len": request.prompt_len, "num_tokens": request.num_tokens,
                "cached": request.num_cached_tokens, "seqs": seq_json,
            })
        return {
            "time": self.time,
            "block_size": self.block_size,
            "num_blocks": len(self.device_cells),
            "num_cpu_blocks": len(self.cpu_cells),
            "device": _encode(self.device_cells),
            "cpu": _encode(self.cpu_cells),
            "tables": _encode(blob.tobytes()),
            "seq_fields": ["seq_id", "offset", "num_blocks", "num_slots", "swapped"],
            "requests": requests,
            "counters": self.counters,
        }


def _encode(data: bytes) -> str:
    """zlib (the browser's DecompressionStream('deflate')) then base64; level 1 is enough here."""
    return base64.b64encode(zlib.compress(data, 1)).decode("ascii")


def decode_field(text: str) -> bytes:
    """Inverse of the encoding ``to_json`` uses for ``device``, ``cpu`` and ``tables``."""
    return zlib.decompress(base64.b64decode(text))


# ---- cells ---------------------------------------------------------------------


def _ref_counts(seqs: list[_SeqBlocks], num_blocks: int) -> np.ndarray:
    """[num_blocks] int64: table entries pointing at each block (== ref_count, by invariant)."""
    flat = np.fromiter(
        itertools.chain.from_iterable(seq.block_table for seq in seqs),
        dtype=np.int64,
        count=sum(len(seq.block_table) for seq in seqs),
    )
    return np.bincount(flat, minlength=num_blocks)


def _reserved_blocks(seqs: list[_SeqBlocks], block_size: int) -> np.ndarray:
    """Block ids past each table's filled part (tables agree on a shared block's fill)."""
    tails = (seq.block_table[_cdiv(seq.num_slots, block_size) :] for seq in seqs)
    return np.fromiter(itertools.chain.from_iterable(tails), dtype=np.int64)


def device_cells(bm: BlockManager, written_block_ids: Iterable[int] = ()) -> bytes:
    """The device pool's packed cells; ``written_block_ids`` were copy/swap-in targets lately."""
    seqs = [seq for seq in bm._seqs.values() if not seq.swapped]
    num_blocks = bm.num_blocks
    refs = _ref_counts(seqs, num_blocks)
    states = np.full(num_blocks, CellState.FREE, dtype=np.uint8)
    states[refs == 1] = CellState.USED
    reserved = _reserved_blocks(seqs, bm.block_size)
    states[reserved[states[reserved] == CellState.USED]] = CellState.RESERVED
    states[refs > 1] = CellState.SHARED
    hashed_blocks = list(bm._pool._index.values())
    hashed = np.fromiter(map(attrgetter("block_id"), hashed_blocks), dtype=np.int64, count=len(hashed_blocks))
    states[hashed[refs[hashed] == 0]] = CellState.CACHED
    written = np.fromiter(written_block_ids, dtype=np.int64)
    states[written[refs[written] > 0]] = CellState.COPIED
    return pack_cells(states, refs)


def cpu_cells(bm: BlockManager) -> bytes:
    """The CPU swap pool's packed cells: SWAPPED where a swapped-out table points, else FREE."""
    seqs = [seq for seq in bm._seqs.values() if seq.swapped]
    refs = _ref_counts(seqs, bm.num_cpu_blocks)
    states = np.where(refs > 0, CellState.SWAPPED, CellState.FREE).astype(np.uint8)
    return pack_cells(states, refs)


# ---- requests --------------------------------------------------------------------


def _seq_views(bm: BlockManager, request) -> tuple[SeqView, ...]:
    views = []
    for seq in request.live_seqs():
        blocks = bm._seqs.get(seq.seq_id)
        if blocks is not None:
            views.append(SeqView(seq.seq_id, tuple(blocks.block_table), blocks.num_slots, blocks.swapped))
    return tuple(views)


def request_view(bm: BlockManager, request, status: str) -> RequestView:
    """The view of one engine Request (engine.sequence.Request) in queue ``status``."""
    live = request.live_seqs()
    return RequestView(
        request_id=request.request_id,
        status=status,
        kind="beam" if request.is_beam_search else "sample",
        num_samples=request.num_samples,
        prompt_len=len(request.prompt_token_ids),
        num_tokens=max((seq.num_tokens for seq in live), default=len(request.prompt_token_ids)),
        num_cached_tokens=request.num_cached_tokens,
        seqs=_seq_views(bm, request),
    )


def _block_fills(seqs: list[_SeqBlocks], num_blocks: int, block_size: int) -> np.ndarray:
    """[num_blocks] slots holding a token per block, max over the tables pointing at it (vectorised)."""
    lengths = np.fromiter((len(seq.block_table) for seq in seqs), dtype=np.int64, count=len(seqs))
    num_slots = np.fromiter((seq.num_slots for seq in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(
        itertools.chain.from_iterable(seq.block_table for seq in seqs), dtype=np.int64, count=int(lengths.sum())
    )
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    index_in_table = np.arange(len(flat)) - starts  # logical block index of each table entry
    entry_fill = np.clip(np.repeat(num_slots, lengths) - index_in_table * block_size, 0, block_size)
    fills = np.zeros(num_blocks, dtype=np.int64)
    np.maximum.at(fills, flat, entry_fill)
    return fills


def kv_stats(bm: BlockManager) -> KVCacheStats:
    """``bm.stats()``, computed with numpy: O(table entries) in C rather than in Python."""
    device = [seq for seq in bm._seqs.values() if not seq.swapped]
    refs = _ref_counts(device, bm.num_blocks)
    num_used = int(np.count_nonzero(refs))
    num_holding = int(_block_fills(device, bm.num_blocks, bm.block_size).sum())
    pool = bm._pool
    return KVCacheStats(
        block_size=bm.block_size,
        num_blocks=bm.num_blocks,
        num_free_blocks=pool.get_num_free_blocks(),
        num_used_blocks=num_used,
        num_cached_blocks=pool.get_num_cached_blocks(),
        peak_used_blocks=bm._peak_used_blocks,
        num_shared_blocks=int(np.count_nonzero(refs > 1)),
        num_allocated_slots=num_used * bm.block_size,
        num_slots_holding_tokens=num_holding,
        num_slots_saved_by_sharing=sum(seq.num_slots for seq in device) - num_holding,
        peak_blocks_without_sharing=bm._peak_table_entries,
        prefix_cache_queries=bm._num_prefix_queries,
        prefix_cache_hits=bm._num_prefix_hits,
        num_preemptions=bm._num_preemptions,
        num_cpu_blocks=bm.num_cpu_blocks,
        num_free_cpu_blocks=bm._cpu_pool.get_num_free_blocks(),
        num_swapped_out_seqs=len(bm._seqs) - len(device),
    )


def counters_of(bm: BlockManager) -> dict[str, float]:
    """The block manager's KVCacheStats as a flat dict of numbers."""
    stats = kv_stats(bm)
    values = {name: getattr(stats, name) for name in stats.__dataclass_fields__}
    values.update(usage=stats.usage, slot_utilization=stats.slot_utilization,
                  prefix_cache_hit_rate=stats.prefix_cache_hit_rate)
    return values


def take_snapshot(
    bm: BlockManager,
    queues: Iterable[tuple[str, Iterable]] = (),
    written_block_ids: Iterable[int] = (),
    extra_counters: dict[str, float] | None = None,
    max_waiting: int = 256,
) -> KVSnapshot:
    """A snapshot of ``bm`` and the requests of ``queues`` ((status, requests) pairs).

    Only the first ``max_waiting`` requests of the ``waiting`` queue are listed
    (``counters["num_waiting_listed"]`` says how many); every running and swapped one is.
    """
    requests = []
    for status, queue in queues:
        items = itertools.islice(queue, max_waiting) if status == "waiting" else queue
        requests.extend(request_view(bm, request, status) for request in items)
    counters = counters_of(bm)
    counters["num_waiting_listed"] = sum(1 for r in requests if r.status == "waiting")
    counters.update(extra_counters or {})
    return KVSnapshot(
        time=time.time(),
        block_size=bm.block_size,
        device_cells=device_cells(bm, written_block_ids),
        cpu_cells=cpu_cells(bm),
        requests=tuple(requests),
        counters=counters,
    )


def snapshot_engine(engine, written_block_ids: Iterable[int] = ()) -> KVSnapshot:
    """A snapshot of an LLMEngine (call on the thread that steps it).

    Reads ``engine.block_manager``, ``engine.scheduler``'s three queues and the
    engine's token totals; nothing else of the engine.
    """
    scheduler = engine.scheduler
    extra = {
        "num_running_reqs": len(scheduler.running),
        "num_waiting_reqs": len(scheduler.waiting),
        "num_swapped_reqs": len(scheduler.swapped),
        "num_running_seqs": sum(len(r.live_seqs()) for r in scheduler.running),
        "num_preemptions_total": scheduler.num_preemptions,
        "num_prompt_tokens_total": getattr(engine, "num_prompt_tokens_total", 0),
        "num_generation_tokens_total": getattr(engine, "num_generation_tokens_total", 0),
    }
    queues = (("running", scheduler.running), ("swapped", scheduler.swapped), ("waiting", scheduler.waiting))
    return take_snapshot(engine.block_manager, queues, written_block_ids, extra)
