"""The step message between engine and worker: plain data, pickles, and stays small in decode."""

from __future__ import annotations

import itertools
import pickle

from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import FinishReason, Request, Sequence
from pagedllm.engine.step_builder import StepBuilder, _table_change
from pagedllm.kv.block_manager import BlockManager
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.step import (
    BeamCandidates,
    MemoryOp,
    MemoryOpKind,
    NewSequence,
    PromptLogprob,
    SampledToken,
    ScheduledSeq,
    StepInput,
    StepResult,
)

BLOCK_SIZE = 16


def _engine_side(prompt_len: int, n: int = 1):
    bm = BlockManager(512, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096), bm
    )
    tokens = [5 + i % 100 for i in range(prompt_len)]
    request = Request("r", None, tokens, SamplingParams(n=n, max_tokens=200), RequestMetrics(0.0))
    request.seqs.append(Sequence(prompt_len=prompt_len, token_ids=list(tokens), seq_id=0))
    scheduler.add_request(request)
    new_seq_id = itertools.count(1).__next__
    return scheduler, StepBuilder(scheduler, new_seq_id, vocab_size=49152, max_model_len=4096), request


def _step(scheduler: Scheduler, steps: StepBuilder, token: int = 9) -> StepInput:
    """Schedule, build the message, and play the worker's part: every sampled sequence gets ``token``."""
    out = scheduler.schedule()
    step = steps.build(out)
    scheduler.on_step_computed(out)
    for chunk, (_, seq) in zip(out.chunks, out.entries):
        if chunk.needs_logits:
            seq.token_ids.append(token)
    scheduler.block_manager.check_invariants()
    return step


def test_every_message_type_round_trips_through_pickle():
    step = StepInput(
        step_id=3,
        new_seqs=[NewSequence(1, [1, 2, 3], 3, SamplingParams(temperature=0.5, seed=2, stop=["x"]), 0)],
        scheduled=[ScheduledSeq(1, 0, 3, None, 0, [4, 7], sample_targets=[(1, 0), (8, 1)], prompt_logprobs=True)],
        memory_ops=[MemoryOp(MemoryOpKind.COPY, [(4, 5)])],
        finished_seq_ids=[0],
    )
    result = StepResult(
        3,
        sampled=[SampledToken(1, 42, -0.5, 1, [(42, -0.5), (7, -1.0)])],
        beams=[BeamCandidates(2, [3, 4], [-0.1, -0.2])],
        prompt_logprobs={1: [PromptLogprob(1, 2, -3.0, 5, [(9, -0.1)])]},
    )
    assert pickle.loads(pickle.dumps(step)) == step
    assert pickle.loads(pickle.dumps(result)) == result


def test_a_decode_step_message_does_not_grow_with_context_length():
    sizes = {}
    for prompt_len in (40, 1500):
        scheduler, steps, request = _engine_side(prompt_len)
        first = _step(scheduler, steps)
        assert len(first.new_seqs) == 1 and first.new_seqs[0].token_ids == request.prompt_token_ids
        decode = [_step(scheduler, steps) for _ in range(BLOCK_SIZE)]
        for step in decode:
            (chunk,) = step.scheduled
            assert not step.new_seqs and chunk.num_tokens == 1
            assert chunk.token_ids is None  # the worker drew it and keeps it
        # a new block id once every BLOCK_SIZE steps, nothing otherwise
        assert sum(len(s.scheduled[0].new_block_ids) for s in decode) == 1
        sizes[prompt_len] = max(len(pickle.dumps(s)) for s in decode)
        assert len(pickle.dumps(first)) > sizes[prompt_len] + prompt_len  # the prompt went once
    # pickled ints of a larger position take at most a byte or two more
    assert abs(sizes[1500] - sizes[40]) <= 4, sizes


def test_forks_get_their_ids_before_the_step_and_freed_sequences_are_named_once():
    scheduler, steps, request = _engine_side(20, n=3)
    first = _step(scheduler, steps)
    (chunk,) = first.scheduled
    parent = request.seqs[0].seq_id
    children = steps.fork_ids[parent]
    assert chunk.sample_targets == [(parent, 0), (children[0], 1), (children[1], 2)]
    assert (parent, children) == (0, [1, 2])  # ids from the builder's source, not a process-wide counter
    request.seqs[0].finish_reason = FinishReason.STOP
    scheduler.finish_seq(request, request.seqs[0])
    nxt = steps.build(scheduler.schedule())
    assert nxt.finished_seq_ids == [parent]
    assert steps.build(scheduler.schedule()).finished_seq_ids == []


def test_table_change_covers_append_copy_on_write_and_swap():
    assert _table_change([1, 2], [1, 2, 3]) == (2, [3])
    assert _table_change([1, 2], [1, 2]) == (2, [])
    assert _table_change([1, 2], [1, 9]) == (1, [9])  # the last block copied on write
    assert _table_change([1, 2, 3], [7, 8, 9]) == (0, [7, 8, 9])  # swapped back in elsewhere
    assert _table_change([1, 2, 3], [1]) == (1, [])


def test_a_pending_token_is_scheduled_by_position_and_hashed_only_once_known():
    """An overlapped step: the token still being drawn on the device takes its position in the
    next step (the worker feeds it), but no token list, hash or output holds it until it is read."""
    bm = BlockManager(64, BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096), bm)
    prompt = [5 + i for i in range(BLOCK_SIZE - 1)]
    request = Request("r", None, prompt, SamplingParams(max_tokens=20), RequestMetrics(0.0))
    seq = Sequence(prompt_len=len(prompt), token_ids=list(prompt), seq_id=0)
    request.seqs.append(seq)
    scheduler.add_request(request)
    steps = StepBuilder(scheduler, itertools.count(1).__next__, vocab_size=49152, max_model_len=4096)
    first = scheduler.schedule()
    steps.build(first)
    scheduler.on_step_computed(first)

    seq.num_pending_tokens = 1  # the engine launched the prefill's draw and has not read it
    assert (seq.num_tokens, seq.num_uncomputed_tokens, seq.output_token_ids) == (BLOCK_SIZE, 1, [])
    out = scheduler.schedule()
    (chunk,) = out.chunks
    assert (chunk.token_ids, chunk.num_pending_tokens, chunk.num_tokens) == ([], 1, 1)
    assert (chunk.start_pos, chunk.needs_logits, out.num_batched_tokens) == (BLOCK_SIZE - 1, True, 1)
    (scheduled,) = steps.build(out).scheduled
    assert (scheduled.start_pos, scheduled.num_tokens, scheduled.token_ids) == (BLOCK_SIZE - 1, 1, None)

    seq.token_ids.append(77)  # the draw is read: the token becomes known
    seq.num_pending_tokens = 0
    scheduler.on_step_computed(out)
    assert seq.num_computed_tokens == BLOCK_SIZE and seq.output_token_ids == [77]
    # the full block is hashed over the real token (a lookup never covers its last token: one more)
    assert bm.get_num_cached_tokens(prompt + [77, 1]) == BLOCK_SIZE
    assert bm.get_num_cached_tokens(prompt + [0, 1]) == 0
    bm.check_invariants()
