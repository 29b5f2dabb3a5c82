"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running requests go first (a decode token each, or the
next chunk of a prompt), then swapped-out requests come back, then waiting
prompts are admitted in arrival order. When a running request needs a block
and none is free, the most recently admitted request is preempted.

Admission headroom: a request is admitted (or swapped back in) only if the
free blocks left afterwards still cover the next ``num_headroom_tokens``
tokens of every running sequence, itself included (never past a sequence's
``max_tokens``). The reserve grows with the batch, so a tight cache fills by
admitting a little less instead of admitting everything whose prompt fits and
preempting by recompute as the sequences grow; it applies to preempted
requests coming back too, so they return only when they can keep running.
It never holds back more than ``max_headroom_fraction`` of the cache, so that
a batch of many short sequences is not kept small for growth that early stops
may never use.

The scheduler decides; it never touches tensors. Its output is plain data
(:class:`SchedulerOutput`) that the runner executes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import DEFAULT_NUM_HEADROOM_TOKENS
from pagedllm.engine.sequence import FinishReason, Request, SeqStatus, Sequence
from pagedllm.kv.block_manager import BlockManager
from pagedllm.step import MemoryOp, MemoryOpKind, can_batch  # noqa: F401  (re-exported for callers of the scheduler)

logger = logging.getLogger("pagedllm")


@dataclass
class ScheduledChunk:
    """New tokens of one sequence for this step (plain data for the runner)."""

    seq_id: int
    token_ids: list[int]  # the known tokens whose KV is computed this step
    start_pos: int  # position of the chunk's first token == num_computed_tokens before the step
    block_table: list[int]
    needs_logits: bool  # the chunk completes the sequence: sample from its last position
    all_logits: bool = False  # logits at every position (prompt logprobs)
    # Tokens after token_ids that are drawn on the device and not read yet
    # (an overlapped step): the worker feeds them from its own output.
    num_pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Positions computed this step: start_pos .. start_pos + num_tokens - 1."""
        return len(self.token_ids) + self.num_pending_tokens


@dataclass
class SchedulerOutput:
    """One step's decisions. ``memory_ops`` are in the order they were decided,
    which is the order the runner must apply them in (a block freed by one op
    may be the destination of a later one)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    entries: list[tuple[Request, Sequence]] = field(default_factory=list)  # parallel to chunks
    memory_ops: list[MemoryOp] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished at scheduling (never fits)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def add_memory_op(self, kind: MemoryOpKind, pairs: list[tuple[int, int]]) -> None:
        """Append, merging with the previous op when it is of the same kind (one batched copy)
        and no new pair reads or rewrites a block that op writes."""
        if not pairs:
            return
        if self.memory_ops and self.memory_ops[-1].kind is kind and can_batch(self.memory_ops[-1].pairs, pairs):
            self.memory_ops[-1].pairs.extend(pairs)
        else:
            self.memory_ops.append(MemoryOp(kind, list(pairs)))

    def pairs_of(self, kind: MemoryOpKind) -> list[tuple[int, int]]:
        return [pair for op in self.memory_ops if op.kind is kind for pair in op.pairs]

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self.pairs_of(MemoryOpKind.COPY)

    @property
    def swap_out(self) -> list[tuple[int, int]]:
        return self.pairs_of(MemoryOpKind.SWAP_OUT)

    @property
    def swap_in(self) -> list[tuple[int, int]]:
        return self.pairs_of(MemoryOpKind.SWAP_IN)


# A waiting request whose cached prefix is still loading from the disk tier is
# held back this long at most (running requests keep stepping meanwhile);
# after that its blocks are computed.
MAX_PREFETCH_WAIT_S = 0.5


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"  # recompute | swap | auto
    kv_policy: str = "paged"
    # Tokens of growth per running sequence that must still fit after an
    # admission (see the module docstring); 0 admits whenever the prompt fits.
    num_headroom_tokens: int = DEFAULT_NUM_HEADROOM_TOKENS
    max_headroom_fraction: float = 0.1  # of the device blocks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests re-enter at the front
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.peak_num_running = 0  # the most requests in the running batch after any schedule()
        self._freed_seq_ids: list[int] = []  # since the last take_freed_seq_ids(): the worker forgets them
        # (request, until): the last schedule() admitted no further because this request's
        # prefix is loading from disk; the engine may sleep on those loads until then.
        self._held_for_prefetch: tuple[Request, float] | None = None

    # ---- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = SeqStatus.WAITING
        self.waiting.append(request)
        if self.block_manager.disk_tier is not None and not request.skips_prefix_cache:
            self._start_prefetch(request)  # its disk-tier blocks are then in memory at admission

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Finish every live sequence of the request and give back all its blocks."""
        for seq in request.live_seqs():
            seq.finish_reason = reason
        self._release(request)
        request.status = SeqStatus.FINISHED
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)

    def finish_seq(self, request: Request, seq: Sequence) -> None:
        """One sequence is done (its finish_reason is set): free its blocks now."""
        self.free_seq(seq)
        if not request.live_seqs():
            self.finish_request(request, FinishReason.STOP)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent.seq_id, child.seq_id)

    def take_freed_seq_ids(self) -> list[int]:
        """Sequences given up since the last call (may repeat an id); the step tells the worker."""
        freed, self._freed_seq_ids = self._freed_seq_ids, []
        return freed

    def free_seq(self, seq: Sequence) -> None:
        self._freed_seq_ids.append(seq.seq_id)
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)

    def _release(self, request: Request) -> None:
        for seq in request.seqs:
            self.free_seq(seq)

    # ---- one step ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._held_for_prefetch = None
        budget = self.config.max_num_batched_tokens
        preempted = False
        for request in list(self.running):
            if request.status is not SeqStatus.RUNNING:  # preempted or failed earlier in this loop
                continue
            _, budget, victim_taken = self._schedule_running(request, budget, out)
            preempted = preempted or victim_taken
        if not preempted:
            budget = self._schedule_swapped(budget, out)
            if not self.swapped:
                self._schedule_waiting(budget, out)
        self._drain_tier_ops(out)
        out.num_batched_tokens = sum(c.num_tokens for c in out.chunks)
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        return out

    def _drain_tier_ops(self, out: SchedulerOutput) -> None:
        """The block manager's tier copies so far, in order: before any op decided after them."""
        for op in self.block_manager.take_tier_ops():
            out.add_memory_op(op.kind, op.pairs)

    def _add_ops(self, out: SchedulerOutput, kind: MemoryOpKind, pairs: list[tuple[int, int]]) -> None:
        """``pairs`` came from a block-manager call that may have evicted blocks: their copy-outs go first."""
        self._drain_tier_ops(out)
        out.add_memory_op(kind, pairs)

    def on_step_computed(self, out: SchedulerOutput) -> None:
        """The forward pass ran: advance computed counts and publish full blocks to the prefix cache.

        Call once the step's pending tokens are known (a live sequence has none): the
        blocks are hashed over their token ids.
        """
        bm = self.block_manager
        for chunk, (_, seq) in zip(out.chunks, out.entries):
            seq.num_computed_tokens += chunk.num_tokens
            if bm.has_seq(seq.seq_id):
                assert seq.num_pending_tokens == 0, "a computed block is hashed over known tokens only"
                bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    # ---- running ----------------------------------------------------------

    def _plan_tokens(
        self, request: Request, seqs: list[Sequence], budget: int
    ) -> dict[int, int] | None:
        """Tokens to compute per live sequence (``seqs``) this step, or None when nothing fits.

        A single sequence may take any chunk. Sequences of a multi-sequence
        request (samples, beams) advance in lockstep: they all produce logits in
        the same step, or none does (each keeps at least one token uncomputed).
        """
        if len(seqs) == 1:
            n = min(seqs[0].num_uncomputed_tokens, budget)
            return {seqs[0].seq_id: n} if n > 0 else None
        needed = {s.seq_id: s.num_uncomputed_tokens for s in seqs}
        if sum(needed.values()) <= budget:
            return needed  # one pass: within each layer seqs[0] writes the shared prefix before anyone reads it
        if seqs[0].num_computed_tokens < request.shared_prefix_len:
            n = min(needed[seqs[0].seq_id] - 1, budget)  # the others read blocks it has not written yet
            return {seqs[0].seq_id: n} if n > 0 else None
        plan, left = {}, budget
        for sid, n in needed.items():
            take = min(n - 1, left)
            if take > 0:
                plan[sid] = take
                left -= take
        return plan or None

    def _can_append(self, seqs: list[Sequence], plan: dict[int, int]) -> bool:
        """Whether the planned sequences (of the live ``seqs``) can all get their new slots
        (the block manager counts the blocks and copy-on-writes)."""
        bm = self.block_manager
        extra = {
            s.seq_id: s.num_computed_tokens + plan[s.seq_id] - bm.get_num_slots(s.seq_id)
            for s in seqs if s.seq_id in plan
        }
        growing = {seq_id: n for seq_id, n in extra.items() if n > 0}
        if len(growing) == 1:
            ((seq_id, n),) = growing.items()
            return bm.can_append_slots(seq_id, n)
        return bm.can_append_group(growing)

    def _schedule_running(
        self, request: Request, budget: int, out: SchedulerOutput
    ) -> tuple[bool, int, bool]:
        if budget > 0 and self._schedule_decode(request, out):
            return True, budget - 1, False
        # Preempting other requests below leaves this one's live sequences as they are.
        seqs = request.live_seqs()
        plan = self._plan_tokens(request, seqs, budget)
        if plan is None:
            return False, budget, False
        preempted = False
        while not self._can_append(seqs, plan):
            victim = self.running[-1]
            preempted = True
            if victim is request:
                if len(self.running) == 1:
                    self._fail(request, out, "the KV cache is too small for this request to continue")
                else:
                    self._preempt(request, out)
                return False, budget, True
            self._preempt(victim, out)
        self._emit(request, seqs, plan, out)
        return True, budget - sum(plan.values()), preempted

    def _schedule_decode(self, request: Request, out: SchedulerOutput) -> bool:
        """The steady decode step, when it applies; False, with nothing changed, when it does not.

        It applies to a request with one sequence, live, whose one uncomputed
        token gets the next slot of a block the sequence alone holds. The chunk
        is the one ``_plan_tokens``, ``_can_append`` and ``_emit`` produce for
        it (no block changes, so no memory op and no preemption), found with
        one block-manager call instead of five.
        """
        seqs = request.seqs
        if len(seqs) != 1:
            return False
        seq = seqs[0]
        start = seq.num_computed_tokens
        if seq.finish_reason is not None or seq.num_tokens != start + 1:
            return False
        block_table = self.block_manager.append_slot_in_place(seq.seq_id, start)
        if block_table is None:
            return False
        want_prompt_logprobs = start < seq.prompt_len and request.needs_prompt_logits
        out.chunks.append(ScheduledChunk(
            seq.seq_id, seq.token_ids[start:], start, block_table, True, want_prompt_logprobs,
            num_pending_tokens=seq.num_pending_tokens,
        ))
        out.entries.append((request, seq))
        return True

    def _emit(
        self, request: Request, seqs: list[Sequence], plan: dict[int, int], out: SchedulerOutput
    ) -> None:
        bm = self.block_manager
        for seq in seqs:
            num_new = plan.get(seq.seq_id, 0)
            if num_new == 0:
                continue
            extra = seq.num_computed_tokens + num_new - bm.get_num_slots(seq.seq_id)
            if extra > 0:
                self._add_ops(out, MemoryOpKind.COPY, bm.append_slots(seq.seq_id, extra))
            start = seq.num_computed_tokens
            end = start + num_new
            complete = end == seq.num_tokens
            want_prompt_logprobs = start < seq.prompt_len and request.needs_prompt_logits  # decode: False at once
            out.chunks.append(
                ScheduledChunk(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[start:end],
                    start_pos=start,
                    block_table=bm.get_block_table(seq.seq_id),
                    needs_logits=complete,
                    all_logits=want_prompt_logprobs,
                    num_pending_tokens=max(0, end - len(seq.token_ids)),
                )
            )
            out.entries.append((request, seq))

    # ---- preemption -------------------------------------------------------

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        self.block_manager.record_preemption()
        seq_ids = [s.seq_id for s in request.live_seqs()]
        mode = self.config.preemption_mode
        use_swap = mode == "swap" or (mode == "auto" and len(seq_ids) > 1)
        if use_swap and self.block_manager.can_swap_out(seq_ids):
            self._add_ops(out, MemoryOpKind.SWAP_OUT, self.block_manager.swap_out(seq_ids))
            request.status = SeqStatus.SWAPPED
            self.swapped.append(request)
            logger.debug("preempted %s by swap", request.request_id)
            return
        for seq in request.live_seqs():
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
        request.status = SeqStatus.WAITING
        self.waiting.appendleft(request)
        logger.debug("preempted %s by recompute", request.request_id)

    def _fail(self, request: Request, out: SchedulerOutput, message: str) -> None:
        request.error = message
        self.finish_request(request, FinishReason.ERROR)
        out.failed.append(request)

    # ---- swapped and waiting ---------------------------------------------

    def _schedule_swapped(self, budget: int, out: SchedulerOutput) -> int:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            seq_ids = [s.seq_id for s in request.live_seqs()]
            # A new block and a copy-on-write per sequence, so a group that
            # comes back can step instead of being swapped straight out.
            num_headroom = 2 * len(seq_ids) + self._capped(self._running_headroom_blocks())
            if not self.block_manager.can_swap_in(seq_ids, num_headroom_blocks=num_headroom):
                break
            self.swapped.popleft()
            self._add_ops(out, MemoryOpKind.SWAP_IN, self.block_manager.swap_in(seq_ids))
            request.status = SeqStatus.RUNNING
            self.running.append(request)
            _, budget, preempted = self._schedule_running(request, budget, out)
            if preempted:
                break  # it could not grow after all: retry next step, not in a loop now
        return budget

    def _reserved_tokens(self, request: Request, seq: Sequence) -> int | None:
        """Up-front reservation under the contiguous baselines of the memory benchmark."""
        policy = self.config.kv_policy
        if policy == "paged":
            return None
        want = request.final_num_tokens(self.config.max_model_len)
        if policy == "contiguous-max":
            want = self.config.max_model_len
        elif policy == "contiguous-pow2":
            want = 1 << (want - 1).bit_length()
        return max(seq.num_tokens, min(want, self.config.max_model_len))

    def _blocks_for(self, request: Request) -> int:
        """Blocks the request takes at admission (several sequences share their full prompt blocks)."""
        seqs = request.live_seqs()
        return self.block_manager.num_blocks_for_group(
            [self._reserved_tokens(request, seq) or seq.num_tokens for seq in seqs],
            num_shared_slots=seqs[0].prompt_len,
        )

    def _can_admit(self, request: Request, num_headroom_blocks: int) -> bool:
        """Whether the request's blocks fit with ``num_headroom_blocks`` and the watermark still free."""
        seqs = request.live_seqs()
        bm = self.block_manager
        if len(seqs) == 1:
            seq = seqs[0]
            return bm.can_allocate(
                seq.token_ids, request.cache_salt, self._reserved_tokens(request, seq), num_headroom_blocks,
                reuse_cached_prefix=not request.skips_prefix_cache,
            )
        num_needed = self._blocks_for(request) + num_headroom_blocks
        return num_needed <= bm.get_num_free_blocks() - bm.watermark_blocks

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        if not self.waiting:
            return  # the common decode step: skip summing the running sequences' headroom
        num_headroom = self._running_headroom_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._blocks_for(request) > self.block_manager.num_blocks:
                self.waiting.popleft()
                self._fail(request, out, "the prompt needs more KV blocks than the whole cache holds")
                continue
            num_growth = self._admission_growth_blocks(request)
            # Alone in the cache a request needs no headroom: it runs as far as the cache lets it.
            num_reserve = self._capped(num_headroom + num_growth) if self.running else 0
            if not self._can_admit(request, num_reserve):
                break  # FCFS: later prompts wait behind this one so it is never starved
            if self._awaits_prefetch(request):
                self._held_for_prefetch = (request, request.prefetch_deadline)
                break  # its cached blocks are in memory shortly; FCFS keeps the others behind it
            if not self.running:
                gathering = self._batch_still_loading(budget)
                if gathering is not None:
                    self._held_for_prefetch = (gathering, min(request.prefetch_deadline, gathering.prefetch_deadline))
                    break  # one step for them all, shortly
            self.waiting.popleft()
            self._admit(request, out)
            num_headroom += num_growth
            _, budget, _ = self._schedule_running(request, budget, out)

    # ---- admission headroom -----------------------------------------------

    def _capped(self, num_headroom_blocks: int) -> int:
        """The headroom, held to max_headroom_fraction of the device blocks."""
        limit = int(self.config.max_headroom_fraction * self.block_manager.num_blocks)
        return min(num_headroom_blocks, limit)

    def _growth_blocks(self, request: Request, seq: Sequence, num_held_blocks: int) -> int:
        """Blocks beyond ``num_held_blocks`` that ``seq`` needs for its next num_headroom_tokens tokens."""
        target = min(seq.num_tokens + self.config.num_headroom_tokens, request.final_num_tokens(self.config.max_model_len))
        return self.block_manager.num_growth_blocks(target, num_held_blocks)

    def _running_headroom_blocks(self) -> int:
        """Free blocks the running sequences need to grow by num_headroom_tokens each."""
        bm = self.block_manager
        return sum(
            self._growth_blocks(request, seq, bm.get_num_blocks(seq.seq_id))
            for request in self.running
            for seq in request.live_seqs()
        )

    def _admission_growth_blocks(self, request: Request) -> int:
        """What a waiting request adds to the headroom once admitted with the blocks _blocks_for counts."""
        bm = self.block_manager
        total = 0
        for seq in request.live_seqs():
            num_admitted_tokens = self._reserved_tokens(request, seq) or seq.num_tokens
            total += self._growth_blocks(request, seq, bm.num_blocks_for_group([num_admitted_tokens]))
        return total

    def _awaits_prefetch(self, request: Request) -> bool:
        """Whether to hold the request while its disk-tier prefix loads into memory.

        The loads start when the request arrives, and again here for blocks
        evicted to disk while it waited. A request is held for at most
        MAX_PREFETCH_WAIT_S in all (running requests keep stepping meanwhile);
        after that the blocks still on disk are computed.
        """
        if self.block_manager.disk_tier is None or request.skips_prefix_cache:
            return False
        if request.prefetch_deadline is None:
            return self._start_prefetch(request)
        seq = request.live_seqs()[0]
        return time.monotonic() < request.prefetch_deadline and self.block_manager.prefetch(
            seq.token_ids, request.cache_salt)

    def _batch_still_loading(self, budget: int) -> Request | None:
        """With nothing running and the first waiting request's prefix in memory: a request
        that could share the first step with it whose own disk-tier prefix is still loading.

        Starting the step without it would only delay it by a whole step (its loads finish
        during that step anyway, and on a CPU they slow it down), so the engine waits for
        the loads and runs one step for them all. Only while the first request may still
        wait (MAX_PREFETCH_WAIT_S from its arrival) and the request itself may too."""
        head = self.waiting[0]
        now = time.monotonic()
        if self.swapped or head.prefetch_deadline is None or now >= head.prefetch_deadline:
            return None
        bm = self.block_manager
        for i, request in enumerate(self.waiting):
            if i >= self.config.max_num_seqs or request.skips_prefix_cache or len(request.live_seqs()) != 1:
                break
            seq = request.live_seqs()[0]
            num_blocks, loading = bm.prefix_load_state(seq.token_ids, request.cache_salt)
            budget -= max(seq.num_tokens - num_blocks * bm.block_size, 1)  # its share of the step
            if budget < 0:
                break
            if loading is not None and request.prefetch_deadline is not None and now < request.prefetch_deadline:
                return request
        return None

    def wait_for_prefetch(self) -> None:
        """After a schedule() that admitted nothing because its first waiting request's prefix is
        loading from disk: sleep until that load is done (or the request's wait ends), so that the
        engine's thread leaves the reader the core and the interpreter instead of polling.
        interrupt_prefetch_wait() ends the wait early (a new request must start its own loads)."""
        if self._held_for_prefetch is None:
            return
        request, until = self._held_for_prefetch
        if request.status is not SeqStatus.WAITING:
            return
        seq = request.live_seqs()[0]
        _, target = self.block_manager.prefix_load_state(seq.token_ids, request.cache_salt)
        remaining = until - time.monotonic()
        if target is not None and remaining > 0:
            self.block_manager.disk_tier.wait_loaded(target, remaining)

    def interrupt_prefetch_wait(self) -> None:
        """End a wait_for_prefetch early (thread-safe): the caller has work for the engine's thread."""
        if self.block_manager.disk_tier is not None:
            self.block_manager.disk_tier.wake()

    def _start_prefetch(self, request: Request) -> bool:
        """Start loading the request's disk-tier prefix into memory; True, with the
        request's wait deadline set, when some of it is loading."""
        seq = request.live_seqs()[0]
        if not self.block_manager.prefetch(seq.token_ids, request.cache_salt):
            return False
        request.prefetch_deadline = time.monotonic() + MAX_PREFETCH_WAIT_S
        return True

    def _admit(self, request: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        first, *others = request.live_seqs()
        num_cached = bm.allocate(first.seq_id, first.token_ids, request.cache_salt,
                                 self._reserved_tokens(request, first),
                                 reuse_cached_prefix=not request.skips_prefix_cache)
        first.num_computed_tokens = num_cached
        self._drain_tier_ops(out)
        if not request.forked and not request.is_beam_search:
            request.num_cached_tokens = num_cached
        # A recomputed multi-sequence request shares its full prompt blocks
        # again: the others fork them from the first, which computes them.
        shared = bm.full_block_slots(first.prompt_len)
        for seq in others:
            bm.fork(first.seq_id, seq.seq_id, num_tokens=shared)
            self._add_ops(out, MemoryOpKind.COPY, bm.append_slots(seq.seq_id, seq.num_tokens - shared))
            seq.num_computed_tokens = shared
        request.shared_prefix_len = shared if others else 0
        request.status = SeqStatus.RUNNING
        self.running.append(request)
        if request.metrics.first_scheduled_time is None:  # a preempted request keeps its first
            request.metrics.first_scheduled_time = time.monotonic()
