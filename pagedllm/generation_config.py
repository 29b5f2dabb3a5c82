"""Default sampling parameters from the model's files, as vLLM's ``--generation-config``.

``auto`` reads them from an HF folder's ``generation_config.json`` or a GGUF
file's ``general.sampling.*`` metadata, ``vllm`` uses SamplingParams' own
defaults, and any other value is a folder holding a ``generation_config.json``.
Only the fields vLLM takes from a generation config are read; the result maps
SamplingParams field names to values and is empty when the files set none.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.errors import ConfigError, ModelLoadError

# generation_config.json key -> SamplingParams field (vLLM reads these six).
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key -> SamplingParams field.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = ("top_k", "max_tokens")


def default_sampling_fields(model_path: Path, generation_config: str) -> dict:
    """SamplingParams keyword defaults for requests that do not set them."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model_path.is_file() and model_path.suffix == ".gguf":
            return _from_gguf(model_path)
        return _from_folder(model_path, required=False)
    folder = Path(generation_config).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"generation_config={generation_config!r} is not 'auto', 'vllm' or a folder with generation_config.json"
        )
    return _from_folder(folder, required=True)


def _from_folder(folder: Path, *, required: bool) -> dict:
    path = folder / "generation_config.json"
    if not path.is_file():
        if required:
            raise ConfigError(f"{folder} has no generation_config.json")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return _typed({HF_KEYS[k]: v for k, v in data.items() if k in HF_KEYS and v is not None})


def _from_gguf(path: Path) -> dict:
    from pagedllm.models.gguf_file import GGUFFile

    fields = GGUFFile(path).fields  # the header only is parsed; tensors stay unread
    return _typed({name: fields[key] for key, name in GGUF_KEYS.items() if key in fields})


def _typed(values: dict) -> dict:
    return {k: int(v) if k in _INT_FIELDS else float(v) for k, v in values.items()}
