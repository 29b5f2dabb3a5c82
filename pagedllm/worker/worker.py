"""The Worker: one rank's model, KV cache, attention backend, CUDA graphs and sampler.

It executes :class:`~pagedllm.step.StepInput` messages against its
persistent :class:`InputBatch` and answers with sampled tokens and the
logprobs asked for (:class:`~pagedllm.step.StepResult`), never with logits.
The engine talks to rank 0's worker in its own process; under tensor
parallelism the other ranks run the same class in their own processes.

Two ways to run a step: :meth:`execute` returns its result; :meth:`launch`
leaves the drawn tokens on the device and :meth:`collect` reads them later,
so the host can schedule and launch the next step meanwhile (the engine's
overlapped steps). A launched step's tokens feed the next step's inputs on
the device. Results come back in launch order.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import get_attention_backend
from pagedllm.config import DEFAULT_CUDA_KV_HOST_CACHE_MEMORY, EngineConfig
from pagedllm.distributed import TensorParallelGroup
from pagedllm.errors import ConfigError
from pagedllm.kv import kv_format, memory_budget
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.stats import TierTimes
from pagedllm.kv.tiers import DiskTier, block_layout, read_blocks, write_blocks
from pagedllm.models.loader import load_model
from pagedllm.native import host_memory, quant_ops
from pagedllm.native.cpu_dtype import check_cpu_dtype
from pagedllm.runner.cuda_graphs import DecodeGraphs
from pagedllm.runner.inputs import ModelInputs, build_model_inputs, to_device
from pagedllm.sampling.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    on_device,
    sample_generator,
    top_k_logprobs,
)
from pagedllm.step import (
    BeamCandidates,
    MemoryOp,
    MemoryOpKind,
    PromptLogprob,
    SampledToken,
    StepInput,
    StepResult,
)
from pagedllm.structured.bitmask import GrammarMask, mask_from_rows
from pagedllm.worker.block_shards import BlockShards
from pagedllm.worker.input_batch import BatchChunk, InputBatch, SeqState

logger = logging.getLogger("pagedllm")

DEFAULT_CPU_KV_MEMORY = 4 * 2**30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} requested but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device, dense: bool = True) -> torch.dtype:
    """The model's dtype for ``name``. ``dense``: its matmuls take weights of that dtype (not
    packed ones), so a 16-bit dtype this CPU emulates is announced as the slowdown it is."""
    if name == "auto":
        # CPU: float32 keeps greedy outputs equal to the reference; bf16 is opt-in.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    check_cpu_dtype(dtype, device, dense)  # a 16-bit dtype this CPU emulates: say so, never a silent 20x
    return dtype


@dataclass
class _Job:
    """One token to draw: for sequence ``seq_id`` from logits row ``row`` of the step."""

    seq_id: int
    sample_index: int
    state: SeqState  # the sequence whose chunk produced the row (a fork's parent)
    row: int
    allowed_token_bitmask: bytes | None = None  # the grammar's row (pagedllm.structured.bitmask), when constrained


@dataclass
class _Launched:
    """A launched step's draws, on the device until read (see Worker.launch)."""

    step_id: int
    seq_ids: list[int]  # row i of the tensors is drawn for seq_ids[i]
    token_ids: torch.Tensor  # [rows] int64 on the device: the next step's inputs come from here
    logprobs: torch.Tensor  # [rows] float32
    host_token_ids: torch.Tensor | None = None  # pinned host copies, valid once ``ready``
    host_logprobs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def start_copy_to_host(self) -> None:
        """Queue the copies to pinned memory now, right behind the sampling kernels.

        Reading a CUDA tensor later with .tolist() would wait for everything
        queued by then, the next step's forward pass included.
        """
        if not self.token_ids.is_cuda:
            return
        self.host_token_ids = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype, pin_memory=True)
        self.host_logprobs = torch.empty(self.logprobs.shape, dtype=self.logprobs.dtype, pin_memory=True)
        self.host_token_ids.copy_(self.token_ids, non_blocking=True)
        self.host_logprobs.copy_(self.logprobs, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def read(self) -> tuple[list[int], list[float]]:
        if self.ready is None:
            return self.token_ids.tolist(), self.logprobs.tolist()
        self.ready.synchronize()
        return self.host_token_ids.tolist(), self.host_logprobs.tolist()


class Worker:
    def __init__(
        self, config: EngineConfig, eos_token_ids: tuple[int, ...], tp: TensorParallelGroup | None = None
    ) -> None:
        self.config = config
        self.tp = tp if tp is not None else TensorParallelGroup()  # its own: it counts this worker's times
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, dense=(config.quantization or "none") == "none")
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        loaded = load_model(
            config.model, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend,
            rope_scaling=config.rope_scaling, tp=self.tp,
            quantization=config.quantization or "none", quantization_group_size=config.quantization_group_size,
            quant_activations=config.quant_activations,
        )
        self.model = loaded.model
        self.model_config = loaded.config
        self.model_path = loaded.path
        _build_native_kernels(self.device, config.quantization)
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler()
        self.batch = InputBatch()
        self.kv_cache: KVCache | None = None
        self.disk_tier: DiskTier | None = None  # set by the engine when the disk tier is on (rank 0)
        self.block_shards: BlockShards | None = None  # the disk tier under tensor parallelism
        self.tier_times = TierTimes()
        self.decode_graphs: DecodeGraphs | None = None
        self._generators: dict[int, torch.Generator | None] = {}
        self._launched: deque[_Launched] = deque()
        self._ready: deque[StepResult] = deque()
        self._deferred: tuple | None = None  # (step, chunks, inputs, logits) of forward_only

    # ---- start-up ---------------------------------------------------------

    def _kv_shape(self) -> dict:
        mc = self.model_config
        return dict(
            num_layers=mc.num_layers, block_size=self.config.block_size,
            num_kv_heads=self.model.num_kv_heads, head_dim=mc.head_dim,
            dtype=kv_format.cache_dtype(self.config.kv_cache_dtype, self.dtype),  # 8-bit codes when quantized
        )

    def num_kv_blocks_for_config(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) this rank's share of the configured memory holds."""
        cfg = self.config
        shape = self._kv_shape()
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            memory = cfg.kv_cache_memory or self._default_kv_memory()
            num_blocks = KVCache.num_blocks_for_memory(memory, **shape)
        if num_blocks < 1:
            raise ConfigError("the KV cache budget is smaller than one block; raise kv_cache_memory")
        per_block = KVCache.bytes_per_block(**shape)
        # One CPU pool for swap and the host tier of the prefix cache.
        num_cpu_blocks = cfg.swap_space_bytes // per_block + self.host_tier_memory() // per_block
        return num_blocks, num_cpu_blocks

    def host_tier_memory(self) -> int:
        """Bytes of this rank's host tier (per rank, like the swap space): the configured size,
        else 0 on a CPU device and 4 GiB on CUDA (at most an eighth of the RAM)."""
        if not self.config.enable_prefix_caching:
            return 0
        if self.config.kv_host_cache_memory is not None:
            return self.config.kv_host_cache_memory
        if self.device.type != "cuda":
            return 0
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(DEFAULT_CUDA_KV_HOST_CACHE_MEMORY, ram // 8)

    def _default_kv_memory(self) -> int:
        if self.config.gpu_memory_utilization is not None:
            return self._kv_memory_for_utilization(self.config.gpu_memory_utilization) // self.tp.size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.5)
        return DEFAULT_CPU_KV_MEMORY // self.tp.size

    def _kv_memory_for_utilization(self, utilization: float) -> int:
        mc, cfg = self.model_config, self.config
        reserve = memory_budget.activation_reserve_bytes(
            num_batched_tokens=self.config.step_token_budget,
            max_num_seqs=cfg.max_num_seqs, hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size, vocab_size=mc.vocab_size,
        )
        snapshot = memory_budget.measure(self.device)
        kv_bytes = memory_budget.kv_bytes_for_utilization(utilization, snapshot, reserve)
        logger.info(
            "gpu_memory_utilization=%g: %d bytes of KV cache = that share of %d bytes, less %d held by "
            "weights and runtime and %d for activations",
            utilization, kv_bytes, snapshot.memory_for_engine, snapshot.used_by_engine, reserve,
        )
        return kv_bytes

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate this rank's KV shard: every rank the same block count, its own heads."""
        if self.device.type == "cpu":
            host_memory.tune_malloc()
        shape = self._kv_shape()
        self.kv_cache = KVCache(
            num_blocks=num_blocks, device=self.device, num_cpu_blocks=num_cpu_blocks,
            prefault=self.config.kv_cache_prefault, layout=self.attn_backend.kv_layout(self.device, shape["dtype"]),
            **shape,
        )
        if self.config.kv_cache_prefault and self.device.type == "cpu":
            # the largest step's activations resident too, as the pools are: its first run then
            # maps no fresh pages (about 67 MB for the default model's 2,048-token chunks)
            reserve = getattr(self.model, "reserve_activations", None)
            if reserve is not None:
                reserve(self.config.step_token_budget)
        if self.tp.size > 1 and self.config.kv_cache_dir is not None and self.config.enable_prefix_caching:
            mc = self.model_config  # the disk tier: whole blocks through rank 0
            self.block_shards = BlockShards(self.tp, block_layout(self.kv_cache.block_tensors()),
                                            mc.num_heads, mc.num_kv_heads)

    def apply_memory_ops(self, ops: list[MemoryOp]) -> None:
        """Memory operations outside a step (the disk tier's save at shutdown): on every rank alike."""
        apply_memory_ops(self.kv_cache, ops, self.disk_tier, self.tier_times, self.block_shards)

    def uses_cuda_graphs(self) -> bool:
        # The Triton decode kernel sizes its grid from host ints that stay valid
        # across replays; the reference backend reads per-step host lists.
        return self.device.type == "cuda" and not self.config.enforce_eager and self.attn_backend.name == "triton"

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture CUDA graphs for decode steps; later decode-only steps replay them."""
        graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, block_size=self.config.block_size,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=self.device,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    # ---- one step ---------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepResult:
        """Run the step and read its results (a step launched earlier is read first)."""
        self._read_launched()
        chunks, inputs, logits, forwarded = self._timed_forward(step)
        if not self.tp.is_first:
            return StepResult(step.step_id)
        result = self._sample_on_host(step, chunks, inputs, logits)
        self.tp.times.sample_seconds += time.perf_counter() - forwarded
        return result

    @torch.inference_mode()
    def forward_only(self, step: StepInput) -> None:
        """Run the step's forward pass; :meth:`sample_deferred` draws its tokens later, once
        the engine knows the grammar masks (they need the previous step's tokens)."""
        self._read_launched()
        self._deferred = (step, *self._forward(step))

    @torch.inference_mode()
    def sample_deferred(self, masks: dict[int, list[int]]) -> StepResult:
        """Sample the step :meth:`forward_only` ran, with ``masks`` (seq_id -> bitmask row) applied."""
        step, chunks, inputs, logits = self._deferred
        self._deferred = None
        for sched in step.scheduled:
            if sched.seq_id in masks:
                sched.allowed_token_bitmask = masks[sched.seq_id]
        return self._sample_on_host(step, chunks, inputs, logits)

    @torch.inference_mode()
    def launch(self, step: StepInput) -> None:
        """Run the step and draw its tokens without reading them (:meth:`collect` does).

        Only for steps whose every sampled row needs no logprobs and no beams
        (the engine's ``can_sample_ahead``). Its times count as :meth:`execute`'s do (the
        sampling's up to the launch of its copy to the host).
        """
        chunks, inputs, logits, forwarded = self._timed_forward(step)
        jobs = self._jobs(step, inputs)
        assert not any(s.prompt_logprobs or s.num_beam_candidates for s in step.scheduled)
        rows = self._sampling_rows(jobs)
        token_ids, logprobs = self.sampler.sample_tensors(
            _select_rows(logits, [j.row for j in jobs]), rows, _grammar_mask(jobs, logits.shape[1])
        )
        launched = _Launched(step.step_id, [j.seq_id for j in jobs], token_ids, logprobs)
        launched.start_copy_to_host()
        self._launched.append(launched)
        self.tp.times.sample_seconds += time.perf_counter() - forwarded

    def collect(self) -> StepResult:
        """The oldest unread step's result."""
        if self._ready:
            return self._ready.popleft()
        return self._read(self._launched.popleft())

    def _read_launched(self) -> None:
        while self._launched:
            self._ready.append(self._read(self._launched.popleft()))

    def _read(self, launched: _Launched) -> StepResult:
        tokens, logprobs = launched.read()  # waits for this step's own work only
        result = StepResult(launched.step_id)
        for seq_id, token, logprob in zip(launched.seq_ids, tokens, logprobs):
            state = self.batch.seqs.get(seq_id)
            if state is not None:
                state.token_ids.append(token)
            result.sampled.append(SampledToken(seq_id, token, logprob))
        return result

    def _timed_forward(self, step: StepInput) -> tuple[list[BatchChunk], ModelInputs, torch.Tensor, float]:
        """:meth:`_forward`, counted in the rank's times; also returns when it ended (perf_counter)."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        chunks, inputs, logits = self._forward(step)
        forwarded = time.perf_counter()
        self.tp.times.num_steps += 1
        self.tp.times.forward_seconds += forwarded - start
        self.tp.times.forward_cpu_seconds += time.thread_time() - start_cpu
        return chunks, inputs, logits, forwarded

    def _forward(self, step: StepInput) -> tuple[list[BatchChunk], ModelInputs, torch.Tensor]:
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        self.batch.update(step)
        apply_memory_ops(self.kv_cache, step.memory_ops, self.disk_tier, self.tier_times, self.block_shards)
        chunks = self.batch.chunks(step)
        inputs = build_model_inputs(chunks, self.config.block_size, self.device)
        self._feed_device_tokens(chunks, inputs)
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
            return chunks, inputs, self.decode_graphs.run(inputs)
        logits = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.metadata,
            None if inputs.every_row else inputs.logits_indices,  # None: no row selection (a decode step)
        )
        return chunks, inputs, logits

    def _feed_device_tokens(self, chunks: list[BatchChunk], inputs: ModelInputs) -> None:
        """Input tokens still on the device (drawn by the last launched step) go in place there."""
        if not any(c.token_on_device for c in chunks):
            return
        source = self._launched[-1]
        source_row = {seq_id: i for i, seq_id in enumerate(source.seq_ids)}
        dst, src, row = [], [], 0
        for chunk in chunks:
            row += len(chunk.token_ids)
            if chunk.token_on_device:
                dst.append(row - 1)
                src.append(source_row[chunk.seq_id])
        if dst == src and len(dst) == inputs.input_ids.shape[0] == source.token_ids.shape[0]:
            inputs.input_ids.copy_(source.token_ids)  # the usual decode step: same rows, same order
            return
        rows, sources = to_device([np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)], self.device)
        inputs.input_ids[rows] = source.token_ids[sources].to(inputs.input_ids.dtype)

    # ---- sampling ---------------------------------------------------------

    def _jobs(self, step: StepInput, inputs: ModelInputs) -> list[_Job]:
        jobs, row = [], 0
        for sched, count in zip(step.scheduled, inputs.row_counts):
            state = self.batch.seqs[sched.seq_id]
            for seq_id, sample_index in sched.sample_targets:
                jobs.append(_Job(seq_id, sample_index, state, row + count - 1, sched.allowed_token_bitmask))
            row += count
        return jobs

    def _generator(self, job: _Job) -> torch.Generator | None:
        if job.seq_id not in self._generators:
            self._generators[job.seq_id] = sample_generator(job.state.params.seed, job.sample_index, self.device)
        return self._generators[job.seq_id]

    def _sampling_rows(self, jobs: list[_Job]) -> list[SamplingRow]:
        eos = self.eos_token_ids
        return [
            SamplingRow(j.state.params, j.state.token_ids, j.state.prompt_len, self._generator(j), eos)
            for j in jobs
        ]

    def _sample_on_host(
        self, step: StepInput, chunks: list[BatchChunk], inputs: ModelInputs, logits: torch.Tensor
    ) -> StepResult:
        result = StepResult(step.step_id)
        row = 0
        for sched, count in zip(step.scheduled, inputs.row_counts):
            state = self.batch.seqs[sched.seq_id]
            if sched.prompt_logprobs:
                result.prompt_logprobs[sched.seq_id] = self._prompt_logprobs(
                    state, sched.start_pos, logits[row : row + count]
                )
            if sched.num_beam_candidates:
                result.beams.append(self._beam_candidates(sched, state, logits[row + count - 1]))
            row += count
        jobs = self._jobs(step, inputs)
        if jobs:
            out = self.sampler(
                _select_rows(logits, [j.row for j in jobs]), self._sampling_rows(jobs),
                _grammar_mask(jobs, logits.shape[1]),
            )
            for i, job in enumerate(jobs):
                wants = job.state.params.num_logprobs is not None
                result.sampled.append(SampledToken(
                    job.seq_id, out.token_ids[i], out.logprobs[i],
                    rank=out.ranks[i] if wants and out.ranks else None,
                    top_logprobs=out.top_logprobs[i] if wants and out.top_logprobs else None,
                    top_ranks=out.top_ranks[i] if wants and out.top_ranks else None,
                ))
            for job, token in zip(jobs, out.token_ids):
                if job.state is self.batch.seqs.get(job.seq_id):
                    job.state.token_ids.append(token)
        return result

    def _beam_candidates(self, sched, state: SeqState, logits: torch.Tensor) -> BeamCandidates:
        """The beam's best continuations under log_softmax(logits / temperature)."""
        temperature = state.params.temperature
        row = logits.float() / temperature if temperature > 0 else logits.float()
        log_probs = torch.log_softmax(row, dim=-1)  # [vocab]
        if sched.allowed_token_bitmask is not None:  # not renormalised: a hypothesis keeps the model's logprob
            mask = mask_from_rows([sched.allowed_token_bitmask], log_probs.shape[0])
            log_probs = mask.apply(log_probs.unsqueeze(0).contiguous())[0]
        values, ids = torch.topk(log_probs, min(sched.num_beam_candidates, log_probs.shape[0]))
        return BeamCandidates(sched.seq_id, ids.tolist(), values.tolist())

    def _prompt_logprobs(self, state: SeqState, start_pos: int, logits: torch.Tensor) -> list[PromptLogprob]:
        """Logprobs of prompt tokens start_pos + 1 .. from the logits at start_pos ..."""
        k = state.params.prompt_logprobs
        logprobs = compute_logprobs(logits)  # [rows, vocab]
        top_vals, top_ids = top_k_logprobs(logprobs, k) if k else (None, None)
        entries = []
        for j in range(logits.shape[0]):
            position = start_pos + j + 1
            if position >= state.prompt_len:
                continue
            token = state.token_ids[position]
            row = logprobs[j]
            top = list(zip(top_ids[j].tolist(), top_vals[j].tolist())) if top_ids is not None else []
            rank = int((row > row[token]).sum().item()) + 1
            entries.append(PromptLogprob(position, token, float(row[token]), rank, top))
        return entries


def _build_native_kernels(device: torch.device, quantization: str | None) -> None:
    """Compile (or load from the per-user cache) the native kernels the model calls, at start-up,
    so that the C compiler never runs inside a forward pass. The float kernels were built when
    the layers bound to the device; the quantized ones are built here."""
    if device.type == "cpu" and quantization not in (None, "none"):
        quant_ops.available()


def apply_memory_ops(
    kv_cache: KVCache, ops: list[MemoryOp], disk_tier: DiskTier | None = None, times: TierTimes | None = None,
    shards: BlockShards | None = None,
) -> None:
    """Copies, swaps and tier moves in the order decided: a block freed by one op may be the
    target of the next, and an evicted block's KV is copied out before anything overwrites it.

    ``shards``: under tensor parallelism with a disk tier, every rank's part of each block
    saved or loaded goes through rank 0, which alone holds ``disk_tier`` (see block_shards.py)."""
    times = times if times is not None else TierTimes()
    apply = {
        MemoryOpKind.SWAP_OUT: kv_cache.swap_out,
        MemoryOpKind.SWAP_IN: kv_cache.swap_in,
        MemoryOpKind.COPY: kv_cache.copy_blocks,
        MemoryOpKind.HOST_TIER_OUT: kv_cache.swap_out,
        MemoryOpKind.HOST_TIER_IN: kv_cache.swap_in,
    }
    for op in ops:
        start = time.perf_counter()
        if op.kind in (MemoryOpKind.DISK_TIER_OUT, MemoryOpKind.HOST_TIER_TO_DISK):
            source = kv_cache.block_tensors() if op.kind is MemoryOpKind.DISK_TIER_OUT else kv_cache.cpu_block_tensors()
            _disk_tier_out(source, op.pairs, disk_tier, shards)
            times.disk_copy_seconds += time.perf_counter() - start
            continue
        if op.kind is MemoryOpKind.DISK_TIER_IN:
            claimed = raws = None
            if shards is None or shards.tp.is_first:
                if disk_tier is None:
                    raise RuntimeError("a disk-tier op reached a worker without a disk tier")
                claimed = raws = [disk_tier.take_claimed(ticket) for ticket, _ in op.pairs]
            if shards is not None:
                raws = shards.scatter(claimed, len(op.pairs))
            write_blocks(kv_cache.block_tensors(), [d for _, d in op.pairs], raws)
            if claimed is not None:
                disk_tier.recycle(claimed)  # copied: the reader fills these buffers again
            continue  # its seconds are the reader thread's (the disk tier counts them)
        apply[op.kind](op.pairs)
        if op.kind is MemoryOpKind.HOST_TIER_OUT:
            times.host_write_seconds += time.perf_counter() - start
        elif op.kind is MemoryOpKind.HOST_TIER_IN:
            times.host_read_seconds += time.perf_counter() - start


def _disk_tier_out(
    source: list[torch.Tensor], pairs: list[tuple[int, int]], disk_tier: DiskTier | None, shards: BlockShards | None
) -> None:
    """Host copies of the blocks go to the disk writer (which writes them off the step path);
    under tensor parallelism, whole blocks gathered on rank 0."""
    copies = read_blocks(source, [d for d, _ in pairs])
    if shards is not None:
        copies = shards.gather(copies)
        if not shards.tp.is_first:
            return
    if disk_tier is None:
        raise RuntimeError("a disk-tier op reached a worker without a disk tier")
    for (_, ticket), raw in zip(pairs, copies, strict=True):
        disk_tier.submit_write(ticket, raw)


def _grammar_mask(jobs: list[_Job], vocab_size: int) -> GrammarMask | None:
    """One bitmask for the jobs' rows; None when no row is constrained."""
    return mask_from_rows([job.allowed_token_bitmask for job in jobs], vocab_size)


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``; no copy when that is every row in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, on_device(rows, logits.device))
