"""Build a model and fill it from local files: an HF directory or a GGUF file.

Nothing here downloads anything. The model is first built on the meta device
(no random initialisation), then materialised on the target device and
overwritten tensor by tensor from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.distributed import SINGLE_PROCESS, TensorParallelGroup
from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.models.config import ModelConfig
from pagedllm.models.paths import resolve_model_path
from pagedllm.models.registry import resolve_architecture
from pagedllm.native.quant_ops import ACTIVATION_LEVELS

logger = logging.getLogger("pagedllm")


@dataclass
class LoadedModel:
    """A ready-to-run model plus what the engine needs to know about it.

    ``hf_config`` is the config.json dict (for GGUF: one built from the file's
    metadata); ``generation_config`` is generation_config.json or ``{}``.
    """

    model: torch.nn.Module
    config: ModelConfig
    path: Path
    hf_config: dict
    generation_config: dict


def load_model(
    model: str | os.PathLike | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    rope_scaling: dict | None = None,
    tp: TensorParallelGroup = SINGLE_PROCESS,
    quantization: str = "none",
    quantization_group_size: int = 32,
    quant_activations: str = "int16",
) -> LoadedModel:
    """Load ``model`` (HF directory, .gguf file, or None for the default model);
    ``rope_scaling`` replaces the checkpoint's (ConfigError if malformed).

    ``quantization``: "none" (dense ``dtype`` weights), "gguf" (a GGUF's Q4_0 /
    Q4_1 / Q8_0 tensors kept packed), "int8" / "int4" (round-to-nearest
    weight-only, ``quantization_group_size`` weights per scale, of every linear
    layer, the embedding and the LM head), served by
    :mod:`pagedllm.quant.layers` (gguf under tensor parallelism too: each rank its shard),
    whose matmuls quantize their inputs as ``quant_activations`` says ("int16" | "int8").
    Raises ConfigError for a setting that does not apply to this model, ModelLoadError naming what is missing,
    UnsupportedModelError for an architecture pagedllm does not implement.
    """
    started = time.perf_counter()
    path = resolve_model_path(model)
    device = torch.device(device)
    levels = _activation_levels(quantization, quant_activations, path, device, tp)
    if path.suffix == ".gguf":
        from pagedllm.models.gguf_loader import load_gguf_checkpoint

        checkpoint = load_gguf_checkpoint(path, keep_quantized=quantization == "gguf")
        hf_config, weights, generation_config = checkpoint.hf_config, checkpoint.weights, {}
        weights = _with_activation_levels(weights, levels)
    else:
        hf_config = _read_json(path / "config.json", required=True)
        generation_config = _read_json(path / "generation_config.json", required=False)
        weights = _safetensors_weights(path)
    model_cls = resolve_architecture(hf_config)
    config = ModelConfig.from_hf_config(hf_config, rope_scaling=rope_scaling)
    module = build_model(model_cls, config, attn_backend, dtype=dtype, device=device, tp=tp)
    module.load_weights(weights)
    if quantization in ("int8", "int4"):
        quantize_model(module, bits=8 if quantization == "int8" else 4, group_size=quantization_group_size,
                       activation_levels=levels)
    module.eval()
    logger.info(
        "loaded %s (%s, %s, %s weights, %s) in %.2f s",
        path.name,
        config.architecture,
        str(dtype).removeprefix("torch."),
        quantization,
        device,
        time.perf_counter() - started,
    )
    return LoadedModel(module, config, path, hf_config, generation_config)


def _activation_levels(quantization: str, quant_activations: str, path: Path, device: torch.device,
                       tp: TensorParallelGroup) -> int:
    """The packed matmuls' activation levels; ConfigError for a quantization that does not apply here."""
    if quant_activations not in ACTIVATION_LEVELS:
        raise ConfigError(f"quant_activations={quant_activations!r} is not supported; choose one of "
                          f"{list(ACTIVATION_LEVELS)}")
    if quantization == "gguf" and path.suffix != ".gguf":
        raise ConfigError(f"quantization='gguf' needs a .gguf model, got {path}; use int8 or int4 for other checkpoints")
    if quantization != "none" and device.type != "cpu":
        raise ConfigError(f"quantization={quantization!r} runs on the CPU only; use quantization='none' on {device}")
    if quantization in ("int8", "int4") and tp.size > 1:
        raise ConfigError(f"quantization={quantization!r} with tensor parallelism is not supported yet; "
                          "use a GGUF file with quantization='gguf', or TP=1")
    return ACTIVATION_LEVELS[quant_activations]


def default_quantization(path: Path, device: str, dtype: str) -> str:
    """What ``quantization=None`` means for the checkpoint at ``path``: "gguf" (its Q4_0 / Q4_1 /
    Q8_0 tensors served packed, as llama.cpp serves them) for a GGUF file on the CPU in float32,
    or in a 16-bit dtype that this CPU has no native matmul for (dense weights would be
    emulated, about 20x slower; packed ones run the native integer kernels), where those kernels
    build; "none" (dense weights) everywhere else. With int16 activations the packed path gives
    the dequantized weights' logits to within about 0.01 and is several times faster at batch 1
    (docs/benchmarks.md, "Quantized weights")."""
    from pagedllm.native import quant_ops

    on_cpu = device == "cpu" or device == "auto" and not torch.cuda.is_available()
    if path.suffix != ".gguf" or not on_cpu:
        return "none"
    if dtype in ("bfloat16", "float16"):
        from pagedllm.native.cpu_dtype import native_matmul

        if native_matmul(getattr(torch, dtype)):
            return "none"  # dense 16-bit matmuls are native here (on AMX, faster than packed for batches)
    elif dtype not in ("auto", "float32"):
        return "none"
    return "gguf" if quant_ops.available() else "none"


def _with_activation_levels(weights: Iterator[tuple[str, torch.Tensor]], levels: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (name, tensor) with each packed matrix set to quantize its inputs to
    ``levels`` int8 levels (new objects: a cached checkpoint's stay as they are)."""
    from pagedllm.quant import QuantizedWeight

    for name, w in weights:
        yield name, dataclasses.replace(w, activation_levels=levels) if isinstance(w, QuantizedWeight) else w


def quantize_model(module: torch.nn.Module, *, bits: int, group_size: int, activation_levels: int = 2) -> None:
    """Replace every quantizable weight of a loaded model by its RTN-quantized packed form,
    whose matmuls quantize their inputs to ``activation_levels`` int8 levels."""
    from pagedllm.layers.linear import restore_dense_weights
    from pagedllm.quant import quantize_rtn
    from pagedllm.quant.layers import install_quantized, quantizable_weights

    restore_dense_weights(module)  # bound dense CPU weights live in their packed copies
    params = dict(module.named_parameters())
    names = quantizable_weights(module)
    install_quantized(module, {name: dataclasses.replace(quantize_rtn(params[name].data, bits, group_size),
                                                         activation_levels=activation_levels)
                               for name in names})
    module.bind_kernels()


def build_model(
    model_cls: type,
    config: ModelConfig,
    attn_backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup = SINGLE_PROCESS,
) -> torch.nn.Module:
    """An uninitialised model of ``dtype`` on ``device`` (this rank's shard): every parameter must be loaded."""
    with torch.device("meta"):
        module = model_cls(config, attn_backend, tp)
    module = module.to_empty(device=device)
    return module.to(dtype)


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} is missing in {path.parent}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint shards of an HF directory, in index order when an index exists."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{directory} is missing shard(s) listed in {index.name}: {missing}"
            )
        return [directory / name for name in files]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return shards
    raise ModelLoadError(
        f"{directory} has no model.safetensors (or sharded *.safetensors with "
        "model.safetensors.index.json); only safetensors checkpoints are supported"
    )


def _safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one tensor in memory at a time."""
    from safetensors import safe_open

    files = safetensors_files(directory)  # resolved now, so errors surface before building

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    return tensors()
