"""The dashboard's snapshot builder: exact cell states of block managers in known states."""

from __future__ import annotations

import itertools

import numpy as np

from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence
from pagedllm.kv.block_manager import BlockCopy, BlockManager
from pagedllm.kv.snapshot import (
    CellState,
    cpu_cells,
    decode_field,
    device_cells,
    kv_stats,
    pack_cells,
    snapshot_engine,
    take_snapshot,
    unpack_cells,
)
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams

F, U, S, C, W, X, R = (
    CellState.FREE, CellState.USED, CellState.SHARED, CellState.CACHED,
    CellState.SWAPPED, CellState.COPIED, CellState.RESERVED,
)


def cells(packed: bytes) -> tuple[list[CellState], list[int]]:
    states, refs = unpack_cells(packed)
    return [CellState(s) for s in states], refs.tolist()


def test_pack_round_trips_and_saturates_the_ref_count():
    states = np.array([F, U, S, C, W, X, R], dtype=np.uint8)
    refs = np.array([0, 1, 2, 0, 40, 1, 1])
    got_states, got_refs = unpack_cells(pack_cells(states, refs))
    assert got_states.tolist() == states.tolist()
    assert got_refs.tolist() == [0, 1, 2, 0, 31, 1, 1]


def test_fork_copy_on_write_prefix_hit_cached_and_reserved_cells():
    bm = BlockManager(10, 8, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(1, 21))  # 20 tokens: blocks 0, 1 full, block 2 holds 4
    assert bm.allocate(0, prompt) == 0
    bm.cache_full_blocks(0, prompt, 20)  # blocks 0 and 1 become findable
    bm.fork(0, 1)  # 0, 1, 2 at ref 2
    assert bm.append_slots(1, 1) == [BlockCopy(src=2, dst=3)]  # seq 1 writes position 20
    # Same first 16 tokens: a prefix hit on blocks 0 and 1, a fresh block 4 for the tail.
    assert bm.allocate(2, prompt[:16] + [99, 98]) == 16
    other = list(range(100, 109))  # 9 tokens: blocks 5 (full, hashed) and 6
    bm.allocate(3, other)
    bm.cache_full_blocks(3, other, 9)
    bm.free(3)  # block 5 keeps its hash (cached), block 6 is plainly free
    bm.allocate(4, [7, 7, 7], num_reserved_tokens=20)  # blocks 7, 8, 9: only 7 holds tokens
    bm.check_invariants()

    assert bm.take_recent_writes() == [3]
    states, refs = cells(device_cells(bm, [3]))
    assert states == [S, S, U, X, U, C, F, U, R, R]
    assert refs == [3, 3, 1, 1, 1, 0, 0, 1, 1, 1]
    # Without recent writes the copy target is an ordinary used block.
    assert cells(device_cells(bm))[0][3] is U
    assert bm.take_recent_writes() == []
    assert kv_stats(bm) == bm.stats()


def test_swapped_group_shows_in_the_cpu_pool_and_swap_in_targets_as_copied():
    bm = BlockManager(8, 8, num_cpu_blocks=4, enable_prefix_caching=False, watermark=0.0)
    bm.allocate(0, list(range(12)))  # blocks 0, 1
    bm.fork(0, 1)
    assert bm.swap_out([0, 1]) == [(0, 0), (1, 1)]
    bm.check_invariants()
    assert cells(device_cells(bm)) == ([F] * 8, [0] * 8)
    assert cells(cpu_cells(bm)) == ([W, W, F, F], [2, 2, 0, 0])
    assert kv_stats(bm) == bm.stats()

    assert bm.swap_in([0, 1]) == [(0, 2), (1, 3)]
    bm.check_invariants()
    states, refs = cells(device_cells(bm, bm.take_recent_writes()))
    assert states == [F, F, X, X, F, F, F, F]
    assert refs == [0, 0, 2, 2, 0, 0, 0, 0]
    assert cells(device_cells(bm, bm.take_recent_writes()))[0][2:4] == [S, S]
    assert cells(cpu_cells(bm)) == ([F] * 4, [0] * 4)


_seq_ids = itertools.count()  # unique ids across this file's sequences (an engine numbers its own)


def _request(rid: str, tokens: list[int], n: int = 1) -> Request:
    request = Request(rid, None, list(tokens), SamplingParams(n=n, max_tokens=32), RequestMetrics(0.0))
    request.seqs.append(Sequence(prompt_len=len(tokens), token_ids=list(tokens), seq_id=next(_seq_ids)))
    return request


def _step(scheduler: Scheduler, token: int = 5) -> None:
    out = scheduler.schedule()
    scheduler.on_step_computed(out)
    for chunk, (_, seq) in zip(out.chunks, out.entries):
        if chunk.needs_logits:
            seq.token_ids.append(token)


class _Engine:
    """What snapshot_engine reads of an LLMEngine."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0


def test_requests_list_their_tables_in_logical_order_with_forks_and_prefix_hits():
    bm = BlockManager(16, 8, enable_prefix_caching=True, watermark=0.0)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=128)
    scheduler = Scheduler(config, bm)
    prompt = list(range(1, 20))  # 19 tokens: 3 blocks
    a = _request("a", prompt, n=2)
    scheduler.add_request(a)
    _step(scheduler)  # a's prompt computed and its first token sampled
    child = a.seqs[0].fork(1, seq_id=next(_seq_ids))  # what the output processor does for n=2
    a.seqs.append(child)
    scheduler.fork_seq(a.seqs[0], child)
    b = _request("b", prompt[:16] + [50, 51])  # shares a's two full blocks
    c = _request("c", [9] * 30)
    for request in (b, c):
        scheduler.add_request(request)
    _step(scheduler)  # b is admitted (max_num_seqs=2), c waits
    bm.check_invariants()

    writes = bm.take_recent_writes()
    snapshot = snapshot_engine(_Engine(scheduler), writes)
    by_id = {r.request_id: r for r in snapshot.requests}
    assert [r.request_id for r in snapshot.requests] == ["a", "b", "c"]
    assert [by_id[k].status for k in "abc"] == ["running", "running", "waiting"]
    assert by_id["b"].num_cached_tokens == 16 and by_id["c"].seqs == ()
    a_view = by_id["a"]
    assert [s.seq_id for s in a_view.seqs] == [a.seqs[0].seq_id, child.seq_id]
    for seq in a_view.seqs:
        assert list(seq.block_table) == bm.get_block_table(seq.seq_id)
    # Both samples share the prompt's full blocks; the first to write copied the partial last one.
    parent_table, child_table = (s.block_table for s in a_view.seqs)
    assert parent_table[:2] == child_table[:2] and parent_table[2] != child_table[2]
    assert writes == [parent_table[2]]
    assert by_id["b"].seqs[0].block_table[:2] == parent_table[:2]

    states, refs = cells(snapshot.device_cells)
    assert states[parent_table[0]] is S and refs[parent_table[0]] == 3  # a, its child and b
    assert states[parent_table[2]] is X and states[child_table[2]] is U  # copy target, original
    counts = snapshot.cell_counts()
    assert counts["shared"] == snapshot.counters["num_shared_blocks"] == 2
    in_use = counts["used"] + counts["shared"] + counts["copied"] + counts["reserved"]
    assert in_use == snapshot.counters["num_used_blocks"]
    assert snapshot.counters["num_running_seqs"] == 3
    assert snapshot.counters["num_waiting_listed"] == 1
    assert kv_stats(bm) == bm.stats()


def test_json_carries_the_tables_and_cells_exactly():
    bm = BlockManager(12, 8, num_cpu_blocks=2, enable_prefix_caching=False, watermark=0.0)
    bm.allocate(0, list(range(30)))  # blocks 0..3
    bm.allocate(1, list(range(5)))  # block 4
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    for rid, seq_id, n in (("x", 0, 30), ("y", 1, 5)):
        request = _request(rid, list(range(n)))
        request.seqs[0].seq_id = seq_id
        scheduler.running.append(request)
    snapshot = take_snapshot(bm, [("running", scheduler.running)])
    data = snapshot.to_json()
    assert data["num_blocks"] == 12 and data["num_cpu_blocks"] == 2
    assert decode_field(data["device"]) == snapshot.device_cells
    assert decode_field(data["cpu"]) == snapshot.cpu_cells
    tables = np.frombuffer(decode_field(data["tables"]), dtype="<i4").tolist()
    assert tables == [0, 1, 2, 3, 4]
    assert [r["seqs"] for r in data["requests"]] == [[[0, 0, 4, 30, 0]], [[1, 4, 1, 5, 0]]]
    assert cells(snapshot.device_cells)[0] == [U] * 5 + [F] * 7
    bm.check_invariants()


def test_numpy_stats_equal_the_managers_own_under_random_operations():
    import random

    rng = random.Random(7)
    bm = BlockManager(64, 8, num_cpu_blocks=32, enable_prefix_caching=True, watermark=0.0)
    live: list[int] = []
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
            if bm.can_allocate(tokens):
                bm.allocate(next_id, tokens)
                bm.cache_full_blocks(next_id, tokens, len(tokens))
                live.append(next_id)
                next_id += 1
        elif op < 0.45:
            parent = rng.choice(live)
            if not bm.is_swapped(parent):
                bm.fork(parent, next_id)
                live.append(next_id)
                next_id += 1
        elif op < 0.75:
            seq = rng.choice(live)
            if not bm.is_swapped(seq) and bm.can_append_slots(seq, 3):
                bm.append_slots(seq, 3)
        elif op < 0.85:
            seq = rng.choice(live)
            if bm.is_swapped(seq) and bm.can_swap_in([seq]):
                bm.swap_in([seq])
            elif not bm.is_swapped(seq) and bm.can_swap_out([seq]):
                bm.swap_out([seq])
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        assert kv_stats(bm) == bm.stats()
        counts = take_snapshot(bm).cell_counts()
        in_use = counts["used"] + counts["shared"] + counts["copied"] + counts["reserved"]
        assert in_use == bm.stats().num_used_blocks
        assert counts["cached"] == bm.stats().num_cached_blocks
    bm.check_invariants()
