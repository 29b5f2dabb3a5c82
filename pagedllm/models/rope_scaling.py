"""Rotary position scaling: the HF ``rope_scaling`` forms, their frequencies and cos/sin magnitude.

A scaling is a plain dict with a ``rope_type`` of :data:`ROPE_TYPES` (the older
``type`` key is accepted and rewritten) and that type's parameters, as HF
transformers and vLLM read it from ``config.json`` or an override:

- ``linear``: every frequency divided by ``factor`` (position interpolation).
- ``dynamic``: NTK-aware scaling, the rotary base raised so that the longest
  wavelength stretches by ``factor``. HF recomputes the base from the length of
  the sequence in each forward pass (and uses plain rope up to the trained
  length). pagedllm batches many sequences of different lengths into one step,
  and their cached keys were rotated at the lengths they had then, so one base
  per step is not well defined. pagedllm therefore fixes the base once, at the
  scaled context ``factor x max_position_embeddings`` (what vLLM does): its
  logits equal HF's for a sequence of exactly that length.
- ``yarn``: frequencies blended between interpolated and original by a linear
  ramp over the rotary pairs (``beta_fast``/``beta_slow`` rotations over the
  original length), and cos/sin multiplied by an attention factor
  (``0.1 ln(factor) + 1`` unless ``attention_factor`` or ``mscale`` say otherwise).
- ``llama3``: Llama 3.1's wavelength bands (long ones slowed by ``factor``,
  short ones kept, a linear blend between ``low_freq_factor`` and
  ``high_freq_factor`` thresholds).

Lengths are in tokens; frequencies in radians per position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from pagedllm.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# Optional parameters per type, beyond rope_type and factor (HF's names).
_OPTIONAL_KEYS = {
    "linear": (),
    "dynamic": (),
    "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# Keys HF configs carry beside the scaling that are not scaling parameters.
_IGNORED_KEYS = ("rope_theta", "partial_rotary_factor")


def normalize(raw: Mapping | None, max_position_embeddings: int, *, strict: bool = True) -> dict | None:
    """The canonical scaling dict for ``raw`` (HF/vLLM spelling), or None for plain rope.

    The result has ``rope_type``, a float ``factor`` >= 1 and, for ``yarn`` and
    ``llama3``, ``original_max_position_embeddings`` (defaulting to the model's
    ``max_position_embeddings``, as HF does). Raises ConfigError naming the bad
    key; keys a type does not read are refused when ``strict`` (a user's
    override), kept and ignored otherwise (a checkpoint's config.json).
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"rope_scaling must be a dict such as {{'rope_type': 'yarn', 'factor': 4.0}}, got {raw!r}")
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type is None:
        raise ConfigError(f"rope_scaling {dict(raw)!r} needs a 'rope_type' (or 'type') key; choose one of {list(ROPE_TYPES)}")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; choose one of {list(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    allowed = {"rope_type", "type", "factor", *_OPTIONAL_KEYS[rope_type], *_IGNORED_KEYS}
    unknown = sorted(set(raw) - allowed)
    if unknown and strict:
        raise ConfigError(f"rope_scaling type {rope_type!r} does not take {unknown}; it takes {sorted(allowed - {'type'})}")
    scaling = {k: v for k, v in raw.items() if k not in ("type", *_IGNORED_KEYS)}
    scaling["rope_type"] = rope_type
    scaling["factor"] = _number(scaling, "factor", minimum=1.0)
    if rope_type in ("yarn", "llama3"):
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        original = scaling["original_max_position_embeddings"]
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise ConfigError(f"rope_scaling original_max_position_embeddings must be a positive integer, got {original!r}")
    return scaling


def _number(scaling: dict, key: str, minimum: float) -> float:
    value = scaling.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"rope_scaling {key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def scaled_context_len(scaling: dict | None, max_position_embeddings: int) -> int:
    """The longest context in tokens the model is meant to reach with ``scaling``.

    ``factor`` times the trained length (``original_max_position_embeddings``
    for yarn and llama3), never less than ``max_position_embeddings``: a Llama
    3.1 checkpoint already states its scaled length there.
    """
    if scaling is None:
        return max_position_embeddings
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    return max(max_position_embeddings, int(scaling["factor"] * original))


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int) -> Tensor:
    """``[head_dim / 2]`` float32 frequencies of rotary pairs ``0 .. head_dim/2 - 1``."""
    if scaling is not None and scaling["rope_type"] == "dynamic":
        theta = _dynamic_base(head_dim, theta, scaling["factor"], max_position_embeddings)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling["rope_type"] == "dynamic":
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (so every q.k grows by its square); 1 but for yarn."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _dynamic_base(head_dim: int, theta: float, factor: float, max_position_embeddings: int) -> float:
    """NTK base for a sequence of ``factor x max_position_embeddings`` tokens (HF's formula at that length)."""
    seq_len = factor * max_position_embeddings
    return theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(inv_freq: Tensor, head_dim: int, theta: float, scaling: dict) -> Tensor:
    """Pairs that turn more than ``beta_fast`` times over the original length keep
    their frequency, those under ``beta_slow`` turns are interpolated by ``factor``,
    and a linear ramp blends the pairs between."""
    original_len = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def pair_of(num_rotations: float) -> float:  # the (fractional) pair index turning that many times
        return head_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return (inv_freq / scaling["factor"]) * (1 - kept) + inv_freq * kept


def _llama3_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept,
    and a linear blend between the two wavelength thresholds."""
    factor = scaling["factor"]
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_between = (wavelength >= original_len / high) & (wavelength <= original_len / low)
    return torch.where(in_between, blended, slowed)
