"""Engine configuration: one frozen dataclass, validated at construction.

``EngineConfig(**kwargs)`` also takes vLLM's ``EngineArgs`` spellings, so that
``LLM(model=..., swap_space=4, gpu_memory_utilization=0.9, trust_remote_code=True)``
written for vLLM runs unchanged (see :func:`translate_engine_args`).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Literal

from pagedllm.errors import ConfigError

logger = logging.getLogger("pagedllm")

SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
PREEMPTION_MODES = ("recompute", "swap", "auto")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
# packed-weight activations per 32-block: two int8 levels (16-bit fixed point) or one
QUANT_ACTIVATIONS = ("int16", "int8")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # the per-step token budget when max_num_batched_tokens is None
KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
# Tokens of growth per running sequence kept free when admitting (one block at
# the default block size); measured in docs/benchmarks.md, "KV memory audit".
DEFAULT_NUM_HEADROOM_TOKENS = 16
# vLLM's default cap on logprobs / prompt_logprobs per request.
DEFAULT_MAX_LOGPROBS = 20
SUPPORTED_QUANTIZATIONS = (None, *QUANTIZATIONS)
# auto: the model's dtype; the 8-bit formats are pagedllm.kv.kv_format's (kept
# here by name so that importing the config does not import torch).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "fp8")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's spelling
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding generation_config.json
GIB = 2**30
DEFAULT_KV_CACHE_DIR_SIZE = 16 * GIB
DEFAULT_CUDA_KV_HOST_CACHE_MEMORY = 4 * GIB

DType = Literal["auto", "float32", "bfloat16", "float16"]


def step_token_budget(max_num_batched_tokens: int | None, max_num_seqs: int) -> int:
    """The most tokens one step schedules: ``max_num_batched_tokens``, else 2,048 or
    ``max_num_seqs`` where that is larger (a step can then decode every running sequence)."""
    return max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


def _choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


def _positive(name: str, value: int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")


def _not_yet(name: str, value: object, supported: tuple) -> None:
    if value not in supported:
        raise ConfigError(
            f"{name}={value!r} is not supported yet; pagedllm accepts {name} "
            f"{' or '.join(repr(v) for v in supported)} only"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, before the model is read.

    Sizes: ``kv_cache_memory`` and ``swap_space_bytes`` are in bytes (vLLM's
    ``kv_cache_memory_bytes`` and ``swap_space`` in GiB are accepted as
    keywords and converted); ``num_kv_blocks`` is an exact count of KV blocks
    and wins over ``kv_cache_memory``, which wins over ``gpu_memory_utilization``.
    ``gpu_memory_utilization``: the share of memory given to weights plus KV
    cache, as vLLM sizes it: of the device's memory on CUDA, of the RAM not
    used by other processes on the CPU; ``None`` keeps pagedllm's default
    (half the free device memory on CUDA, 4 GiB on the CPU).
    ``max_num_batched_tokens`` is the per-step token budget (prefill chunks plus
    decode tokens); ``None`` picks a default from the device.
    ``num_headroom_tokens``: a request is admitted only while the free KV blocks
    left afterwards still cover that many more tokens of every running sequence
    (none past its max_tokens, and never more than a tenth of the cache in all);
    0 admits whenever the prompt fits.
    ``quantization``: None or "none" (dense weights of ``dtype``), "gguf" (a GGUF's
    Q4_0/Q4_1/Q8_0 tensors served packed), "int8"/"int4" (weight-only RTN with
    ``quantization_group_size`` weights per scale); CPU only.
    ``quant_activations``: how packed weights' matmuls quantize their inputs per
    32-block: "int16" (two int8 levels, 16-bit fixed point: the dequantized
    weights' accuracy; the default) or "int8" (one level, as llama.cpp's Q8
    activations: half the integer work on many rows, larger logit error).
    ``async_scheduling``: schedule and launch each decode step before reading
    the previous step's tokens (stop conditions are then seen one step late);
    ``None`` turns it on where CUDA graphs run.
    ``tensor_parallel_size``: ranks the model is split over (heads, MLP,
    vocabulary), one process each, over torch.distributed (gloo on CPU, NCCL
    on CUDA); each rank takes its share of the CPU cores.
    ``max_logprobs``: the most ``logprobs`` / ``prompt_logprobs`` a request may
    ask for; ``None`` (vLLM's -1) is no cap.
    ``generation_config``: where default sampling parameters come from:
    ``auto`` (the model's generation_config.json or GGUF metadata), ``vllm``
    (SamplingParams' own defaults) or a folder with a generation_config.json.
    ``override_generation_config``: generation_config.json keys (temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens) set over those
    defaults, as vLLM's; with ``generation_config="vllm"`` they are the only ones.
    ``rope_scaling``: an HF ``rope_scaling`` dict (``rope_type`` or ``type``:
    linear | dynamic | yarn | llama3, plus its parameters) that replaces the
    model's; it lets ``max_model_len`` go past the trained context.
    Tiered prefix cache: a cached block evicted from the device pool is kept in
    a host-memory tier of ``kv_host_cache_memory`` bytes (``None``: 0 on a CPU
    device, whose pool already is host memory; 4 GiB, at most an eighth of the
    RAM, on CUDA; per rank, like the swap space) and written to a
    disk tier under ``kv_cache_dir`` (off when None) of at most
    ``kv_cache_dir_size`` bytes, which a restarted engine reuses.
    ``kv_cache_prefault``: zero-fill the KV pools held in host memory at start-up,
    so that they are resident from the start instead of growing the process
    block by block as they are first used (``pagedllm serve`` turns it on), and
    on 2 MiB pages where Linux grants them (faster decode attention; see
    pagedllm/native/host_memory.py); on the CPU the native layer stack's
    activations for a step of ``step_token_budget`` tokens are made resident too.
    """

    model: str | None = None
    dtype: DType = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    swap_space_bytes: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    kv_policy: str = "paged"
    num_headroom_tokens: int = DEFAULT_NUM_HEADROOM_TOKENS
    attention_backend: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    num_threads: int | None = None
    quantization_group_size: int = 32
    seed: int = 0
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS
    tensor_parallel_size: int = 1
    quantization: str | None = None
    quant_activations: str = "int16"
    kv_cache_dtype: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    rope_scaling: dict | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_size: int = DEFAULT_KV_CACHE_DIR_SIZE
    kv_host_cache_memory: int | None = None
    kv_cache_prefault: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(
                f"block_size={self.block_size!r} is not supported; "
                f"choose one of {list(SUPPORTED_BLOCK_SIZES)}"
            )
        _choice("dtype", self.dtype, SUPPORTED_DTYPES)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("kv_policy", self.kv_policy, KV_POLICIES)
        _not_yet("quantization", self.quantization, SUPPORTED_QUANTIZATIONS)
        _choice("quantization_group_size", self.quantization_group_size, QUANTIZATION_GROUP_SIZES)
        _choice("quant_activations", self.quant_activations, QUANT_ACTIVATIONS)
        if self.device not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ConfigError(f"device={self.device!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
        _positive("num_kv_blocks", self.num_kv_blocks)
        _positive("kv_cache_memory", self.kv_cache_memory)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_seqs", self.max_num_seqs, allow_none=False)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("num_threads", self.num_threads)
        _non_negative("num_headroom_tokens", self.num_headroom_tokens)
        _positive("max_logprobs", self.max_logprobs)
        self._check_memory()
        self._check_tiers()
        self._check_not_yet_supported()
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ConfigError(
                "override_generation_config must be a dict of generation_config.json keys, such as "
                f"{{'temperature': 0.5, 'max_new_tokens': 64}}, got {self.override_generation_config!r}"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(
                f"rope_scaling must be a dict such as {{'rope_type': 'yarn', 'factor': 4.0}}, "
                f"got {self.rope_scaling!r}"
            )
        if not isinstance(self.kv_cache_prefault, bool):
            raise ConfigError(f"kv_cache_prefault must be True or False, got {self.kv_cache_prefault!r}")
        if self.async_scheduling not in (None, True, False):
            raise ConfigError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")
        if self.preemption_mode == "swap" and self.swap_space_bytes == 0:
            # Swap needs somewhere to go; say so rather than silently recomputing.
            raise ConfigError("preemption_mode='swap' needs a CPU swap pool: set swap_space (GiB) > 0")

    def _check_tiers(self) -> None:
        _positive("kv_cache_dir_size", self.kv_cache_dir_size, allow_none=False)
        if self.kv_host_cache_memory is not None:
            _non_negative("kv_host_cache_memory", self.kv_host_cache_memory)
        if self.kv_cache_dir is not None and (not isinstance(self.kv_cache_dir, (str, os.PathLike))
                                              or not str(self.kv_cache_dir)):
            raise ConfigError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")

    def _check_memory(self) -> None:
        if not isinstance(self.swap_space_bytes, int) or isinstance(self.swap_space_bytes, bool) \
                or self.swap_space_bytes < 0:
            raise ConfigError(f"swap_space_bytes must be a byte count >= 0, got {self.swap_space_bytes!r}")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1):
            raise ConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")

    def _check_not_yet_supported(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size, allow_none=False)
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ConfigError("async_scheduling is not supported with tensor_parallel_size > 1; leave it unset")
        if self.tensor_parallel_size > 1 and self.quantization in ("int8", "int4"):
            raise ConfigError(
                f"quantization={self.quantization!r} with tensor_parallel_size > 1 is not supported yet; "
                "use a GGUF file with quantization='gguf', tensor_parallel_size=1 or quantization='none'"
            )
        _not_yet("kv_cache_dtype", self.kv_cache_dtype, SUPPORTED_KV_CACHE_DTYPES)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(
                f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}"
            )

    @property
    def step_token_budget(self) -> int:
        """The most tokens one step schedules (see :func:`step_token_budget`)."""
        return step_token_budget(self.max_num_batched_tokens, self.max_num_seqs)

    @property
    def swap_space(self) -> float:
        """The CPU swap pool in GiB, vLLM's unit."""
        return self.swap_space_bytes / GIB


# ---------------------------------------------------------------------------
# vLLM's EngineArgs spellings
# ---------------------------------------------------------------------------

# vLLM engine arguments with no effect here: accepted with any value, one log line each.
IGNORED_ARGS: dict[str, str] = {
    "trust_remote_code": "the supported architectures are implemented here; no model code is run",
    "tokenizer_mode": "the model's fast tokenizer is always used",
    "revision": "models load from local files only",
    "code_revision": "models load from local files only",
    "tokenizer_revision": "models load from local files only",
    "download_dir": "models load from local files only; nothing is downloaded",
    "hf_token": "models load from local files only; nothing is downloaded",
    "config_format": "the config is read from the model's own files",
    "model_impl": "pagedllm has one implementation per architecture",
    "disable_log_stats": "pagedllm logs no periodic statistics (see /metrics)",
    "disable_log_requests": "pagedllm does not log requests",
    "enable_log_requests": "pagedllm does not log requests",
    "served_model_name": "names matter to the server only: use pagedllm serve --served-model-name",
    "max_seq_len_to_capture": "CUDA graphs cover decode batches up to max_num_seqs at any length",
    "compilation_config": "CUDA graphs are captured unless enforce_eager=True; nothing else is compiled",
    "disable_custom_all_reduce": "there is no custom all-reduce",
    "distributed_executor_backend": "one process serves the model",
    "max_parallel_loading_workers": "weights load in one pass",
    "disable_sliding_window": "sliding-window attention is not implemented; max_model_len stays within the window",
    "disable_cascade_attn": "there is no cascade attention",
    "use_v2_block_manager": "there is one block manager",
    "num_scheduler_steps": "one scheduling iteration per step",
    "disable_async_output_proc": "outputs are processed in the step that samples them",
    "limit_mm_per_prompt": "the supported models are text-only",
    "mm_processor_kwargs": "the supported models are text-only",
    "allowed_local_media_path": "the supported models are text-only",
    "otlp_traces_endpoint": "tracing is not implemented",
    "long_prefill_token_threshold": "prefill chunks are limited by max_num_batched_tokens only",
    "max_num_partial_prefills": "prefill chunks are limited by max_num_batched_tokens only",
}

# vLLM engine arguments accepted only with the values that mean "off" or
# "what pagedllm does"; any other value raises ConfigError.
NO_OP_VALUES: dict[str, tuple] = {
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "cpu_offload_gb": (0,),
    "tokenizer": (None,),
    "skip_tokenizer_init": (False,),
    "enable_lora": (False, None),
    "speculative_config": (None,),
    "hf_overrides": (None,),
    "logits_processors": (None,),
    "kv_transfer_config": (None,),
    "enable_expert_parallel": (False,),
    "enable_chunked_prefill": (True, None),
    "enable_sleep_mode": (False,),
    "calculate_kv_scales": (False,),
    "scheduling_policy": ("fcfs",),
    "load_format": ("auto", "gguf", "safetensors"),
    "runner": ("auto", "generate"),
    "task": ("auto", "generate"),
}

# Grammar backends a request's structured outputs may name; pagedllm compiles with xgrammar.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


def _check_structured_outputs_backend(name: str, value: object) -> None:
    """vLLM's ``guided_decoding_backend`` (a backend name) or ``structured_outputs_config`` (a dict or
    config object with ``backend``): accepted where the backend is auto or xgrammar, pagedllm's own."""
    if value is None:
        return
    if name == "structured_outputs_config":
        options = value if isinstance(value, dict) else dict(getattr(value, "__dict__", {}) or {})
        if not isinstance(value, dict) and not options:
            raise ConfigError(f"structured_outputs_config must be a dict such as {{'backend': 'xgrammar'}}, "
                              f"got {value!r}")
        other = sorted(k for k, v in options.items() if k != "backend" and v not in (None, False, ""))
        if other:
            raise ConfigError(f"structured_outputs_config: only 'backend' is supported here, got {other}")
        value = options.get("backend", "auto")
    if value not in STRUCTURED_OUTPUT_BACKENDS:
        raise ConfigError(f"{name}: pagedllm compiles grammars with xgrammar; use 'auto' or 'xgrammar', got {value!r}")


# vLLM name -> EngineConfig field, where only the name (or the unit) differs.
RENAMED_ARGS = {
    "kv_cache_memory_bytes": "kv_cache_memory",
    "num_gpu_blocks_override": "num_kv_blocks",
    "swap_space": "swap_space_bytes",  # GiB -> bytes
}


BACKEND_ARGS = ("guided_decoding_backend", "structured_outputs_config")


def field_names() -> tuple[str, ...]:
    """EngineConfig's own keyword arguments."""
    return tuple(f.name for f in fields(EngineConfig))


def known_argument_names() -> tuple[str, ...]:
    """Every keyword EngineConfig / LLM accepts: its fields and vLLM's spellings."""
    return (*field_names(), *RENAMED_ARGS, *NO_OP_VALUES, *IGNORED_ARGS, *BACKEND_ARGS)


def translate_engine_args(kwargs: dict) -> dict:
    """EngineConfig fields from keyword arguments that may use vLLM's EngineArgs names.

    ``swap_space`` is GiB (vLLM's unit) and becomes ``swap_space_bytes``;
    ``kv_cache_memory_bytes`` and ``num_gpu_blocks_override`` are other names of
    ``kv_cache_memory`` and ``num_kv_blocks``; ``dtype`` takes vLLM's spellings
    and torch dtypes; ``max_logprobs=-1`` is no cap. Arguments that mean nothing
    here are logged once each and dropped; an unknown name raises ConfigError
    naming the closest known one.
    """
    names = set(field_names())
    result: dict = {}
    for name, value in kwargs.items():
        if name in names:
            target, converted = name, value
        elif name in RENAMED_ARGS:
            target, converted = RENAMED_ARGS[name], _convert_renamed(name, value)
        elif name in NO_OP_VALUES:
            if not (name == "tokenizer" and value == kwargs.get("model")):  # the model's own tokenizer
                _not_yet(name, value, NO_OP_VALUES[name])
            continue
        elif name in BACKEND_ARGS:
            _check_structured_outputs_backend(name, value)
            continue
        elif name in IGNORED_ARGS:
            logger.info("engine argument %s=%r has no effect in pagedllm: %s", name, value, IGNORED_ARGS[name])
            continue
        else:
            raise ConfigError(_unknown_argument_message(name))
        if target in result:
            raise ConfigError(f"{name} and {_spelling_of(target, kwargs, name)} set the same option; give one")
        result[target] = converted
    if "dtype" in result:
        result["dtype"] = _dtype_name(result["dtype"])
    if result.get("max_logprobs") == -1:
        result["max_logprobs"] = None
    return result


def _convert_renamed(name: str, value: object) -> object:
    if name != "swap_space":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"swap_space is the CPU swap pool in GiB (a number >= 0), got {value!r}")
    return int(value * GIB)


def _spelling_of(target: str, kwargs: dict, other: str) -> str:
    spellings = [n for n in kwargs if n != other and (n == target or RENAMED_ARGS.get(n) == target)]
    return spellings[0] if spellings else target


def _dtype_name(value: object) -> object:
    text = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    return DTYPE_ALIASES.get(text, text)


def _unknown_argument_message(name: str) -> str:
    close = difflib.get_close_matches(name, known_argument_names(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; docs/vllm-compat.md lists the accepted arguments"
    return f"unknown engine argument {name!r}{hint}"


def _accept_engine_args(cls: type) -> type:
    """Routes ``cls(**kwargs)`` through translate_engine_args before the dataclass __init__."""
    field_init = cls.__init__

    @functools.wraps(field_init)
    def __init__(self, *args, **kwargs) -> None:
        field_init(self, *args, **translate_engine_args(kwargs))

    cls.__init__ = __init__
    return cls


_accept_engine_args(EngineConfig)
