"""Loader of the quantized-matmul kernels (``quant_ops.c`` beside this file).

Built like :mod:`pagedllm.native.cpu_ops` (system C compiler, per-user cache,
``ctypes``), but without ``-march=native``: the AVX-512 VNNI path carries its
own target attribute and is chosen at run time by :func:`isa`, so one build
serves any x86-64 CPU. ``PAGEDLLM_NATIVE_OPS=0`` disables it, as it does the
other kernels; the quantized layers then compute on their dequantized weight.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from pagedllm.native.cpu_ops import _compiler

logger = logging.getLogger("pagedllm")

_SOURCE_PATH = Path(__file__).with_name("quant_ops.c")
ISA_NAMES = {2: "avx512-vnni", 0: "portable"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_isa = 0


def available() -> bool:
    """True when the kernels are built and loaded (builds them on the first call)."""
    global _library, _tried
    if os.environ.get("PAGEDLLM_NATIVE_OPS", "1") == "0":
        return False
    if not _tried:
        with _lock:
            if not _tried:
                _library = _load()
                _tried = True
    return _library is not None


def isa() -> int:
    """The code path this CPU runs: 2 (AVX-512 VNNI) or 0 (portable C)."""
    assert available(), "call available() first"
    return _isa


def _load() -> ctypes.CDLL | None:
    if _compiler() is None or platform.system() != "Linux":
        return None
    global _isa
    try:
        library = build_library()
        _isa = library.quant_isa()
        return library
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native quantized kernels unavailable (%s); quantized layers use their dequantized weight", exc)
        return None


def build_library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(_build(_compiler(), ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"])))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    library.quant_isa.restype = ctypes.c_int
    library.quant_isa.argtypes = []
    library.quantize_activations.argtypes = [p, i64, i64, i64, i32, p, p, p, p]
    library.quant_gemm.argtypes = [ctypes.c_int, p, p, p, i64, i64, ctypes.c_int, ctypes.c_int, i32,
                                   p, p, p, p, i64, p]
    library.quant_dequantize_rows.argtypes = [p, p, p, i64, i64, ctypes.c_int, ctypes.c_int, i32, p, i64, p]
    library.quant_linear.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, i64, i64, ctypes.c_int, ctypes.c_int, i32, p]
    for fn in (library.quantize_activations, library.quant_gemm, library.quant_dequantize_rows, library.quant_linear):
        fn.restype = None
    return library


def _build(compiler: str, flags: list[str]) -> Path:
    from pagedllm.models.paths import cache_dir

    source = _SOURCE_PATH.read_text()
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"quant_ops-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        source_file = Path(tmp) / "quant_ops.c"
        source_file.write_text(source)
        built = Path(tmp) / "quant_ops.so"
        subprocess.run([compiler, *flags, str(source_file), "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _cpu_signature() -> str:
    """The CPU model and flags: a cached build is reused only on the CPU it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("flags", "model name"))}))


def gemm(
    x: torch.Tensor,  # [T, K] float32, contiguous
    qweight: torch.Tensor,  # [N, Kp/2] or [N, Kp] uint8
    scales: torch.Tensor,  # [N, Kp / group] float16
    mins: torch.Tensor | None,  # like scales
    bits: int, group_size: int, zero: int, padded_in: int,
    isa_override: int | None = None,
) -> torch.Tensor:  # [T, N] float32
    """``x @ W^T`` of a quantized weight (see quant_ops.c for the layout)."""
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    y = torch.empty((rows, out_features), dtype=torch.float32)
    _library.quant_linear(
        _isa if isa_override is None else isa_override, x.data_ptr(), rows, in_features,
        qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
        out_features, padded_in, bits, group_size // 32, zero, y.data_ptr(),
    )
    return y


def dequantize_rows(
    rows: torch.Tensor,  # [R] int64, each below qweight.shape[0]
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bits: int, group_size: int, zero: int, padded_in: int, in_features: int,
) -> torch.Tensor:  # [R, in_features] float32
    """Weight rows ``rows`` in float32: the embedding lookup of a quantized embedding matrix."""
    rows = rows.contiguous()
    out = torch.empty((rows.numel(), in_features), dtype=torch.float32)
    _library.quant_dequantize_rows(
        qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(), padded_in,
        in_features, bits, group_size // 32, zero, rows.data_ptr(), rows.numel(), out.data_ptr(),
    )
    return out
