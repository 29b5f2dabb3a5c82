"""The model hyper-parameters pagedllm needs, read from an HF ``config.json`` dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import ConfigError, ModelLoadError, UnsupportedModelError
from pagedllm.models import rope_scaling as rope

# Rope variants the Llama implementation computes; anything else is refused at load.
SUPPORTED_ROPE_TYPES = rope.ROPE_TYPES

# model_type values whose q/k/v projections always carry a bias (no config key says so).
_ALWAYS_QKV_BIAS = ("qwen2",)

# model_type values whose sliding window is off unless ``use_sliding_window`` turns it on.
_SLIDING_WINDOW_FLAGGED = ("qwen2",)

# The window HF's config classes assume when config.json has no ``sliding_window`` key.
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "qwen2": 4096}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim`` is even (rotary
    pairs). ``rope_scaling`` is ``None`` for plain rope, else a dict with a
    ``rope_type`` of :data:`SUPPORTED_ROPE_TYPES` and that type's parameters
    (normalised by :func:`pagedllm.models.rope_scaling.normalize`).
    ``max_position_embeddings`` is the checkpoint's trained context;
    :attr:`max_context_len` is the context its rope scaling reaches.
    ``o_proj_bias`` is an addition to the published interface: Llama's
    ``attention_bias`` puts a bias on the output projection too, Qwen2's does not.

    ``rope_frequency_factors`` holds ``head_dim / 2`` divisors, one per rotary
    pair, applied after ``rope_scaling``: how llama.cpp's GGUF files carry Llama
    3.1 scaling (their ``rope_freqs`` tensor). It comes from the config key of
    the same name, which only pagedllm's GGUF reader writes.

    ``sliding_window`` is the attention window in tokens (a query sees itself
    and the ``sliding_window - 1`` tokens before it) when at least one layer
    uses one, else None. pagedllm's attention is always full causal, which
    equals windowed attention for sequences of at most ``sliding_window``
    tokens, so the engine keeps ``max_model_len`` within it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False
    rope_frequency_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict, *, rope_scaling: Mapping | None = None) -> ModelConfig:
        """Build from an HF config dict (transformers 4 ``rope_theta``/``rope_scaling``
        or transformers 5 ``rope_parameters``). Raises ModelLoadError on missing keys.

        ``rope_scaling``, when given, replaces the checkpoint's scaling (as
        vLLM's ``--rope-scaling`` / ``hf_overrides`` do; ``{"rope_type": "default"}``
        removes it); a bad one is a ConfigError.
        """
        if rope_scaling is not None:
            cfg = with_rope_scaling(cfg, rope_scaling)
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            model_type = str(cfg.get("model_type", "llama"))
            architectures = cfg.get("architectures") or ["LlamaForCausalLM"]
            rope_theta, rope_scaling = _rope_settings(cfg)
            llama_bias = bool(cfg.get("attention_bias", False))
            qkv_bias = llama_bias or model_type in _ALWAYS_QKV_BIAS
            config = cls(
                architecture=str(architectures[0]),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=qkv_bias,
                bos_token_id=_optional_int(cfg.get("bos_token_id")),
                eos_token_ids=_token_ids(cfg.get("eos_token_id")),
                o_proj_bias=llama_bias and model_type not in _ALWAYS_QKV_BIAS,
                rope_frequency_factors=_optional_floats(cfg.get("rope_frequency_factors")),
                sliding_window=_sliding_window(cfg, model_type),
            )
        except KeyError as exc:
            raise ModelLoadError(f"model config is missing the key {exc.args[0]!r}") from exc
        config._validate(cfg)
        return config

    @property
    def max_context_len(self) -> int:
        """Tokens of context the model supports: the trained length, or what its rope scaling reaches."""
        return rope.scaled_context_len(self.rope_scaling, self.max_position_embeddings)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise ConfigError unless ``max_model_len`` tokens fit the (scaled) rotary context."""
        if max_model_len <= self.max_context_len:
            return
        trained = self.max_position_embeddings
        if self.rope_scaling is None:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's trained context of {trained} tokens; "
                f"lower max_model_len or extend the context with rope_scaling, e.g. "
                f'--rope-scaling \'{{"rope_type": "yarn", "factor": {math.ceil(max_model_len / trained)}}}\''
            )
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the {self.max_context_len} tokens that rope_scaling "
            f"{self.rope_scaling['rope_type']} with factor {self.rope_scaling['factor']:g} reaches from the "
            f"trained context of {trained} tokens; raise the factor or lower max_model_len"
        )

    def _validate(self, cfg: dict) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        factors = self.rope_frequency_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ModelLoadError(
                f"rope_frequency_factors has {len(factors)} values but head_dim={self.head_dim} "
                f"needs {self.head_dim // 2} (one per rotary pair)"
            )
        if factors is not None and not all(math.isfinite(f) and f > 0 for f in factors):
            raise ModelLoadError("rope_frequency_factors must all be positive and finite")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window={self.sliding_window} must be a positive token count")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("Llama checkpoints with mlp_bias=True are not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")


def with_rope_scaling(cfg: dict, scaling: Mapping) -> dict:
    """``cfg`` with its rope scaling replaced by ``scaling`` (checked: ConfigError if bad).

    The rotary base stays the checkpoint's; every other key of a transformers 5
    ``rope_parameters`` dict is dropped so the two scalings do not mix.
    """
    rope.normalize(scaling, int(cfg.get("max_position_embeddings", 2048)))  # user input: strict
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return {
        **{k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")},
        "rope_theta": theta,
        "rope_scaling": dict(scaling),
    }


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either the v4 or the v5 config layout."""
    params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    try:
        return theta, rope.normalize({**params, "rope_type": rope_type}, max_positions, strict=False)
    except ConfigError as exc:
        raise ModelLoadError(f"the checkpoint's {exc}") from exc


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """The window in tokens if any layer attends through one, else None.

    Mistral windows every layer unless ``sliding_window`` is null (an absent
    key means HF's default of 4096). Qwen2 needs ``use_sliding_window`` (default
    false) and then windows the layers listed as ``"sliding_attention"`` in
    ``layer_types``, or, in configs without that list, the layers from
    ``max_window_layers`` on.
    """
    window = cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type))
    if not window:  # null or 0
        return None
    if not cfg.get("use_sliding_window", model_type not in _SLIDING_WINDOW_FLAGGED):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    first_windowed = cfg.get("max_window_layers")
    if first_windowed is not None and int(first_windowed) >= int(cfg["num_hidden_layers"]):
        return None
    return int(window)


def _optional_floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _optional_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
