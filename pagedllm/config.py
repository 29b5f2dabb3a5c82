"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pagedllm.errors import ConfigError

SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPTION_MODES = ("recompute", "swap", "auto")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
# Tokens of growth per running sequence kept free when admitting (one block at
# the default block size); measured in docs/benchmarks.md, "KV memory audit".
DEFAULT_NUM_HEADROOM_TOKENS = 16

DType = Literal["auto", "float32", "bfloat16", "float16"]


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


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, before the model is read.

    Sizes: ``kv_cache_memory`` and ``swap_space`` are in bytes; ``num_kv_blocks``
    is an exact count of KV blocks and wins over ``kv_cache_memory``.
    ``max_num_batched_tokens`` is the per-step token budget (prefill chunks plus
    decode tokens); ``None`` picks a default from the device.
    ``num_headroom_tokens``: a request is admitted only while the free KV blocks
    left afterwards still cover that many more tokens of every running sequence
    (none past its max_tokens, and never more than a tenth of the cache in all);
    0 admits whenever the prompt fits.
    ``quantization``: "none" (dense weights of ``dtype``), "gguf" (a GGUF's
    Q4_0/Q4_1/Q8_0 tensors served packed), "int8"/"int4" (weight-only RTN with
    ``quantization_group_size`` weights per scale); CPU only.
    ``async_scheduling``: schedule and launch each decode step before reading
    the previous step's tokens (stop conditions are then seen one step late);
    ``None`` turns it on where CUDA graphs run.
    """

    model: str | None = None
    dtype: DType = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    swap_space: int = 0
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
    quantization: str = "none"
    quantization_group_size: int = 32
    seed: int = 0
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
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("quantization_group_size", self.quantization_group_size, QUANTIZATION_GROUP_SIZES)
        if self.device not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ConfigError(f"device={self.device!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
        _positive("num_kv_blocks", self.num_kv_blocks)
        _positive("kv_cache_memory", self.kv_cache_memory)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_seqs", self.max_num_seqs, allow_none=False)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("num_threads", self.num_threads)
        _non_negative("num_headroom_tokens", self.num_headroom_tokens)
        if self.async_scheduling not in (None, True, False):
            raise ConfigError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ConfigError(f"swap_space must be a byte count >= 0, got {self.swap_space!r}")
        if self.preemption_mode in ("swap", "auto") and self.swap_space == 0:
            # Swap needs somewhere to go; say so rather than silently recomputing.
            if self.preemption_mode == "swap":
                raise ConfigError("preemption_mode='swap' needs swap_space > 0 (bytes of CPU KV pool)")
