"""GGUF checkpoints: metadata -> HF config dict, tensors -> HF-named float tensors.

Quantized tensors are dequantized with the ``gguf`` package's own
dequantizer, so every type it supports loads (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, the K-quants, the IQ types). The result is cached on disk as
one safetensors file (config in its metadata) under
``pagedllm.models.paths.cache_dir() / "gguf"``, keyed by the GGUF file's
content (``paths.content_digest``) and the cache format, so only the first
load of a file pays for dequantization, however many environments install
it. Writing an entry deletes the entries of other cache formats.

Two GGUF-only settings reach the config dict under keys HF does not have:
``rope_frequency_factors`` (the ``rope_freqs`` tensor by which llama.cpp's
converter expresses Llama 3.1 rope scaling) and ``sliding_window`` with
``use_sliding_window`` (from ``{arch}.attention.sliding_window``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.paths import cache_dir, content_digest

logger = logging.getLogger("pagedllm")

# Bump when the cached tensors' or config's meaning changes (names, permutation,
# dtype policy, settings read from metadata). 2: rope_freqs and sliding_window.
CACHE_FORMAT_VERSION = "2"

# GGUF general.architecture -> HF architecture class name.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's converter interleaves the rotary halves of q/k rows only for these.
_ROPE_PERMUTED_ARCHS = ("llama",)

# One divisor per rotary pair (Llama 3.1 scaling); read into the config, not the weights.
ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFCheckpoint:
    """An HF-shaped view of a GGUF file: the config dict and HF-named tensors."""

    hf_config: dict
    weights: Iterator[tuple[str, torch.Tensor]]
    from_cache: bool


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def permute_for_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF q/k rows: within each head, the
    two rotary halves are interleaved (row ``i*D/2 + j`` moves to ``2*j + i``)."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def unpermute_for_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_rope`: back to HF's "rotate_half" row order."""
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def load_gguf_checkpoint(path: Path, *, use_cache: bool = True, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read ``path`` (from the dequantized cache when valid, else from the GGUF
    itself, then populate the cache). Raises ModelLoadError / UnsupportedModelError.

    ``keep_quantized``: tensors of a type with a quantized kernel (Q4_0, Q4_1,
    Q8_0) come as :class:`pagedllm.quant.QuantizedWeight` repacked from their
    blocks, never dequantized; others are dequantized (with a warning naming
    the type when it is a quantized one). Repacking is fast: no cache."""
    if keep_quantized:
        started = time.perf_counter()
        hf_config, tensors = read_gguf(path, keep_quantized=True)
        logger.info("read %d tensors of %s as stored in %.1f s", len(tensors), path.name, time.perf_counter() - started)
        return GGUFCheckpoint(hf_config, iter(tensors.items()), from_cache=False)
    cache_file = _cache_file(path)
    if use_cache and cache_file.is_file():
        try:
            return _read_cache(cache_file)
        except Exception as exc:  # a damaged cache must never block loading
            logger.warning("ignoring unreadable weight cache %s: %s", cache_file, exc)
    started = time.perf_counter()
    hf_config, tensors = read_gguf(path)
    logger.info(
        "dequantized %d tensors of %s in %.1f s",
        len(tensors),
        path.name,
        time.perf_counter() - started,
    )
    if use_cache:
        _write_cache(cache_file, hf_config, tensors, path)
    return GGUFCheckpoint(hf_config, iter(tensors.items()), from_cache=False)


def read_gguf(path: Path, *, keep_quantized: bool = False) -> tuple[dict, dict[str, Any]]:
    """Parse a GGUF file into (HF config dict, HF-named tensors in HF row order);
    ``keep_quantized`` as in :func:`load_gguf_checkpoint`."""
    reader = GGUFFile(path)  # a ModelLoadError when it is not a GGUF file
    tensor_names = {t.name for t in reader.tensors}
    hf_config = gguf_hf_config(reader, tensor_names)
    arch = hf_config["model_type"]
    tensors: dict[str, Any] = {}
    warned: set[str] = set()
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            logger.warning("GGUF tensor %s has no counterpart in the model; skipped", tensor.name)
            continue
        value = _quantized(tensor, warned) if keep_quantized else _dequantize(tensor)
        if arch in _ROPE_PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            heads = hf_config[key]
            if isinstance(value, torch.Tensor):
                value = unpermute_for_rope(value, heads).contiguous()
            else:  # a QuantizedWeight: its rows are permuted whole, blocks untouched
                value = value.map_rows(lambda rows, heads=heads: unpermute_for_rope(rows, heads))
        tensors[name] = value
    return hf_config, tensors


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _quantized(tensor: Any, warned: set[str]) -> Any:
    """A 2-D tensor of a type with a kernel as a QuantizedWeight (rows = GGUF's outer
    dimension); anything else dequantized, warning once per quantized type without a kernel."""
    from gguf import GGMLQuantizationType as QType

    from pagedllm.quant import GGUF_BLOCK_BYTES, from_gguf_blocks

    qtype = QType(tensor.tensor_type).name
    if qtype in GGUF_BLOCK_BYTES and len(tensor.shape) == 2:
        return from_gguf_blocks(qtype, np.asarray(tensor.data), int(tensor.shape[0]))
    if qtype not in _FLOAT_TYPES and qtype not in warned:
        warned.add(qtype)
        logger.warning(
            "GGUF tensor type %s has no quantized kernel: its tensors (first: %s) are dequantized", qtype, tensor.name
        )
    return _dequantize(tensor)


def _dequantize(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in ``[rows, cols]`` order (F16 stays F16,
    everything else becomes float32). Raises UnsupportedModelError for unknown types."""
    import gguf
    from gguf import GGMLQuantizationType as QType

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = QType(tensor.tensor_type)
    if qtype == QType.F16:
        array = np.asarray(tensor.data).view(np.float16).reshape(shape).copy()
    elif qtype == QType.F32:
        array = np.asarray(tensor.data).view(np.float32).reshape(shape).copy()
    else:
        try:
            array = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name} uses {qtype.name}, which the installed gguf "
                "package cannot dequantize"
            ) from exc
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    return torch.from_numpy(array)


def gguf_hf_config(reader: Any, tensor_names: set[str]) -> dict:
    """An HF config.json-style dict built from ``{arch}.*`` and ``tokenizer.ggml.*`` keys."""
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    arch = get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    try:
        hidden = int(get(f"{arch}.embedding_length"))
        num_heads = int(get(f"{arch}.attention.head_count"))
        config = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": int(get(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(get(f"{arch}.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", num_heads)),
        }
    except TypeError as exc:  # int(None): a required key is absent
        raise ModelLoadError(f"GGUF file lacks required {arch}.* metadata: {exc}") from exc
    config.update(
        head_dim=int(get(f"{arch}.attention.key_length", hidden // num_heads)),
        vocab_size=_vocab_size(fields, arch, get),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        hidden_act="silu",
    )
    scaling_type = get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(get(f"{arch}.rope.scaling.factor", 1.0)),
        }
    if ROPE_FREQS_TENSOR in tensor_names:
        config["rope_frequency_factors"] = _rope_frequency_factors(reader, config["head_dim"])
    window = get(f"{arch}.attention.sliding_window")
    if window:  # llama.cpp writes 0 for "no window"
        config.update(sliding_window=int(window), use_sliding_window=True)
    return config


def _rope_frequency_factors(reader: Any, head_dim: int) -> list[float]:
    """The ``rope_freqs`` tensor: llama.cpp divides rotary pair ``i``'s frequency by value ``i``.
    Raises ModelLoadError unless it holds exactly one value per rotary pair."""
    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR)
    factors = _dequantize(tensor).float().flatten()
    if factors.numel() != head_dim // 2:
        raise ModelLoadError(
            f"GGUF tensor {ROPE_FREQS_TENSOR} has {factors.numel()} values but head_dim={head_dim} "
            f"needs {head_dim // 2} (one per rotary pair); the file is inconsistent, reconvert it"
        )
    return factors.tolist()


def _vocab_size(fields: Any, arch: str, get: Any) -> int:
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    size = get(f"{arch}.vocab_size")
    if size is None:
        raise ModelLoadError("GGUF file has neither a token list nor a vocab_size")
    return int(size)


def _cache_file(path: Path) -> Path:
    """Cache location for ``path``: the same for every copy of the same bytes."""
    key = f"{CACHE_FORMAT_VERSION}|{content_digest(path)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}.{digest}.safetensors"


def _read_cache(cache_file: Path) -> GGUFCheckpoint:
    from safetensors import safe_open

    handle = safe_open(str(cache_file), framework="pt", device="cpu")
    hf_config = json.loads(handle.metadata()["hf_config"])

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in handle.keys():
            yield name, handle.get_tensor(name)

    return GGUFCheckpoint(hf_config, tensors(), from_cache=True)


def _write_cache(
    cache_file: Path, hf_config: dict, tensors: dict[str, torch.Tensor], source: Path
) -> None:
    """Write atomically (temporary file, then rename); failures only log a warning."""
    from safetensors.torch import save_file

    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"hf_config": json.dumps(hf_config), "source": str(source), "format": CACHE_FORMAT_VERSION}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, cache_file)
        logger.info("cached dequantized weights at %s", cache_file)
    except OSError as exc:
        logger.warning("could not cache dequantized weights at %s: %s", cache_file, exc)
        tmp.unlink(missing_ok=True)
        return
    _prune_other_formats(cache_file.parent)


def _prune_other_formats(directory: Path) -> None:
    """Delete cache entries written by another cache format; no reader will use them again."""
    from safetensors import safe_open

    for entry in directory.glob("*.safetensors"):
        try:
            with safe_open(str(entry), framework="pt", device="cpu") as handle:
                stale = (handle.metadata() or {}).get("format") != CACHE_FORMAT_VERSION
        except Exception:  # noqa: BLE001 - an unreadable entry is as stale as an old one
            stale = True
        if stale:
            entry.unlink(missing_ok=True)
            logger.info("removed stale weight cache %s", entry)
