"""The tensor-parallel plumbing on two real gloo processes: the step channel, the logits gather,
the all-reduce's accounting, and the MLP split that evens out the ranks' work."""

from __future__ import annotations

import copy
import datetime
import math
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed import (
    ALL_REDUCE_ENV,
    SHARED_HEADS_ENV,
    SharedHeadRows,
    TensorParallelGroup,
    attach_shared_memory,
    attention_weight_count,
    balanced_range,
    head_shard,
)
from pagedllm.models.llama import ATTENTION_WORK_PER_QUERY_HEAD, mlp_shard
from pagedllm.step import ScheduledSeq, StepInput
from pagedllm.worker.executor import StepChannel

SMOLLM2 = types.SimpleNamespace(num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64, intermediate_size=1536)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _messages() -> list:
    small = StepInput(3, scheduled=[ScheduledSeq(i, 100 + i, 1, None, 7, []) for i in range(64)])
    # a prefill step whose pickle is several times the channel's frame
    large = StepInput(4, scheduled=[ScheduledSeq(1, 0, 50_000, list(range(50_000)), 0, list(range(3000)))])
    return [small, large, "stop"]


def _rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    tp = TensorParallelGroup(rank=rank, size=2, group=dist.group.WORLD, control_group=dist.group.WORLD)
    channel = StepChannel(tp)
    if rank == 0:
        for message in _messages():
            channel.send(message)
        received = None
    else:
        received = [channel.receive() for _ in _messages()]
    # logits of 5 columns split 3 | 2: rank r's column j holds 10 * (first column + j) + row
    first, end = tp.shard(5)
    local = torch.tensor([[10.0 * c + row for c in range(first, end)] for row in range(2)])
    gathered = tp.gather_columns(local, 5)
    summed = tp.all_reduce(torch.full((4, 3), float(rank + 1)))
    times = copy.deepcopy(tp.times)  # before the shared-memory calls below
    # column gathers, 2 | 3 columns of 5 (rank r's column c holds 100 r + 10 c + row): over gloo
    # (no slots yet), then through the slots on both parities, then one too wide for a slot
    def columns(rows: int) -> torch.Tensor:
        return torch.tensor([[100.0 * rank + 10 * c + row for c in range(first, end)] for row in range(rows)])

    gathers = [tp.all_gather_columns(columns(2), first, 5)]
    overlapping = [overlap_gather(tp, rank, 4, 1)]  # over gloo: zero-padded, summed
    # the shared-memory all-reduce: many calls in a row (both parities of its slots), one too
    # large for a slot (gloo), and bit-equal sums on both ranks
    os.environ[ALL_REDUCE_ENV] = "shm"  # opt in (gloo is the default)
    attach_shared_memory(tp, slot_bytes=4 * 64, timeout_s=30)
    gen = torch.Generator().manual_seed(rank)
    shm_sums = [tp.all_reduce(torch.randn(4, 16, generator=gen)) for _ in range(5)]
    shm_sums.append(tp.all_reduce(torch.randn(8, 16, generator=gen)))  # 512 bytes > 256: gloo
    reduces_before = tp.times.all_reduce.num_calls
    gathers += [tp.all_gather_columns(columns(rows), first, 5) for rows in (2, 3, 1)]
    signed = columns(1)
    signed[0, 0] = -0.0  # this rank's first column; moved, not added: the sign of a zero survives
    gathers.append(tp.all_gather_columns(signed, first, 5))
    gathers.append(tp.all_gather_columns(columns(12), first, 5))  # 64 + 12 x 3 x 4 bytes > 256: gloo
    gather_calls = tp.times.all_reduce.num_calls - reduces_before
    overlapping += [overlap_gather(tp, rank, rows, split) for rows, split in ((4, 1), (3, 0), (3, 3), (5, 2))]
    signs = [math.copysign(1.0, v) for v in gathers[-2][0].tolist()]
    # plain lists through the queue: torch would share tensors by file descriptor, gone with the process
    gathered = None if gathered is None else gathered.tolist()
    results.put((rank, received, gathered, summed.tolist(), times, [t.tolist() for t in shm_sums],
                 [g.tolist() for g in gathers], gather_calls, signs, [g.tolist() for g in overlapping]))
    dist.destroy_process_group()


def overlap_gather(tp: TensorParallelGroup, rank: int, rows: int, split: int) -> torch.Tensor:
    """Columns 0-2 | 2-4 of 5 (rank r's column c holds 100 r + 10 c + row, and garbage in the rows of
    the shared column 2 the other rank computes), rows of column 2 from rank 0 before ``split``."""
    first = 0 if rank == 0 else 2
    x = torch.tensor([[100.0 * rank + 10 * c + row for c in range(first, first + 3)] for row in range(rows)])
    local = 2 if rank == 0 else 0  # the shared column
    owned = (0, split) if rank == 0 else (split, rows)
    x[[r for r in range(rows) if not owned[0] <= r < owned[1]], local] = float("nan")
    shared = SharedHeadRows(((0, rows),), ((local, local + 1, *owned),), (split,))
    return tp.all_gather_columns(shared.zero_unowned(x), first, 5, shared.overlaps)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in processes:
        p.start()
    out = {}
    for _ in processes:
        rank, *rest = results.get(timeout=120)
        out[rank] = rest
    for p in processes:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


def test_column_gathers_take_a_shared_column_from_the_rank_that_computed_each_row(two_ranks):
    """A shared KV head's columns (here column 2 of 5, held by both ranks): rows before the split
    from rank 0, the rest from rank 1, over gloo and through the slots; the other rank's rows
    (NaN here) never leak in."""

    def want(rows: int, split: int) -> list:
        return [[(100.0 if c > 2 or (c == 2 and row >= split) else 0.0) + 10 * c + row for c in range(5)]
                for row in range(rows)]

    for rank in (0, 1):
        assert two_ranks[rank][8] == [want(4, 1), want(4, 1), want(3, 0), want(3, 3), want(5, 2)]


def test_step_channel_delivers_small_and_oversized_messages_intact(two_ranks):
    received = two_ranks[1][0]
    assert received == _messages()
    sender_times, receiver_times = two_ranks[0][3], two_ranks[1][3]
    assert sender_times.step_message.num_calls == receiver_times.step_message.num_calls == 3
    assert sender_times.step_message.num_bytes == receiver_times.step_message.num_bytes > StepChannel.FRAME_BYTES


def test_logits_gather_lands_on_the_first_rank_only(two_ranks):
    want = torch.tensor([[10.0 * c + row for c in range(5)] for row in range(2)])
    assert two_ranks[0][1] == want.tolist()
    assert two_ranks[1][1] is None
    for rank in (0, 1):
        gather = two_ranks[rank][3].logits_gather
        assert gather.num_calls == 1 and gather.num_bytes == 2 * 3 * 4  # padded to the widest shard


def test_all_reduce_sums_and_counts_its_bytes(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank][2] == [[3.0] * 3] * 4
        cost = two_ranks[rank][3].all_reduce
        assert (cost.num_calls, cost.num_bytes) == (1, 4 * 3 * 4)
        assert cost.seconds > 0


def test_shared_memory_all_reduce_sums_bit_equal_on_every_rank(two_ranks):
    rank0, rank1 = two_ranks[0][4], two_ranks[1][4]
    assert len(rank0) == len(rank1) == 6
    assert rank0 == rank1  # bit for bit
    # the first call's inputs, regenerated: the sum is the plain sum
    first = [torch.randn(4, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    assert rank0[0] == (first[0] + first[1]).tolist()
    assert not any(name.startswith("pagedllm-tp-") for name in os.listdir("/dev/shm"))


def test_single_process_collectives_are_the_identity_and_cost_nothing():
    tp = TensorParallelGroup()
    x = torch.ones(2, 3)
    assert tp.all_reduce(x) is x and tp.gather_columns(x, 3) is x
    assert tp.times.all_reduce.num_calls == tp.times.logits_gather.num_calls == 0


def test_balanced_range_evens_out_fixed_work():
    assert [balanced_range(10, 1.0, [0.0, 0.0], r) for r in range(2)] == [(0, 5), (5, 10)]
    assert [balanced_range(10, 1.0, [4.0, 0.0], r) for r in range(2)] == [(0, 3), (3, 10)]
    # a rank whose fixed work is past the average takes no items
    assert [balanced_range(4, 1.0, [0.0, 20.0], r) for r in range(2)] == [(0, 4), (4, 4)]


def test_smollm2_mlp_split_gives_the_rank_with_fewer_heads_more_features(monkeypatch):
    monkeypatch.setenv(SHARED_HEADS_ENV, "0")  # whole KV heads: 3 and 6 query heads
    shards = [mlp_shard(SMOLLM2, TensorParallelGroup(rank=r, size=2)) for r in range(2)]
    assert shards == [(0, 997), (997, 1536)]
    work = []
    for r, (start, end) in enumerate(shards):
        heads = head_shard(9, 3, 2, r)
        attention = attention_weight_count(heads, 576, 64) + ATTENTION_WORK_PER_QUERY_HEAD * heads.num_q * 576 * 64
        work.append(attention + 3 * 576 * (end - start))
    assert abs(work[0] - work[1]) <= 3 * 576  # within one feature's weights
    # the default shares the middle KV head's rows: 4.5 query heads' attention each, an even MLP
    monkeypatch.delenv(SHARED_HEADS_ENV)
    assert [mlp_shard(SMOLLM2, TensorParallelGroup(rank=r, size=2)) for r in range(2)] == [(0, 768), (768, 1536)]
    assert [head_shard(9, 3, 2, r).query_head_work(3) for r in range(2)] == [4.5, 4.5]
    # heads that split evenly keep the even split
    llama8b = types.SimpleNamespace(num_heads=32, num_kv_heads=8, hidden_size=4096, head_dim=128,
                                    intermediate_size=14336)
    assert [mlp_shard(llama8b, TensorParallelGroup(rank=r, size=4)) for r in range(4)] == [
        (0, 3584), (3584, 7168), (7168, 10752), (10752, 14336)
    ]
    assert mlp_shard(SMOLLM2, TensorParallelGroup()) == (0, 1536)


def test_column_gathers_give_every_rank_the_whole_tensor(two_ranks):
    """Uneven shards (2 | 3 columns), over gloo before the slots exist, through the slots on both
    parities and at several row counts, and over gloo again when a shard is too large for a slot."""

    def want(rows: int) -> list:
        return [[100.0 * (0 if c < 2 else 1) + 10 * c + row for c in range(5)] for row in range(rows)]

    for rank in (0, 1):
        gathers, calls, signs = two_ranks[rank][5], two_ranks[rank][6], two_ranks[rank][7]
        assert gathers[:4] == [want(2), want(2), want(3), want(1)]
        assert gathers[5] == want(12)
        assert calls == 5  # each gather counted with the collectives
        # through the slots the values move: each rank's -0.0 (its first column) stays -0.0
        assert signs == [-1.0, 1.0, -1.0, 1.0, 1.0]
