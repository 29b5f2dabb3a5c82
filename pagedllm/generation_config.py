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
    values = read_gguf_scalars(path, set(GGUF_KEYS))
    return _typed({name: values[key] for key, name in GGUF_KEYS.items() if key in values})


# GGUF value types (the format's numbering): struct codes of the scalar ones; 8 string, 9 array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_scalars(path: Path, keys: set[str]) -> dict:
    """The scalar metadata values of ``keys`` that a GGUF file (version 2 or 3) sets.

    Reads only the header's key/value section, skipping every other value (the
    tokenizer's vocabulary included), where ``gguf.GGUFReader`` builds an array
    view per token and per tensor: milliseconds instead of seconds on the default
    model. Raises ModelLoadError on a file that is not such a GGUF file."""
    import mmap
    import struct

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            magic, version = struct.unpack_from("<4sI", data, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise ModelLoadError(f"{path} is not a GGUF file of version 2 or 3")
            (num_kv,) = struct.unpack_from("<Q", data, 16)
            at, found = 24, {}

            def string(at: int) -> tuple[bytes, int]:
                (n,) = struct.unpack_from("<Q", data, at)
                return data[at + 8 : at + 8 + n], at + 8 + n

            def skip(kind: int, at: int) -> int:
                if kind in _GGUF_SCALARS:
                    return at + struct.calcsize("<" + _GGUF_SCALARS[kind])
                if kind == _GGUF_STRING:
                    return string(at)[1]
                if kind == _GGUF_ARRAY:
                    item, count = struct.unpack_from("<IQ", data, at)
                    at += 12
                    if item in _GGUF_SCALARS:
                        return at + count * struct.calcsize("<" + _GGUF_SCALARS[item])
                    for _ in range(count):
                        at = skip(item, at)
                    return at
                raise ModelLoadError(f"{path}: unknown GGUF value type {kind}")

            for _ in range(num_kv):
                raw_key, at = string(at)
                (kind,) = struct.unpack_from("<I", data, at)
                at += 4
                key = raw_key.decode("utf-8", "replace")
                if key in keys and kind in _GGUF_SCALARS:
                    (found[key],) = struct.unpack_from("<" + _GGUF_SCALARS[kind], data, at)
                at = skip(kind, at)
            return found
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read GGUF metadata of {path}: {exc}") from exc


def _typed(values: dict) -> dict:
    return {k: int(v) if k in _INT_FIELDS else float(v) for k, v in values.items()}
