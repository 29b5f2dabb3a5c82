"""The synchronous engine: requests in, one scheduling iteration per ``step()``, outputs out."""

from __future__ import annotations

import atexit
import dataclasses
import enum
import itertools
import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.sequence import FinishReason, Request, Sequence
from pagedllm.engine.step_builder import StepBuilder
from pagedllm.errors import ConfigError, EngineDeadError, RequestError
from pagedllm.kv import kv_format
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.stats import KVCacheStats
from pagedllm.kv.tiers import DiskTier, block_layout, layout_nbytes, model_identity, tier_key
from pagedllm.limits import INT64_MAX, RequestLimits, check_text, check_token_ids
from pagedllm.models.loader import default_quantization
from pagedllm.models.paths import model_display_name, resolve_model_path
from pagedllm.native.threads import set_engine_threads
from pagedllm.outputs import RequestMetrics, RequestOutput, delta_output, stream_due
from pagedllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    check_output_kind,
    prompt_tokens_kept,
)
from pagedllm.step import StepResult
from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.tokenizer import Tokenizer
from pagedllm.worker.worker import (  # noqa: F401  (re-exported: the defaults and resolvers are imported from here)
    DEFAULT_CPU_KV_MEMORY,
    Worker,
    apply_memory_ops,
    resolve_device,
    resolve_dtype,
)

logger = logging.getLogger("pagedllm")


@dataclass
class LaunchedStep:
    """A step whose tokens are drawn on the device and not read yet (the worker holds them)."""

    jobs: list[tuple[Request, Sequence]]  # who gets a token from it, in row order


class AheadMode(enum.Enum):
    """How a step scheduled before the current step's tokens were read was run."""

    LAUNCHED = "launched"  # its tokens stay on the device; a later step() reads them
    EXECUTED = "executed"  # run and read at once: a row needs the host (logprobs, penalties, ...)
    FORWARD_ONLY = "forward_only"  # sampled once the grammar masks, which need the current tokens, are known


@dataclass
class StepAhead:
    """The step run ahead of the current one (LLMEngine._launch_ahead)."""

    out: SchedulerOutput
    mode: AheadMode
    result: StepResult | None = None  # EXECUTED: its result, read already
    launched: LaunchedStep | None = None  # LAUNCHED: who gets its tokens


def _has_live_job(step: LaunchedStep) -> bool:
    return any(not seq.is_finished and not request.is_finished for request, seq in step.jobs)


@dataclass
class EngineStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_swapped_reqs: int
    kv: KVCacheStats
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    peak_num_running_reqs: int = 0  # since start: the most requests in the running batch at once


class LLMEngine:
    """Requests in, one scheduling iteration per ``step()``, outputs out.

    The engine schedules, forks, checks stop conditions and detokenizes; the
    model, the KV tensors and the sampler belong to its :class:`Worker`,
    which it drives with plain step messages (pagedllm.step). ``limits``
    bounds what one request may ask for (``RequestLimits()`` with the
    config's ``max_logprobs`` when None).
    """

    def __init__(self, config: EngineConfig, limits: RequestLimits | None = None) -> None:
        start = time.monotonic()
        self.config = config
        # Offline, EngineConfig.max_logprobs (vLLM's engine argument) is the cap; None: none.
        self.limits = limits if limits is not None else RequestLimits(max_logprobs=config.max_logprobs or INT64_MAX)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif config.tensor_parallel_size == 1:
            set_engine_threads()  # the cores no other process keeps busy, unless a count was set
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per engine seed
        self.model_path = resolve_model_path(config.model)
        if config.quantization is None:  # unset: what suits this checkpoint and device (loader.default_quantization)
            config = self.config = dataclasses.replace(
                config, quantization=default_quantization(self.model_path, config.device, config.dtype))
        self.model_name = model_display_name(self.model_path)
        self.tokenizer = Tokenizer.load(self.model_path)
        eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._start_workers(eos_token_ids)
        self.max_model_len = self._resolve_max_model_len()
        self.block_manager, self.scheduler = self._make_scheduler()
        if self.executor.uses_cuda_graphs():
            self.worker.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        # This engine's sequence ids, 0, 1, ...: another engine in the process counts on its own.
        self.new_seq_id = itertools.count().__next__
        # Ranks other than 0 do not sample, so under tensor parallelism every token is sent.
        self.steps = StepBuilder(
            self.scheduler, self.new_seq_id, self.model_config.vocab_size, self.max_model_len,
            eos_token_ids=eos_token_ids, send_sampled_tokens=config.tensor_parallel_size > 1,
        )
        self.processor = OutputProcessor(self.scheduler, self.steps, self.tokenizer, self.max_model_len)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer.hf, self.model_config.vocab_size, list(self.tokenizer.eos_token_ids)
        )
        # Default: on where it pays, with CUDA graphs (the device runs while the host schedules).
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.executor.uses_cuda_graphs()
        )
        self._in_flight: LaunchedStep | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        logger.info(
            "engine ready in %.1f s: %s on %s (%s), %d KV blocks x %d tokens, max_model_len %d",
            time.monotonic() - start, self.model_name, self.device, self.dtype,
            self.kv_cache.num_blocks, config.block_size, self.max_model_len,
        )

    def _start_workers(self, eos_token_ids: tuple[int, ...]) -> None:
        """The worker (rank 0 in this process) and, under tensor parallelism, the other ranks."""
        config = self.config
        if config.tensor_parallel_size > 1:
            from pagedllm.worker.executor import MultiprocExecutor

            self.executor = MultiprocExecutor(config, eos_token_ids)
            self.worker = self.executor.worker  # rank 0, in this process
        else:
            self.worker = Worker(config, eos_token_ids)
            self.worker.init_kv_cache(*self.worker.num_kv_blocks_for_config())
            self.executor = self.worker
        self.device, self.dtype = self.worker.device, self.worker.dtype
        self.model_config = self.worker.model_config

    def _make_scheduler(self) -> tuple[BlockManager, Scheduler]:
        """The block manager over the worker's KV pool, and the scheduler that owns it."""
        config = self.config
        layout = block_layout(self.kv_cache.block_tensors())
        self.disk_tier = self._make_disk_tier(layout)
        self.worker.disk_tier = self.disk_tier
        block_manager = BlockManager(
            self.kv_cache.num_blocks,
            config.block_size,
            num_cpu_blocks=self.kv_cache.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_host_tier=self.worker.host_tier_memory() > 0,
            disk_tier=self.disk_tier,
            block_nbytes=layout_nbytes(layout),
            tier_times=self.worker.tier_times,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget,
            max_model_len=self.max_model_len,
            preemption_mode=config.preemption_mode,
            kv_policy=config.kv_policy,
            num_headroom_tokens=config.num_headroom_tokens,
        )
        return block_manager, Scheduler(scheduler_config, block_manager)

    def _make_disk_tier(self, layout) -> DiskTier | None:
        """The disk tier of the prefix cache, keyed by everything a block's bytes depend on."""
        config = self.config
        if config.kv_cache_dir is None or not config.enable_prefix_caching:
            return None
        if self.worker.block_shards is not None:  # tensor parallelism: files hold every rank's KV heads
            layout = self.worker.block_shards.full_layout
        identity = model_identity(self.model_path)
        (k_shape, k_dtype), encoding = layout[0], ""
        if kv_format.stores_rotated(k_dtype, k_shape[-1]):
            encoding = "|kv=hadamard"  # what the codes mean, beyond their dtype
        key = tier_key(
            model_identity=f"{identity}|weights={config.quantization or 'none'}/{config.quantization_group_size}"
                           f"|rope={config.rope_scaling!r}{encoding}",
            dtype=str(self.dtype), layout=layout, block_size=config.block_size, tp_rank=0,
            tp_size=config.tensor_parallel_size,
        )
        # Prefetched copies wait in RAM until admission claims them: at most a device pool's worth, 1 GiB.
        max_loaded = max(64, min(self.kv_cache.num_blocks, 2**30 // layout_nbytes(layout)))
        disk = DiskTier(config.kv_cache_dir, key, layout, config.kv_cache_dir_size, max_loaded_blocks=max_loaded)
        engine = weakref.ref(self)
        atexit.register(lambda: engine() is not None and engine().close_kv_tiers())
        return disk

    def close_kv_tiers(self) -> None:
        """Save the cached blocks the disk tier lacks and finish its writes (idempotent).

        Called at shutdown (and at interpreter exit), so that an engine started
        later on the same kv_cache_dir finds whole prefixes there."""
        disk = getattr(self, "disk_tier", None)
        if disk is None or disk.closed:
            return
        if disk.enabled:
            ops = self.block_manager.flush_to_disk()
            try:
                self.executor.apply_memory_ops(ops)  # every rank, under tensor parallelism
            except EngineDeadError as error:
                logger.warning("kv_cache_dir: blocks not saved at shutdown: %s", error)
        disk.close()

    def shutdown(self) -> None:
        """Save the disk tier and stop the worker processes, if any; the engine is unusable after."""
        self.close_kv_tiers()
        if self.executor is not self.worker:
            self.executor.shutdown()

    @property
    def kv_cache(self) -> KVCache:
        """Rank 0's KV tensors (every rank holds the same number of blocks)."""
        return self.worker.kv_cache

    @classmethod
    def from_config(cls, config: EngineConfig, limits: RequestLimits | None = None) -> LLMEngine:
        return cls(config, limits)

    @property
    def vocab_size(self) -> int:
        """Token ids a request may use are in [0, vocab_size)."""
        return self.model_config.vocab_size

    # ---- start-up ---------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        """The explicit max_model_len once checked, else the largest one that is safe.

        A sliding-window model also bounds it: attention here is full causal, which
        equals windowed attention only while no sequence is longer than the window.
        """
        model_limit = self.model_config.max_context_len
        window = self.model_config.sliding_window
        capacity = self.kv_cache.num_blocks * self.config.block_size
        wanted = self.config.max_model_len
        if wanted is not None:
            self.model_config.check_max_model_len(wanted)
        if wanted is not None and window is not None and wanted > window:
            raise ConfigError(
                f"max_model_len={wanted} exceeds the model's sliding attention window ({window} tokens), "
                f"and sliding-window attention is not implemented; set max_model_len <= {window}"
            )
        if wanted is not None and wanted > capacity:
            raise ConfigError(
                f"max_model_len={wanted} does not fit the KV cache ({capacity} token slots); "
                "raise num_kv_blocks / kv_cache_memory or lower max_model_len"
            )
        if wanted is not None:
            return wanted
        if window is not None and window < min(model_limit, capacity):
            logger.info(
                "max_model_len capped at the sliding attention window of %d tokens: sliding-window "
                "attention is not implemented, and full attention gives the same outputs only up to it",
                window,
            )
            return window
        return min(model_limit, capacity)

    # ---- requests ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """``output_kind``, when given, replaces the params' (``LLM.generate`` asks for FINAL_ONLY;
        the async engine for CUMULATIVE, which it turns into the params' kind per stream)."""
        params = params if params is not None else SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise RequestError(f"params must be SamplingParams or BeamSearchParams, got {params!r}", param="params")
        params.check_limits(self.limits, self.vocab_size)
        if isinstance(params, SamplingParams) and params.bad_words:
            params.resolve_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        keep = (prompt_tokens_kept(params.truncate_prompt_tokens, self.max_model_len)
                if isinstance(params, SamplingParams) else None)
        text, token_ids = self._tokenize_prompt(prompt, keep)
        self._check_lengths(token_ids, params)
        self._check_kv_demand(len(token_ids), params)
        grammar = self.grammar_compiler.compile(params.structured_outputs) if params.structured_outputs else None
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            cache_salt=cache_salt,
            grammar=grammar,
        )
        if output_kind is not None:
            request.output_kind = check_output_kind(output_kind)
        elif isinstance(params, SamplingParams):
            request.output_kind, request.progress.stream_interval = params.output_kind, params.stream_interval
        request.seqs.append(self.processor.new_sequence(request, sample_index=0))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        self.num_prompt_tokens_total += len(token_ids)

    def _tokenize_prompt(self, prompt: str | list[int] | dict, keep: int | None = None) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids; with ``keep`` only its last
        ``keep`` tokens (truncate_prompt_tokens), whose text is then the decoded tokens kept."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):
                    raise RequestError(
                        f"prompt_token_ids must be a list of token ids, got {type(prompt).__name__}",
                        param="prompt_token_ids",
                    )
                prompt = list(prompt)
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", param="prompt")
            check_text(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:  # e.g. only whitespace for a tokenizer that drops it
                raise RequestError(
                    f"the prompt {prompt[:40]!r} has no tokens for this model's tokenizer; give some text",
                    param="prompt",
                )
            if keep is not None and len(token_ids) > keep:
                token_ids = token_ids[-keep:]
                return self.tokenizer.decode(token_ids, skip_special_tokens=False), token_ids
            return prompt, token_ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise RequestError("the prompt must be a non-empty string or list of token ids", param="prompt")
        if keep is not None:
            prompt = prompt[-keep:]
        if len(prompt) >= self.max_model_len:  # before looking at each id
            self._check_lengths(prompt, None)
        check_token_ids(prompt, self.vocab_size, "prompt")
        return None, list(prompt)

    def _check_lengths(
        self, token_ids: list[int] | tuple[int, ...], params: SamplingParams | BeamSearchParams | None
    ) -> None:
        limit = self.max_model_len
        if len(token_ids) >= limit:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens but this model's context is {limit} tokens; "
                "shorten the prompt", param="prompt",
            )
        if params is not None and params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(token_ids) + params.max_tokens} exceeds the context of {limit} tokens; "
                "lower max_tokens or shorten the prompt", param="max_tokens",
            )

    def _check_kv_demand(self, num_prompt_tokens: int, params: SamplingParams | BeamSearchParams) -> None:
        """Refuses a request whose sequences, all at their longest, need more KV blocks than the cache has.

        Its sequences share the prompt's full blocks; each then needs its own
        blocks up to prompt + max_tokens (max_model_len when max_tokens is None).
        Such a request could only fail part-way, after taking the whole cache.
        """
        is_beam = isinstance(params, BeamSearchParams)
        num_seqs = params.beam_width if is_beam else params.num_samples
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt_tokens
        bs = self.block_manager.block_size
        needed = self.block_manager.num_blocks_for_group(
            [num_prompt_tokens + max_tokens] * num_seqs, num_shared_slots=num_prompt_tokens)
        capacity = self.kv_cache.num_blocks
        if needed <= capacity:
            return
        if num_seqs == 1:
            param = "max_tokens"
        elif is_beam:
            param = "beam_width"
        else:
            param = "best_of" if params.best_of is not None else "n"
        raise RequestError(
            f"{param}: {num_seqs} sequence(s) of up to {num_prompt_tokens + max_tokens} tokens "
            f"({num_prompt_tokens} prompt + {max_tokens} max_tokens) need {needed} KV blocks of {bs} tokens, "
            f"but the whole cache holds {capacity}; lower n/best_of or max_tokens",
            param=param,
        )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None and not request.is_finished:
                self.scheduler.finish_request(request, FinishReason.ABORT)
        if self._in_flight is not None and not _has_live_job(self._in_flight):
            self._in_flight = None  # nothing left to read from it
            self.executor.collect()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def interrupt_wait(self) -> None:
        """Thread-safe: a step() sleeping on a disk-tier load returns now (a new request has
        come in, whose own prefix loads must start at once)."""
        self.scheduler.interrupt_prefetch_wait()

    # ---- one iteration ----------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_overlapped()
        out = self.scheduler.schedule()
        touched: dict[str, Request] = {r.request_id: r for r in out.failed}
        if out.is_empty:
            self.scheduler.wait_for_prefetch()  # a waiting request's prefix is loading from disk
        else:
            result = self.executor.execute(self.steps.build(out))
            self.scheduler.on_step_computed(out)
            for request in self.processor.process(out, result):
                touched[request.request_id] = request
        return self._outputs(touched)

    # ---- overlapped steps (async scheduling) -------------------------------
    #
    # The host schedules and launches step N+1 before it reads step N's
    # tokens, so building inputs and launching kernels overlap the device's
    # work and the wait for N's tokens is (mostly) over by the time they are
    # read. Each sequence that draws a token in N counts it as pending
    # (Sequence.num_pending_tokens: its position is scheduled, its id is in
    # no token list; the step message says the worker holds that token, and
    # the worker feeds it from N's output on the device); it becomes a known
    # token when N's tokens are read, in the same step() call: between calls
    # no token is pending. Stop conditions are seen one step late; a sequence
    # that stopped in N has computed one position in N+1 that nobody reads.
    #
    # Only the steady decode state runs ahead: every running sequence drew a
    # token in N, none needs the host between steps (can_sample_ahead), and
    # enough blocks are free that N+1 cannot preempt. Anything else (prefill
    # chunks, swaps, forks, logprobs, penalties) takes the ordinary step.

    def _step_overlapped(self) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        current, self._in_flight = self._in_flight, None
        if current is None:
            current = self._start_overlap(touched)
            if current is None:
                return self._outputs(touched)
        ahead = self._launch_ahead(current, touched)
        touched.update((r.request_id, r) for r in self.processor.finish_launched(current.jobs, self.executor.collect()))
        for _, seq in current.jobs:  # a request the scheduler failed above never read its pending token
            seq.num_pending_tokens = 0
        if ahead is not None:
            self._finish_ahead(ahead, touched)
        return self._outputs(touched)

    def _start_overlap(self, touched: dict[str, Request]) -> LaunchedStep | None:
        """With nothing in flight: launch a step whose tokens may be read later and return it,
        or run one that needs the host and process it now (None)."""
        out = self.scheduler.schedule()
        touched.update((r.request_id, r) for r in out.failed)
        if out.is_empty:
            self.scheduler.wait_for_prefetch()  # a waiting request's prefix is loading from disk
            return None
        step = self.steps.build(out)
        if not self.processor.can_launch(out):
            result = self.executor.execute(step)
            self.scheduler.on_step_computed(out)
            touched.update((r.request_id, r) for r in self.processor.process(out, result))
            return None
        self.executor.launch(step)
        self.scheduler.on_step_computed(out)
        return LaunchedStep(self.processor.launched_jobs(out))

    def _launch_ahead(self, current: LaunchedStep, touched: dict[str, Request]) -> StepAhead | None:
        """Schedule and run the step after ``current`` before its tokens are read; None when
        that is not safe or nothing is scheduled."""
        growing = self._seqs_to_run_ahead(current)
        if not growing:
            return None
        for seq in growing:
            seq.num_pending_tokens = 1
        out = self.scheduler.schedule()
        touched.update((r.request_id, r) for r in out.failed)
        if out.is_empty:
            return None
        step = self.steps.build(out)
        self.num_overlapped_steps += 1
        if any(seq.grammar is not None and seq.num_pending_tokens for _, seq in out.entries):
            self.executor.forward_only(step)
            return StepAhead(out, AheadMode.FORWARD_ONLY)
        if not self.processor.can_launch(out):
            return StepAhead(out, AheadMode.EXECUTED, result=self.executor.execute(step))
        self.executor.launch(step)
        return StepAhead(out, AheadMode.LAUNCHED, launched=LaunchedStep(self.processor.launched_jobs(out)))

    def _seqs_to_run_ahead(self, current: LaunchedStep) -> list[Sequence]:
        """The sequences drawing a token in ``current`` that take the next step before it is read;
        [] unless every running sequence is one of them and the step can neither preempt nor fail."""
        scheduler = self.scheduler
        live = [(request, seq) for request, seq in current.jobs if not seq.is_finished and not request.is_finished]
        if not live or scheduler.swapped:
            return []
        num_running = sum(len(request.live_seqs()) for request in scheduler.running)
        # Every running sequence decodes one token (at most one new block each),
        # so the step below neither preempts nor fails a running request.
        if num_running != len(live) or self.block_manager.get_num_free_blocks() < len(live):
            return []
        # A sequence whose token being drawn is its last by length gets no next step.
        return [seq for request, seq in live if not request.ends_by_length(seq.num_tokens + 1, self.max_model_len)]

    def _finish_ahead(self, ahead: StepAhead, touched: dict[str, Request]) -> None:
        """After ``current``'s tokens are read: the step run ahead is computed; read it, or keep it in flight."""
        out = ahead.out
        self.scheduler.on_step_computed(out)  # the tokens it hashes for the prefix cache are known now
        if ahead.mode is AheadMode.LAUNCHED:
            if _has_live_job(ahead.launched):
                self._in_flight = ahead.launched
            else:
                self.executor.collect()  # nobody reads it
            return
        result = ahead.result
        if ahead.mode is AheadMode.FORWARD_ONLY:
            result = self.executor.sample_deferred(self.steps.grammar_masks(out))
        touched.update((r.request_id, r) for r in self.processor.process(out, result))

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.output_kind == RequestOutputKind.FINAL_ONLY and not request.is_finished:
                continue  # nothing to build until it ends
            output = self.processor.make_output(request)
            if output is None:
                continue
            if not output.finished and not stream_due(request.progress, output):
                continue
            if request.is_finished:
                self.requests.pop(request.request_id, None)
            if request.output_kind == RequestOutputKind.DELTA:
                output = delta_output(request.progress, output)
            outputs.append(output)
        self.num_generation_tokens_total += self.processor.take_num_new_tokens()
        return outputs

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running_reqs=len(s.running),
            num_waiting_reqs=len(s.waiting),
            num_swapped_reqs=len(s.swapped),
            kv=self.block_manager.stats(),
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_preemptions_total=s.num_preemptions,
            peak_num_running_reqs=s.peak_num_running,
        )

    def sequence(self, request_id: str) -> list[Sequence]:
        return list(self.requests[request_id].seqs)
