"""Scheduler decisions on plain requests (no model): budgets, chunking, admission, preemption."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.scheduler import MemoryOpKind, Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.sequence import FinishReason, Request, SeqStatus, Sequence
from pagedllm.errors import ConfigError, RequestError
from pagedllm.kv.block_manager import BlockManager
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams

_seq_ids = itertools.count()  # unique ids across this file's sequences (an engine numbers its own)


def make_request(
    rid: str, prompt_len: int, first_token: int = 1, n: int = 1, max_tokens: int = 64
) -> Request:
    tokens = [first_token + i for i in range(prompt_len)]
    req = Request(rid, None, tokens, SamplingParams(n=n, max_tokens=max_tokens), RequestMetrics(0.0))
    req.seqs.append(Sequence(prompt_len=prompt_len, token_ids=list(tokens), seq_id=next(_seq_ids)))
    return req


def fork(seq: Sequence, sample_index: int) -> Sequence:
    return seq.fork(sample_index, seq_id=next(_seq_ids))


def make_scheduler(num_blocks=32, budget=64, max_seqs=8, mode="recompute", swap_blocks=0, caching=False,
                   headroom=16, headroom_fraction=0.1):
    """Block size 8; ``headroom`` is num_headroom_tokens (0: admit whenever the prompt fits)."""
    bm = BlockManager(num_blocks, 8, num_cpu_blocks=swap_blocks, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          preemption_mode=mode, num_headroom_tokens=headroom,
                          max_headroom_fraction=headroom_fraction)
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
    sched = make_scheduler(num_blocks=10, budget=256, headroom=0)
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
    sched = make_scheduler(num_blocks=4, budget=64, headroom=0)  # admit both: the cache overcommits
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
    sched = make_scheduler(num_blocks=4, budget=64, mode="swap", swap_blocks=8, headroom=0)
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
    child = fork(req.seqs[0], 1)
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
        child = fork(parent, i)
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


# ---- admission headroom (block size 8) ---------------------------------------------


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def make_headroom_scheduler(num_blocks, headroom=16, **options):
    """No cap on the reserve: in caches this small the default (a tenth) would hide the rule."""
    return make_scheduler(num_blocks=num_blocks, budget=256, headroom=headroom, headroom_fraction=1.0, **options)


@pytest.mark.parametrize(("num_blocks", "admitted"), [(11, ["a", "b"]), (12, ["a", "b", "c"])])
def test_admission_keeps_headroom_for_every_running_sequence(num_blocks, admitted):
    sched = make_headroom_scheduler(num_blocks)  # 16 tokens of headroom: 2 blocks each
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 16, first_token=100 * i + 1))
    run_step(sched)
    # a: 2 blocks, alone so no headroom. b: 2 + its own 2 + a's 2. c: 2 + 2 + 4, and
    # 11 - 4 = 7 blocks are free with 11 blocks, 8 with 12.
    assert ids(sched.running) == admitted
    tables = [sched.block_manager.get_block_table(r.seqs[0].seq_id) for r in sched.running]
    assert tables[:2] == [[0, 1], [2, 3]]
    assert sched.block_manager.get_num_free_blocks() == num_blocks - 2 * len(admitted)


def test_without_headroom_every_prompt_that_fits_is_admitted():
    sched = make_headroom_scheduler(11, headroom=0)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 16, first_token=100 * i + 1))
    run_step(sched)
    assert ids(sched.running) == ["a", "b", "c"] and sched.block_manager.get_num_free_blocks() == 5


def test_headroom_stops_at_max_tokens():
    sched = make_headroom_scheduler(11)
    sched.add_request(make_request("a", 15, max_tokens=1))  # final length 16: its 2 blocks hold it
    sched.add_request(make_request("b", 16, first_token=101))
    sched.add_request(make_request("c", 16, first_token=201))
    run_step(sched)
    # c: 2 + its own 2 + b's 2 = 6 of the 7 free (with max_tokens=64, a would reserve 2 more: see above)
    assert ids(sched.running) == ["a", "b", "c"] and sched.block_manager.get_num_free_blocks() == 5


def test_a_request_alone_is_admitted_without_headroom():
    sched = make_headroom_scheduler(4)
    big, small = make_request("big", 30), make_request("small", 8, first_token=101)
    sched.add_request(big)
    sched.add_request(small)
    run_step(sched)
    assert ids(sched.running) == ["big"] and ids(sched.waiting) == ["small"]
    assert sched.block_manager.get_num_free_blocks() == 0
    for _ in range(2):  # positions 30 and 31 fill its last block
        run_step(sched)
    out = run_step(sched)  # position 32 needs a fifth block: the cache cannot hold it
    assert out.failed == [big] and "too small" in big.error
    run_step(sched)
    assert ids(sched.running) == ["small"]


def test_a_preempted_request_returns_only_with_headroom():
    sched = make_headroom_scheduler(7, headroom=8)  # 1 block each
    a, b = make_request("a", 16), make_request("b", 16, first_token=101)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: 2 blocks; b: 2 + 1 + a's 1 = 4 of the 5 free
    assert ids(sched.running) == ["a", "b"]
    sched._preempt(b, SchedulerOutput())  # b now needs ceil(17 / 8) = 3 blocks
    run_step(sched)
    # a took its third block: 4 free; b needs 3 + its own 1 + a's 1 = 5
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b"]
    assert sched.block_manager.get_num_free_blocks() == 4
    sched.finish_request(a, FinishReason.STOP)
    out = run_step(sched)
    assert ids(sched.running) == ["b"]
    assert [(c.start_pos, len(c.token_ids)) for c in out.chunks] == [(0, 17)]  # recomputed whole


def test_without_headroom_a_preempted_request_returns_as_soon_as_it_fits():
    sched = make_headroom_scheduler(7, headroom=0)
    a, b = make_request("a", 16), make_request("b", 16, first_token=101)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    sched._preempt(b, SchedulerOutput())
    run_step(sched)
    assert ids(sched.running) == ["a", "b"] and sched.block_manager.get_num_free_blocks() == 1


@pytest.mark.parametrize(("headroom", "swapped_in"), [(8, False), (0, True)])
def test_swap_in_waits_for_the_running_sequences_headroom(headroom, swapped_in):
    sched = make_headroom_scheduler(7, headroom=headroom, mode="swap", swap_blocks=8)
    a, b = make_request("a", 16), make_request("b", 16, first_token=101)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    sched._preempt(b, SchedulerOutput())  # b's 2 blocks go to the CPU
    out = run_step(sched)
    # 4 free after a's third block; b's 2 blocks + 2 to step fit, + a's 1 of headroom does not
    assert (b.status == SeqStatus.RUNNING) is swapped_in
    assert len(out.swap_in) == (2 if swapped_in else 0)
    assert sched.block_manager.get_num_free_blocks() == (1 if swapped_in else 4)  # back, b took a third


@pytest.mark.parametrize(("num_blocks", "admitted"), [(7, False), (8, True)])
def test_headroom_counts_every_sequence_of_a_forked_request(num_blocks, admitted):
    sched = make_headroom_scheduler(num_blocks, headroom=8)
    a = make_request("a", 16, n=2)
    sched.add_request(a)
    run_step(sched)
    child = fork(a.seqs[0], 1)
    sched.fork_seq(a.seqs[0], child)
    a.seqs.append(child)
    a.forked = True
    sched.add_request(make_request("b", 8, first_token=101))
    run_step(sched)
    # a's two samples each took a third block; each reserves one more. b: 1 + its own 1 + 2
    assert ("b" in ids(sched.running)) is admitted
    assert sched.block_manager.get_num_free_blocks() == num_blocks - 4 - (1 if admitted else 0)


def test_headroom_is_an_engine_option_checked_at_the_boundary():
    assert EngineConfig().num_headroom_tokens == SchedulerConfig(8, 64, 1024).num_headroom_tokens == 16
    assert EngineConfig(num_headroom_tokens=0).num_headroom_tokens == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="num_headroom_tokens"):
            EngineConfig(num_headroom_tokens=bad)


@pytest.mark.parametrize(("fraction", "num_admitted"), [(1.0, 5), (0.1, 9)])
def test_the_reserve_never_holds_back_more_than_its_fraction_of_the_cache(fraction, num_admitted):
    sched = make_scheduler(num_blocks=20, budget=256, max_seqs=10, headroom_fraction=fraction)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", 16, first_token=100 * i + 1))
    run_step(sched)
    # Uncapped, the k-th request needs 2 + 2 * k blocks of the 20 - 2 * (k - 1) free: 5 fit.
    # Capped at 2 blocks (a tenth of 20), each needs 2 + 2: 9 fit, leaving 2.
    assert ids(sched.running) == [f"r{i}" for i in range(num_admitted)]
    assert sched.block_manager.get_num_free_blocks() == 20 - 2 * num_admitted


# ---- the steady decode fast path ----------------------------------------------------


def _random_run(seed: int, *, mode: str, caching: bool, num_steps: int = 120) -> tuple[list, int]:
    """A random mix of requests (samples, shared prefixes, prompt logprobs) on a small cache.

    Returns every step's output with sequence ids replaced by (request, sample) and the
    block ids kept, plus how often the steady decode fast path was taken.
    """
    rng = random.Random(seed)
    seq_ids = itertools.count()  # the run's own ids, so both runs number their sequences alike
    sched = make_scheduler(num_blocks=24, budget=20, max_seqs=6, mode=mode, swap_blocks=24, caching=caching)
    requests: list[Request] = []
    names: dict[int, tuple[str, int]] = {}
    num_fast = 0
    real_fast_path = sched._schedule_decode

    def counted(request, out):
        nonlocal num_fast
        taken = real_fast_path(request, out)
        num_fast += taken
        return taken

    sched._schedule_decode = counted
    steps = []
    for step in range(num_steps):
        if rng.random() < 0.3:
            prompt = [1 + rng.randrange(3) for _ in range(8)] + [rng.randrange(100) for _ in range(rng.randrange(1, 40))]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(n=n, max_tokens=rng.randrange(1, 40),
                                    prompt_logprobs=1 if rng.random() < 0.2 else None)
            req = Request(f"r{step}", None, prompt, params, RequestMetrics(0.0))
            req.seqs.append(Sequence(prompt_len=len(prompt), token_ids=list(prompt), seq_id=next(seq_ids)))
            sched.add_request(req)
            requests.append(req)
        out = sched.schedule()
        sched.on_step_computed(out)
        for req in requests:
            for index, seq in enumerate(req.seqs):
                names.setdefault(seq.seq_id, (req.request_id, index))
        steps.append((
            [(names[c.seq_id], c.token_ids, c.start_pos, c.block_table, c.needs_logits, c.all_logits)
             for c in out.chunks],
            [(op.kind, op.pairs) for op in out.memory_ops],
            [r.request_id for r in out.failed],
            out.num_batched_tokens,
        ))
        for chunk, (req, seq) in zip(out.chunks, out.entries):
            if not chunk.needs_logits or seq.is_finished or req.is_finished:
                continue
            if req.params.n > 1 and not req.forked:  # fan out as the output processor does
                req.forked = True
                for index in range(1, req.params.n):
                    child = seq.fork(index, seq_id=next(seq_ids))
                    sched.fork_seq(seq, child)
                    req.seqs.append(child)
            for target in [s for s in req.seqs if s is seq or not chunk.all_logits]:
                if target.num_tokens == target.num_computed_tokens:
                    target.token_ids.append(rng.randrange(100))
            for target in req.live_seqs():
                if target.num_output_tokens >= req.params.max_tokens or rng.random() < 0.02:
                    target.finish_reason = FinishReason.LENGTH
                    sched.finish_seq(req, target)
        sched.block_manager.check_invariants()
    return steps, num_fast


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("mode", "caching"), [("recompute", True), ("swap", False), ("auto", True)])
def test_steady_decode_fast_path_emits_what_the_general_path_does(seed, mode, caching, monkeypatch):
    fast, num_fast = _random_run(seed, mode=mode, caching=caching)
    monkeypatch.setattr(Scheduler, "_schedule_decode", lambda self, request, out: False)
    general, _ = _random_run(seed, mode=mode, caching=caching)
    assert num_fast > 50
    assert fast == general


def test_first_scheduled_time_is_the_first_admission_and_survives_preemption():
    sched = make_scheduler()
    req = make_request("a", 10)
    sched.add_request(req)
    assert req.metrics.first_scheduled_time is None
    run_step(sched)
    first = req.metrics.first_scheduled_time
    assert first is not None and first >= req.metrics.arrival_time
    sched._preempt(req, SchedulerOutput())  # by recompute: admitted again below
    assert req.status is SeqStatus.WAITING
    run_step(sched)
    assert req.status is SeqStatus.RUNNING and req.metrics.first_scheduled_time == first


def _prompt_request(rid: str, tokens: list[int], **params) -> Request:
    req = Request(rid, None, list(tokens), SamplingParams(max_tokens=4, **params), RequestMetrics(0.0))
    req.seqs.append(Sequence(prompt_len=len(tokens), token_ids=list(tokens), seq_id=next(_seq_ids)))
    return req


def test_prompt_logprobs_requests_read_no_cached_prefix_but_cache_their_blocks():
    sched = make_scheduler(num_blocks=32, budget=256, caching=True)
    prompt = list(range(1, 21))  # 20 tokens: 2 full blocks of 8
    first = _prompt_request("first", prompt, prompt_logprobs=1)
    sched.add_request(first)
    run_step(sched)
    plain = _prompt_request("plain", prompt)
    sched.add_request(plain)
    out = run_step(sched)
    assert plain.num_cached_tokens == 16  # the blocks the prompt-logprobs request computed
    assert [(c.start_pos, len(c.token_ids)) for c, (r, _) in zip(out.chunks, out.entries) if r is plain] == [(16, 4)]
    again = _prompt_request("again", prompt, prompt_logprobs=1)
    sched.add_request(again)
    out = run_step(sched)
    assert again.num_cached_tokens == 0  # logits at every prompt position: nothing reused
    ((chunk, _),) = [(c, r) for c, (r, _) in zip(out.chunks, out.entries) if r is again]
    assert (chunk.start_pos, len(chunk.token_ids), chunk.all_logits) == (0, 20, True)


def test_skip_reading_prefix_cache_computes_the_whole_prompt_and_still_caches_it():
    sched = make_scheduler(num_blocks=32, budget=256, caching=True)
    prompt = list(range(1, 21))  # 20 tokens: 2 full blocks of 8
    first = _prompt_request("first", prompt, skip_reading_prefix_cache=True)
    sched.add_request(first)
    run_step(sched)
    again = _prompt_request("again", prompt, skip_reading_prefix_cache=True)
    sched.add_request(again)
    out = run_step(sched)
    assert again.num_cached_tokens == 0  # the cache holds the prompt; the request reads none of it
    ((chunk, _),) = [(c, r) for c, (r, _) in zip(out.chunks, out.entries) if r is again]
    assert (chunk.start_pos, len(chunk.token_ids), chunk.all_logits) == (0, 20, False)  # no prompt logits
    for rid, skip in (("false", False), ("unset", None)):
        plain = _prompt_request(rid, prompt, skip_reading_prefix_cache=skip)
        sched.add_request(plain)
        run_step(sched)
        assert plain.num_cached_tokens == 16, rid  # the blocks the skipping requests computed
    # prompt logprobs need every position's logits: an explicit False does not turn that off
    logprobs = _prompt_request("logprobs", prompt, prompt_logprobs=1, skip_reading_prefix_cache=False)
    sched.add_request(logprobs)
    run_step(sched)
    assert logprobs.num_cached_tokens == 0
    sched.block_manager.check_invariants()


def test_skip_reading_prefix_cache_takes_a_bool_or_none():
    with pytest.raises(RequestError, match="skip_reading_prefix_cache: must be true, false or null"):
        SamplingParams(skip_reading_prefix_cache="yes")


def test_peak_num_running_is_the_largest_running_batch_any_step_had():
    sched = make_scheduler(num_blocks=16, budget=64, max_seqs=8)
    seen = 0
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 20, first_token=1 + 30 * i, max_tokens=30))
    for _ in range(40):
        run_step(sched)
        seen = max(seen, len(sched.running))
        for req in list(sched.running):
            seq = req.seqs[0]
            if seq.num_output_tokens >= 6 + int(req.request_id[1:]):
                seq.finish_reason = FinishReason.LENGTH
                sched.finish_seq(req, seq)
        assert sched.peak_num_running == seen
    assert 1 < seen < 6  # 16 blocks of 8 cannot hold all six: the peak is what fit, not the request count
    assert not sched.has_unfinished_requests()
