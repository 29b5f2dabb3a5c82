"""Loader of the quantized-matmul kernels (``quant_ops.c`` beside this file).

Built like :mod:`pagedllm.native.cpu_ops` (system C compiler, per-user cache,
``ctypes``), but without ``-march=native``: the AVX-512 VNNI and AVX2 paths
carry their own target attributes and the best one the CPU runs is chosen at
run time (:func:`isa`), so one build serves any x86-64 CPU.
``PAGEDLLM_QUANT_ISA`` (``auto``, ``portable``, ``avx2``, ``avx512-vnni``,
``avx512-amx``) forces a path, as ``gemm(..., isa_override=)`` does per call: an
AVX-512 machine runs, tests and benchmarks every path up to its own (one with
AMX tiles, all four). The AMX path asks Linux for the tile state once per process
(``arch_prctl``); where the kernel refuses, the best path is AVX-512 VNNI. ``PAGEDLLM_NATIVE_OPS=0``
disables the kernels, as it does the other native ones; the quantized layers
then compute on their dequantized weight.

Row-scale tables: the AVX2 and AVX-512 VNNI per-row kernels (one or a few activation
rows, a decode step; AMX's few rows run VNNI's) read each pass's float16 scales and mins
as one vector per block from a table made once per matrix (:func:`row_scale_tables`: the same values
in pass order, as many bytes again as the scales and mins) instead of
transposing them on every call. The layers build it where that kernel is the
path; ``PAGEDLLM_QUANT_ROW_TABLES=0`` leaves it out (the transposing kernel,
the same bits, no extra bytes).

Lane layout: on the AVX2 and AVX-512 VNNI paths a 4-bit matrix whose output count is a
multiple of 8 keeps its codes with the outputs interleaved by 8 (quant_ops.c, "Lane layout";
:func:`pagedllm.quant.formats.to_lanes`), the same bytes reordered, which the per-row
kernels multiply with no reduction across vector lanes (AVX-512 takes two passes per vector). Such a ``qweight`` is 3-D,
``[N / 8, Kp / 32, 128]``, so every call here knows its layout from the tensor. The layers
reorder a matrix once, where that path runs it; ``PAGEDLLM_QUANT_LANES=0`` keeps the row
layout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.native.build_cache import compiled, native_source
from pagedllm.native.cpu_ops import _compiler

logger = logging.getLogger("pagedllm")

_SOURCE_PATH = Path(__file__).with_name("quant_ops.c")
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512-vnni", 3: "avx512-amx"}  # the C path numbers, cheapest first
ISA_ENV = "PAGEDLLM_QUANT_ISA"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_isa = 0
_runnable: tuple[int, ...] = (0,)
_tiled_from: dict[tuple[int, int, int], int] = {}  # (path, bits, levels) -> rows from which it tiles (0: never)
_FORCED_TILED_FROM = {True: 1, False: 2**62}  # the same for gemm(tiled=True / False)
# How the activations of a packed matmul are quantized, per 32-block: "int16" two int8 levels
# (the residual of the first at a 256 times finer scale: 16-bit fixed point, the dequantized
# weights' accuracy), "int8" one level (llama.cpp's Q8 activations; less integer work).
ACTIVATION_LEVELS = {"int16": 2, "int8": 1}
ROW_TABLES_ENV = "PAGEDLLM_QUANT_ROW_TABLES"
ROW_TABLE_COLS = {1: 8, 2: 16, 3: 16}  # path -> outputs per pass of the per-row kernel that reads row-scale tables
LANES_ENV = "PAGEDLLM_QUANT_LANES"
# How the layer stack runs a SwiGLU's packed gate | up product and silu_mul on the tiled kernels:
# 1 in one pass where the product would be 4 MiB or more (quant_linear_glu), 2 in one pass at any
# size, 0 the product and then silu_mul (the same bits in every case; for A/Bs and tests)
GLU_FUSION_ENV = "PAGEDLLM_QUANT_GLU_FUSION"
GLU_FUSION_MODES = ("0", "1", "2")
LANE_COLS = {1: 8, 2: 8}  # path -> outputs interleaved per pass of the lane layout, where the path has one


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
    """The path the kernels run: 3 (AVX-512 VNNI with AMX-INT8 tiles for many rows),
    2 (AVX-512 VNNI), 1 (AVX2 + FMA) or 0 (portable C);
    the best of :func:`runnable_isas` unless ``PAGEDLLM_QUANT_ISA`` names another."""
    assert available(), "call available() first"
    return _isa


def runnable_isas() -> tuple[int, ...]:
    """The paths this CPU runs, cheapest first (each path's CPU needs include the ones below it)."""
    assert available(), "call available() first"
    return _runnable


def tiled_min_rows(bits: int, path: int | None = None, levels: int = 2) -> int | None:
    """Activation rows from which ``path`` (default :func:`isa`) takes its tiled kernel for
    ``bits``-bit codes and ``levels``-level activations; None for the portable path, which has none."""
    assert available(), "call available() first"
    return _tiled_from[(_isa if path is None else path, bits, levels)] or None


def requested_isa(best: int) -> int:
    """The path ``$PAGEDLLM_QUANT_ISA`` names (``auto``: ``best``). Raises ConfigError for an
    unknown name or a path above ``best``, the best this CPU runs."""
    from pagedllm.errors import ConfigError

    name = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if name == "auto":
        return best
    by_name = {v: k for k, v in ISA_NAMES.items()}
    if name not in by_name:
        raise ConfigError(f"{ISA_ENV}={name!r} is not a quantized-kernel path; use auto or one of "
                          f"{', '.join(ISA_NAMES.values())}")
    if by_name[name] > best:
        raise ConfigError(f"{ISA_ENV}={name}: this CPU runs only {', '.join(ISA_NAMES[i] for i in range(best + 1))}")
    return by_name[name]


def _load() -> ctypes.CDLL | None:
    if _compiler() is None or platform.system() != "Linux":
        return None
    global _isa, _runnable, _tiled_from
    try:
        library = build_library()
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native quantized kernels unavailable (%s); quantized layers use their dequantized weight", exc)
        return None
    _runnable = tuple(range(library.quant_isa() + 1))
    _tiled_from = {(path, bits, levels): library.quant_tiled_min_rows(path, bits, levels)
                   for path in _runnable for bits in (4, 8) for levels in ACTIVATION_LEVELS.values()}
    _isa = requested_isa(_runnable[-1])  # a bad PAGEDLLM_QUANT_ISA is the user's to fix: raise
    library.quant_set_glu_fusion(_glu_fusion_mode())
    logger.debug("native quantized kernels: %s path", ISA_NAMES[_isa])
    return library


# -ffp-contract=off: no multiply-add is fused behind the code's back, so the vector paths
# round exactly where the portable one does (their bit equality rests on it). One build holds
# every path (each function carries its own target attribute).
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off")


def build_library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(_build(_compiler(), list(COMPILE_FLAGS))))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    c_int = ctypes.c_int
    library.quant_isa.restype = library.quant_tiled_min_rows.restype = c_int
    library.quant_isa.argtypes = []
    library.quant_tiled_min_rows.argtypes = [c_int, c_int, c_int]
    library.quantize_activations.argtypes = [c_int, p, i64, i64, i64, p, p, p, p]
    library.quant_gemm.argtypes = [c_int, i64, p, p, p, p, p, i64, i64, c_int, c_int, i32, c_int, p, p, p, p, i64, p]
    library.quant_dequantize_rows.argtypes = [p, p, p, i64, i64, c_int, c_int, i32, c_int, p, i64, p]
    library.quant_linear.argtypes = [c_int, i64, c_int, p, i64, i64, p, p, p, p, p, i64, i64, c_int, c_int, i32, c_int, p]
    library.quant_linear.restype = c_int
    library.quant_linear_glu.argtypes = [c_int, i64, c_int, p, i64, i64, p, p, p, i64, i64, c_int, c_int, i32, c_int, p, p]
    library.quant_linear_glu.restype = c_int
    library.quant_set_glu_fusion.argtypes = [c_int]
    library.quant_set_glu_fusion.restype = None
    library.quant_glu_fused_calls.argtypes = []
    library.quant_glu_fused_calls.restype = i64
    library.quant_linear_bf16.argtypes = [p, i64, i64, p, p, p, i64, i64, c_int, c_int, i32, p]
    library.quant_linear_bf16.restype = library.quant_amx_bf16.restype = c_int
    library.quant_amx_bf16.argtypes = library.dense_bf16_kernel.argtypes = []
    library.dense_bf16_kernel.restype = c_int
    library.dense_linear_bf16.argtypes = library.dense_linear_bf16_f32.argtypes = [p, i64, i64, p, i64, i64, p, p]
    library.dense_linear_bf16.restype = library.dense_linear_bf16_f32.restype = c_int
    library.dense_linear_bf16_silu_mul.argtypes = [p, i64, i64, p, i64, i64, p]
    library.dense_linear_bf16_silu_mul.restype = c_int
    for fn in (library.quantize_activations, library.quant_gemm, library.quant_dequantize_rows):
        fn.restype = None
    return library


def _build(compiler: str, flags: list[str]) -> Path:
    return compiled("quant_ops", native_source(_SOURCE_PATH), compiler, flags, (_cpu_signature(),))


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
    isa_override: int | None = None, tiled: bool | None = None, levels: int = 2,
    tables: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:  # [T, N] float32
    """``x @ W^T`` of a quantized weight (see quant_ops.c for the layout), the activations
    quantized per 32-block to ``levels`` int8 levels (2: 16-bit fixed point; 1: int8).

    ``isa_override`` runs another path of :func:`runnable_isas` than :func:`isa`. The
    AVX-512 VNNI and AVX2 paths take their tiled kernel from :func:`tiled_min_rows` rows
    (``tiled=None``), at any row count (``True``) or never (``False``); for the AMX path
    the tiled kernel is the AMX one, and ``False`` runs path 2's dispatch. ``tables``:
    :func:`row_scale_tables` of this weight for the path, read by its per-row kernel (the
    same bits as without). A 3-D ``qweight`` holds 4-bit codes in the lane layout
    (:func:`lanes_wanted`), which every path reads (the AMX one hands it to path 2's kernels)."""
    path = _check_path(isa_override, levels)
    lanes = _lanes_of(qweight, bits)
    dt, mt = _table_pointers(tables, scales, mins, path)
    rows, in_features = x.shape
    out_features = scales.shape[0]
    y = torch.empty((rows, out_features), dtype=torch.float32)
    done = _library.quant_linear(
        path, _tiled_from[(path, bits, levels)] if tiled is None else _FORCED_TILED_FROM[tiled], levels, x.data_ptr(), rows,
        in_features,
        qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(), dt, mt,
        out_features, padded_in, bits, group_size // 32, zero, int(lanes), y.data_ptr(),
    )
    if not done:
        raise MemoryError(f"quantized matmul scratch for {rows} rows x {padded_in} inputs")
    return y


def gemm_glu(
    x: torch.Tensor,  # [T, K] float32, contiguous
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,  # a fused [gate | up] matrix
    bits: int, group_size: int, zero: int, padded_in: int, glu: int,
    isa_override: int | None = None, tiled: bool | None = None, levels: int = 2,
) -> torch.Tensor | None:  # [T, N / 2] float32
    """``glu(x @ [gate | up]^T)`` in one pass on the tiled kernels (the layer stack's SwiGLU):
    ``glu`` is the address of a ``silu_mul(gate_up, rows, n, out)`` for float32 rows that opens
    no parallel region (cpu_ops' ``silu_mul_f32_serial``), applied to each tile's gate and up
    outputs. The bits of :func:`gemm`
    followed by that function on the rows; None where the path does not apply (fewer rows than
    the tiled kernel takes, the AMX kernel's row layout, N / 2 not a multiple of its outputs)."""
    path = _check_path(isa_override, levels)
    rows, in_features = x.shape
    inter = scales.shape[0] // 2
    act = torch.empty((rows, inter), dtype=torch.float32)
    done = _library.quant_linear_glu(
        path, _tiled_from[(path, bits, levels)] if tiled is None else _FORCED_TILED_FROM[tiled], levels, x.data_ptr(),
        rows, in_features, qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(), inter,
        padded_in, bits, group_size // 32, zero, int(_lanes_of(qweight, bits)), glu, act.data_ptr(),
    )
    return act if done == 1 else None


def lanes_wanted(bits: int, out_features: int, path: int | None = None) -> bool:
    """Whether a ``bits``-bit matrix of ``out_features`` outputs takes the lane layout on ``path``
    (default: :func:`isa`): 4-bit codes, whole passes of outputs, a path with a lane kernel, and
    ``PAGEDLLM_QUANT_LANES`` not 0."""
    cols = LANE_COLS.get(_isa if path is None else path) if available() else None
    return cols is not None and _switched_on(LANES_ENV) and bits == 4 and out_features % cols == 0


def _env_setting(name: str, choices: tuple[str, ...], expected: str) -> str:
    """``$name`` (unset: "1"), one of ``choices``; anything else is a ConfigError saying ``expected``."""
    value = os.environ.get(name, "1")
    if value not in choices:
        from pagedllm.errors import ConfigError

        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    return value


def _glu_fusion_mode() -> int:
    return int(_env_setting(GLU_FUSION_ENV, GLU_FUSION_MODES, "0 (never), 1 (by size, the default) or 2 (always)"))


def _switched_on(name: str) -> bool:
    """``$name`` as a switch: unset or 1 is on, 0 off; anything else is a ConfigError."""
    return _env_setting(name, ("0", "1"), "0 or 1") == "1"


def _lanes_of(qweight: torch.Tensor, bits: int) -> bool:
    """Whether ``qweight`` is in the lane layout (3-D: ``[N / 8, Kp / 32, 128]``); ValueError for
    a 3-D tensor that cannot be one."""
    if qweight.dim() == 2:
        return False
    if qweight.dim() != 3 or bits != 4 or qweight.shape[2] != 128:
        raise ValueError(f"codes of shape {tuple(qweight.shape)} are neither rows [N, Kp / 2 or Kp] nor "
                         f"the lane layout of 4-bit codes [N / 8, Kp / 32, 128] ({bits}-bit codes given)")
    return True


def _check_path(isa_override: int | None, levels: int) -> int:
    path = _isa if isa_override is None else isa_override
    if path not in _runnable:
        raise ValueError(f"quantized-kernel path {path} is not one this CPU runs: {_runnable}")
    if levels not in ACTIVATION_LEVELS.values():
        raise ValueError(f"activation levels must be 1 or 2, got {levels!r}")
    return path


def row_tables_wanted(path: int | None = None) -> bool:
    """Whether the per-row kernel of ``path`` (default: :func:`isa`) reads row-scale tables and
    ``PAGEDLLM_QUANT_ROW_TABLES`` does not turn them off."""
    return available() and _switched_on(ROW_TABLES_ENV) and (_isa if path is None else path) in ROW_TABLE_COLS


def row_scale_tables(
    scales: torch.Tensor, mins: torch.Tensor | None, path: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row-scale tables of one packed weight for the per-row kernel of ``path`` (default:
    :func:`isa`; one of ``ROW_TABLE_COLS``): ``scales`` (and ``mins``) ``[N, per_row]`` float16
    reordered to ``[ceil(N / cols), per_row, cols]``, zeros past N."""
    cols = ROW_TABLE_COLS[_isa if path is None else path]

    def table(s: torch.Tensor) -> torch.Tensor:
        n, per_row = s.shape
        padded = torch.nn.functional.pad(s, (0, 0, 0, -n % cols))  # [passes * cols, per_row]
        return padded.view(-1, cols, per_row).transpose(1, 2).contiguous()

    return table(scales), None if mins is None else table(mins)


def _table_pointers(tables, scales: torch.Tensor, mins: torch.Tensor | None, path: int) -> tuple[int | None, int | None]:
    """The C pointers of ``tables`` where ``path``'s per-row kernel reads them, else (None, None)."""
    if tables is None or path not in ROW_TABLE_COLS:
        return None, None
    dt, mt = tables
    cols, (n, per_row) = ROW_TABLE_COLS[path], scales.shape
    if dt.shape != ((n + cols - 1) // cols, per_row, cols) or (mins is None) != (mt is None):
        raise ValueError(f"row-scale tables of shape {tuple(dt.shape)} do not fit scales {tuple(scales.shape)} "
                         f"on path {ISA_NAMES[path]}")
    return dt.data_ptr(), None if mt is None else mt.data_ptr()


def bind_gemm(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bits: int, group_size: int, zero: int, padded_in: int, levels: int = 2, isa_override: int | None = None,
    tables: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`gemm` on one weight, its arguments converted once: ``f(x)`` takes a float32,
    contiguous ``[T, K]`` and returns ``[T, N]``. For the layers' forward passes, where the
    per-call cost of :func:`gemm`'s checks is a few percent of a batch-1 decode step.
    ``isa_override``, ``tables`` and the lane layout as for :func:`gemm`."""
    assert available(), "bind_gemm needs the native kernels"
    path, kernel = _check_path(isa_override, levels), _library.quant_linear
    lanes = _lanes_of(qweight, bits)
    tiled_from = _tiled_from[(path, bits, levels)]
    out_features = scales.shape[0]
    dt, mt = _table_pointers(tables, scales, mins, path)
    weight_args = (qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(), dt, mt,
                   out_features, padded_in, bits, group_size // 32, zero, int(lanes))
    keep = (qweight, scales, mins, tables)  # the pointers stay valid while the closure lives

    def call(x: torch.Tensor) -> torch.Tensor:
        rows, in_features = x.shape
        y = torch.empty((rows, out_features), dtype=torch.float32)
        if not kernel(path, tiled_from, levels, x.data_ptr(), rows, in_features, *weight_args, y.data_ptr()):
            raise MemoryError(f"quantized matmul scratch for {rows} rows x {padded_in} inputs")
        return y

    call.weights = keep
    return call


# Rows from which a bfloat16 packed matmul takes the AMX-BF16 kernel (below: the integer
# kernels on float32 activations, as fast or faster at 32 rows and faster at 16; measured on
# Sapphire Rapids at the default model's shapes, docs/benchmarks.md).
AMX_BF16_MIN_ROWS = 64


def amx_bf16_available() -> bool:
    """Whether :func:`gemm_bf16` runs here: AMX-BF16 tiles (Sapphire Rapids and later), unless
    ``PAGEDLLM_QUANT_BF16_AMX=0``."""
    return (available() and os.environ.get("PAGEDLLM_QUANT_BF16_AMX", "1") != "0"
            and bool(_library.quant_amx_bf16()))


def gemm_bf16(
    x: torch.Tensor,  # [T, K] bfloat16, contiguous
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bits: int, group_size: int, zero: int, padded_in: int,
) -> torch.Tensor | None:  # [T, N] bfloat16
    """``x @ W^T`` on the AMX-BF16 tiles, ``W`` the packed weights dequantized to bfloat16
    (the values ``dequantize().bfloat16()`` gives), sums in float32, the result rounded to
    bfloat16. None where the CPU has no AMX-BF16 (or scratch ran out): take another path."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous()
    if _lanes_of(qweight, bits):  # the AMX-BF16 kernel reads rows
        return None
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    y = torch.empty((rows, out_features), dtype=torch.bfloat16)
    done = _library.quant_linear_bf16(
        x.data_ptr(), rows, in_features, qweight.data_ptr(), scales.data_ptr(),
        None if mins is None else mins.data_ptr(), out_features, padded_in, bits, group_size // 32, zero,
        y.data_ptr(),
    )
    return y if done else None


# What runs :func:`dense_bf16_linear` (quant_ops.c ``dense_bf16_kernel``): the AMX-BF16 tiles, or
# VDPBF16PS on an AVX512-BF16 CPU without them.
DENSE_BF16_KERNELS = {2: "amx", 1: "avx512_bf16"}


def dense_bf16_kernel() -> str | None:
    """``"amx"``, ``"avx512_bf16"`` or None: the kernel :func:`dense_bf16_linear` runs on here."""
    return DENSE_BF16_KERNELS.get(int(_library.dense_bf16_kernel())) if available() else None


def dense_bf16_available() -> bool:
    """Whether :func:`dense_bf16_linear` runs here: the kernels built, and AMX-BF16 tiles granted
    or AVX512-BF16 present."""
    return dense_bf16_kernel() is not None


# Outputs per group and inputs per block of the dense bfloat16 tile layout (TDPBF16PS's B operand).
DENSE_BF16_GROUP, DENSE_BF16_BLOCK = 16, 32


def dense_bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A dense ``[N, K]`` bfloat16 weight in the AMX-BF16 kernel's layout (:func:`dense_bf16_linear`).

    Per group of 16 outputs and block of 32 inputs, a ``[16 pairs][16 outputs][2]`` tile:
    ``packed[g, b, kk, n, j] = weight[16 g + n, 32 b + 2 kk + j]``; outputs past N and inputs
    past K are zero. Returns ``[ceil(N / 16), ceil(K / 32), 16, 16, 2]`` bfloat16.
    """
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2
    n, k = weight.shape
    n_pad = -n % DENSE_BF16_GROUP
    k_pad = -k % DENSE_BF16_BLOCK
    w = torch.nn.functional.pad(weight.detach(), (0, k_pad, 0, n_pad))
    groups, blocks = w.shape[0] // DENSE_BF16_GROUP, w.shape[1] // DENSE_BF16_BLOCK
    return w.view(groups, DENSE_BF16_GROUP, blocks, DENSE_BF16_GROUP, 2).permute(0, 2, 3, 1, 4).contiguous()


def dense_bf16_unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight back from :func:`dense_bf16_pack`'s layout (a new tensor)."""
    groups, blocks = packed.shape[:2]
    w = packed.permute(0, 3, 1, 2, 4).reshape(groups * DENSE_BF16_GROUP, blocks * DENSE_BF16_BLOCK)
    return w[:out_features, :in_features].contiguous()


def dense_bf16_pack_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU's ``[2 n, K]`` bfloat16 ``[gate | up]`` weight in :func:`dense_bf16_silu_mul`'s layout:
    :func:`dense_bf16_pack` of the two halves' groups of 16 rows in turn (gate group g, then up
    group g; each half padded to whole groups), so that one pass over a pair of groups has a
    gate's outputs and the matching up's side by side. Returns
    ``[2 ceil(n / 16), ceil(K / 32), 16, 16, 2]`` bfloat16."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[0] % 2 == 0
    n, k = gate_up.shape[0] // 2, gate_up.shape[1]
    groups = -(-n // DENSE_BF16_GROUP)
    halves = [torch.nn.functional.pad(h.detach(), (0, 0, 0, groups * DENSE_BF16_GROUP - n))
              for h in gate_up.split(n)]
    paired = torch.stack([h.view(groups, DENSE_BF16_GROUP, k) for h in halves], dim=1)
    return dense_bf16_pack(paired.reshape(2 * groups * DENSE_BF16_GROUP, k))


def glu_unpair(t: torch.Tensor, half: int, dim: int = -1) -> torch.Tensor:
    """``[gate | up]`` (``half`` each) along ``dim`` of ``t``, whose entries along it are in
    :func:`dense_bf16_pack_glu`'s order (gate and up groups of 16 in turn, each half padded to
    whole groups): the weight's rows, or the outputs of its plain product. A new tensor."""
    t = t.movedim(dim, -1)
    paired = t.unflatten(-1, (-1, 2, DENSE_BF16_GROUP))
    halves = [paired[..., i, :].flatten(-2)[..., :half] for i in (0, 1)]
    return torch.cat(halves, dim=-1).movedim(-1, dim).contiguous()


def dense_bf16_unpack_glu(packed: torch.Tensor, half: int, in_features: int) -> torch.Tensor:
    """The ``[2 half, in_features]`` ``[gate | up]`` weight back from :func:`dense_bf16_pack_glu` (a new tensor)."""
    return glu_unpair(dense_bf16_unpack(packed, packed.shape[0] * DENSE_BF16_GROUP, in_features), half, dim=0)


def dense_bf16_silu_mul(
    x: torch.Tensor,  # [T, K] bfloat16, contiguous
    packed: torch.Tensor, half: int,
) -> torch.Tensor | None:  # [T, half] bfloat16
    """``silu(x @ gate^T) * (x @ up^T)`` for ``packed = dense_bf16_pack_glu([gate | up])``: the bits of
    :func:`dense_bf16_linear` on the plain weight followed by ``cpu_ops.silu_mul``, in one pass
    (the ``[T, 2 half]`` product never goes to memory). None where :func:`dense_bf16_linear` would be."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
    rows, in_features = x.shape
    y = torch.empty((rows, half), dtype=torch.bfloat16)
    done = _library.dense_linear_bf16_silu_mul(
        x.data_ptr(), rows, in_features, packed.data_ptr(), half, packed.shape[1] * DENSE_BF16_BLOCK, y.data_ptr()
    )
    return y if done else None


def dense_bf16_linear(
    x: torch.Tensor,  # [T, K] bfloat16, contiguous
    packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor | None:  # [T, N] out_dtype
    """``x @ W^T (+ bias)`` on the AMX-BF16 tiles for ``packed = dense_bf16_pack(W)``: every output
    the float32 sum over 32-input blocks in order, rounded to bfloat16 once, so a row's result
    does not depend on the other rows. ``out_dtype=torch.float32`` writes those bfloat16 values
    widened to float32 (what ``.float()`` of the bfloat16 result gives, without its pass). None
    where the CPU has no AMX-BF16 (or memory ran out)."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
    assert out_dtype in (torch.bfloat16, torch.float32)
    rows, in_features = x.shape
    padded_in = packed.shape[1] * DENSE_BF16_BLOCK
    y = torch.empty((rows, out_features), dtype=out_dtype)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    kernel = _library.dense_linear_bf16 if out_dtype == torch.bfloat16 else _library.dense_linear_bf16_f32
    done = kernel(
        x.data_ptr(), rows, in_features, packed.data_ptr(), out_features, padded_in,
        None if bias is None else bias.data_ptr(), y.data_ptr(),
    )
    return y if done else None


def dequantize_rows(
    rows: torch.Tensor,  # [R] int64, each below qweight.shape[0]
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bits: int, group_size: int, zero: int, padded_in: int, in_features: int,
) -> torch.Tensor:  # [R, in_features] float32
    """Weight rows ``rows`` in float32: the embedding lookup of a quantized embedding matrix
    (its codes in rows or in the lane layout)."""
    lanes = _lanes_of(qweight, bits)
    rows = rows.contiguous()
    out = torch.empty((rows.numel(), in_features), dtype=torch.float32)
    _library.quant_dequantize_rows(
        qweight.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(), padded_in,
        in_features, bits, group_size // 32, zero, int(lanes), rows.data_ptr(), rows.numel(), out.data_ptr(),
    )
    return out


def quantize_activations(
    x: torch.Tensor,  # [T, K] float32, contiguous
    padded_in: int, isa_override: int | None = None, levels: int = 2,
) -> dict[str, torch.Tensor]:
    """The kernels' quantized activations of ``x`` (what :func:`gemm` computes first), for tests:
    ``xq`` [T, Kp] int8 (with two levels also ``xq2`` [T, Kp] int8, the residual at a 256 times
    finer scale) and per 32-block the scale ``dx`` [T, Kp / 32] float32 and the code sum
    ``xsum`` [T, Kp / 32] int32 (two levels: 256 sum xq + sum xq2; see quant_ops.c)."""
    path = _check_path(isa_override, levels)
    rows, in_features = x.shape
    blocks = padded_in // 32
    out = {
        "xq": torch.empty((rows, padded_in), dtype=torch.int8),
        "dx": torch.empty((rows, blocks)), "xsum": torch.empty((rows, blocks), dtype=torch.int32),
    }
    if levels == 2:
        out["xq2"] = torch.empty((rows, padded_in), dtype=torch.int8)
    _library.quantize_activations(
        path, x.data_ptr(), rows, in_features, padded_in, out["xq"].data_ptr(),
        out["xq2"].data_ptr() if levels == 2 else None, out["dx"].data_ptr(), out["xsum"].data_ptr(),
    )
    return out
