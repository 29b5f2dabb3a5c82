"""Default sampling parameters from the model's files, as vLLM's ``--generation-config``.

``auto`` reads them from an HF folder's ``generation_config.json`` or a GGUF
file's ``general.sampling.*`` metadata, ``vllm`` uses SamplingParams' own
defaults, and any other value is a folder holding a ``generation_config.json``.
Only the fields vLLM takes from a generation config are read; the result maps
SamplingParams field names to values and is empty when the files set none.
"""

from __future__ import annotations

import json
import logging
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
logger = logging.getLogger(__name__)


def default_sampling_fields(model_path: Path, generation_config: str, override: dict | None = None) -> dict:
    """SamplingParams keyword defaults for requests that do not set them: the generation config's,
    with ``override`` (generation_config.json keys, vLLM's ``override_generation_config``) set over
    them. Keys vLLM does not read from a generation config are ignored, with a warning."""
    fields = _generation_config_fields(model_path, generation_config)
    if override:
        ignored = sorted(str(k) for k in override if k not in HF_KEYS)
        if ignored:
            logger.warning("override_generation_config: %s ignored; the keys read are %s",
                           ", ".join(ignored), ", ".join(HF_KEYS))
        try:
            fields.update(_typed({HF_KEYS[k]: v for k, v in override.items() if k in HF_KEYS and v is not None}))
        except (TypeError, ValueError):
            raise ConfigError(f"override_generation_config: the values must be numbers, got {override!r}") from None
    return fields


def _generation_config_fields(model_path: Path, generation_config: str) -> dict:
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
