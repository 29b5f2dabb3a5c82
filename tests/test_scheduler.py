"""Scheduler decisions on plain requests (no model): budgets, chunking, admission, preemption."""

from __future__ import annotations

import pytest

from pagedllm.engine.scheduler import MemoryOpKind, Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.sequence import FinishReason, Request, SeqStatus, Sequence
from pagedllm.kv.block_manager import BlockManager
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, first_token: int = 1, n: int = 1) -> Request:
    tokens = [first_token + i for i in range(prompt_len)]
    req = Request(rid, None, tokens, SamplingParams(n=n, max_tokens=64), RequestMetrics(0.0))
    req.seqs.append(Sequence(prompt_len=prompt_len, token_ids=list(tokens)))
    return req


def make_scheduler(num_blocks=32, budget=64, max_seqs=8, mode="recompute", swap_blocks=0, caching=False):
    bm = BlockManager(num_blocks, 8, num_cpu_blocks=swap_blocks, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          preemption_mode=mode)
    return Scheduler(cfg, bm)


def run_step(sched: Scheduler, sampled_token: int = 7):
    """Pretend the forward pass ran: advance counts, append a token to completed sequences."""
    out = sched.schedule()
    sched.on_step_computed(out)
    for chunk, (_, seq) in zip(out.chunks, out.entries):
        if chunk.needs_logits:
            seq.token_ids.append(sampled_token)
    sched.block_manager.check_invariants()
    return out


def test_prefill_is_chunked_by_the_token_budget_and_decode_goes_first():
    sched = make_scheduler(budget=16)
    a = make_request("a", 20)
    sched.add_request(a)
    out = run_step(sched)
    assert [len(c.token_ids) for c in out.chunks] == [16]
    assert not out.chunks[0].needs_logits and out.chunks[0].start_pos == 0
    b = make_request("b", 30)
    sched.add_request(b)
    out = run_step(sched)
    # a finishes its prompt (4 tokens, logits wanted); b takes the remaining 12
    assert [(c.start_pos, len(c.token_ids), c.needs_logits) for c in out.chunks] == [(16, 4, True), (0, 12, False)]
    out = run_step(sched)
    # a decodes one token first, then b continues
    assert [(c.seq_id, len(c.token_ids)) for c in out.chunks] == [(a.seqs[0].seq_id, 1), (b.seqs[0].seq_id, 15)]


def test_slot_mapping_inputs_follow_the_block_table():
    sched = make_scheduler(budget=64)
    req = make_request("a", 10)
    sched.add_request(req)
    out = run_step(sched)
    table = sched.block_manager.get_block_table(req.seqs[0].seq_id)
    assert out.chunks[0].block_table == table == [0, 1]
    out = run_step(sched)
    assert out.chunks[0].start_pos == 10 and out.chunks[0].token_ids == [7]


def test_admission_is_fcfs_and_a_long_prompt_is_not_starved():
    sched = make_scheduler(num_blocks=10, budget=256)
    sched.add_request(make_request("short1", 16))
    long_req = make_request("long", 70, first_token=100)  # 9 blocks: must wait for short1
    sched.add_request(long_req)
    sched.add_request(make_request("short2", 8, first_token=300))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["short1"]
    assert [r.request_id for r in sched.waiting] == ["long", "short2"]  # short2 does not jump ahead
    sched.finish_request(sched.running[0], FinishReason.STOP)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["long", "short2"]


def test_preemption_recompute_takes_the_most_recent_request():
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_request("a", 15), make_request("b", 16, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: 2 blocks, b: 2 blocks, pool full
    assert sched.block_manager.get_num_free_blocks() == 0
    run_step(sched)  # a decodes in place (slot 15); b needs a third block -> b preempted
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.waiting[0] is b and b.status == SeqStatus.WAITING
    assert b.seqs[0].num_computed_tokens == 0 and not sched.block_manager.has_seq(b.seqs[0].seq_id)
    assert sched.num_preemptions == 1 and sched.block_manager.stats().num_preemptions == 1


def test_preemption_by_swap_keeps_blocks_on_the_cpu_and_returns():
    sched = make_scheduler(num_blocks=4, budget=64, mode="swap", swap_blocks=8)
    a, b = make_request("a", 15), make_request("b", 16, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    out = run_step(sched)
    assert len(out.swap_out) == 2 and b.status == SeqStatus.SWAPPED
    assert sched.block_manager.is_swapped(b.seqs[0].seq_id)
    sched.finish_request(a, FinishReason.STOP)
    out = run_step(sched)
    assert len(out.swap_in) == 2 and b.status == SeqStatus.RUNNING
    # b resumes where it stopped: its first sampled token (position 16) is computed now
    assert out.chunks[0].start_pos == 16 and b.seqs[0].num_computed_tokens == 17


def test_prompt_larger_than_the_cache_fails_without_hanging():
    sched = make_scheduler(num_blocks=4)
    big = make_request("big", 40)
    sched.add_request(big)
    out = sched.schedule()
    assert out.failed == [big] and big.status == SeqStatus.FINISHED
    assert big.seqs[0].finish_reason == FinishReason.ERROR and "KV" in big.error
    assert not sched.has_unfinished_requests()


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2, budget=256)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4, first_token=10 * i + 1))
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_finish_request_returns_every_block():
    sched = make_scheduler()
    reqs = [make_request(f"r{i}", 9 + i, first_token=20 * i + 1) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_step(sched)
    for r in reqs:
        sched.finish_request(r, FinishReason.ABORT)
    stats = sched.block_manager.stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == 32
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("budget", [4, 7])
def test_multi_sequence_requests_advance_in_lockstep(budget):
    sched = make_scheduler(budget=64)
    req = make_request("a", 10)
    sched.add_request(req)
    run_step(sched)
    child = req.seqs[0].fork(1)
    sched.fork_seq(req.seqs[0], child)
    req.seqs.append(child)
    child.token_ids[-1] = 9  # the two samples differ
    # recompute both from scratch with a small budget: logits come for both in the same step
    for seq in req.seqs:
        sched.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
    sched.running.remove(req)
    sched.waiting.appendleft(req)
    sched.config = SchedulerConfig(8, budget, 1024)
    while True:
        out = run_step(sched)
        flags = [c.needs_logits for c in out.chunks]
        assert all(flags) or not any(flags)
        if all(flags) and flags:
            break
    assert [s.num_computed_tokens for s in req.seqs] == [11, 11]


def test_recomputed_group_shares_its_full_prompt_blocks_again():
    sched = make_scheduler(num_blocks=32, budget=256)
    req = make_request("a", 20, n=3)
    sched.add_request(req)
    run_step(sched)  # prefill; seqs[0] samples its first token
    parent = req.seqs[0]
    for i in (1, 2):
        child = parent.fork(i)
        child.token_ids[-1] = 10 + i
        sched.fork_seq(parent, child)
        req.seqs.append(child)
    req.forked = True
    run_step(sched)
    sched._preempt(req, SchedulerOutput())
    assert req.status == SeqStatus.WAITING and sched.block_manager.stats().num_used_blocks == 0
    out = run_step(sched)
    bm = sched.block_manager
    tables = [bm.get_block_table(s.seq_id) for s in req.seqs]
    # the 2 full prompt blocks (16 of 20 tokens) are shared by all three; the rest is private
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert bm.stats().num_used_blocks == 2 + 3
    # one pass computes everything: seqs[0] from 0, the others from the shared boundary
    assert [(c.start_pos, c.needs_logits) for c in out.chunks] == [(0, True), (16, True), (16, True)]


def test_memory_ops_keep_the_order_they_were_decided_in():
    out = SchedulerOutput()
    out.add_memory_op(MemoryOpKind.SWAP_IN, [(0, 3)])
    out.add_memory_op(MemoryOpKind.COPY, [(1, 2)])
    out.add_memory_op(MemoryOpKind.COPY, [(4, 5)])  # merged into one batched copy
    out.add_memory_op(MemoryOpKind.SWAP_OUT, [(3, 1)])
    out.add_memory_op(MemoryOpKind.SWAP_OUT, [])
    assert [(op.kind, op.pairs) for op in out.memory_ops] == [
        (MemoryOpKind.SWAP_IN, [(0, 3)]),
        (MemoryOpKind.COPY, [(1, 2), (4, 5)]),
        (MemoryOpKind.SWAP_OUT, [(3, 1)]),
    ]
    assert out.block_copies == [(1, 2), (4, 5)] and out.swap_in == [(0, 3)] and out.swap_out == [(3, 1)]
