"""Quantized matmul kernels against dense float32 and torch's int4/int8 kernels.

``python -m pagedllm.quant.kernel_bench [--threads 1] [--rows 1,64] [--paths ...]``
prints one markdown row per (rows, matrix) at the default model's shapes:
best-of-20 milliseconds (``--clock wall``, or ``cpu``: the thread's CPU time) of dense float32 (the
layers' kernel: oneDNN on a packed weight where the probe finds it, ``F.linear`` otherwise), the native
Q4 and Q8 kernels (g32) on each path of ``--paths`` (``avx512-vnni``,
``avx2``: the dispatch the layers use, tiled kernel from ``tiled_min_rows()``
rows; ``avx512-vnni-rows``, ``avx2-rows``: the per-row kernel, ``-tiled``:
the tiled kernel, at every row count; ``portable``) with the activations of each of ``--activations``
(``int16``: two int8 levels, ``int8``: one), and ``torch.ops.aten._weight_int4pack_mm_for_cpu`` /
``_weight_int8pack_mm`` on bfloat16 activations (random codes: only the time
is compared). Every figure of a row comes from the same process, one after
the other.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from pagedllm.errors import ConfigError
from pagedllm.layers.dispatch import onednn_linear_available
from pagedllm.layers.linear import dense_matmul
from pagedllm.native import quant_ops
from pagedllm.quant import quantize_rtn

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (out, in)
# path suffix -> gemm's tiled=: as dispatched, the per-row or the tiled kernel at any row count
KERNEL_SUFFIXES = {"": None, "-rows": False, "-tiled": True}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter  # main() sets it from --clock


def best_ms(fn, repeats: int = 20) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = _clock()
        fn()
        best = min(best, _clock() - start)
    return 1000 * best


def parse_paths(text: str) -> list[tuple[str, int, bool | None]]:
    """``avx512-vnni,avx2-rows`` -> [(name, isa, gemm's tiled=)]; ConfigError for a path this CPU does not run."""
    by_name = {name: isa for isa, name in quant_ops.ISA_NAMES.items()}
    paths = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        suffix = next((s for s in KERNEL_SUFFIXES if s and name.endswith(s)), "")
        base = name.removesuffix(suffix) if suffix else name
        if base not in by_name or (suffix and base == "portable"):
            raise ConfigError(f"--paths: {name!r} is not a kernel path; use {', '.join(by_name)}, or "
                              f"avx512-vnni / avx2 with {' or '.join(s for s in KERNEL_SUFFIXES if s)}")
        if by_name[base] not in quant_ops.runnable_isas():
            raise ConfigError(f"--paths: this CPU does not run {base}")
        paths.append((name, by_name[base], KERNEL_SUFFIXES[suffix]))
    return paths


def default_paths() -> str:
    best = quant_ops.ISA_NAMES[quant_ops.isa()]
    return f"{best},{best}-rows" if quant_ops.isa() > 0 else best


def header(paths: list[tuple[str, int, bool | None]], activations: list[str] = ("int16",)) -> str:
    native = [f"native Q{bits} {name} {act}" for act in activations for name, _, _ in paths for bits in (4, 8)]
    dense = "dense fp32 (oneDNN packed)" if onednn_linear_available(torch.float32) else "dense fp32 (F.linear)"
    cells = ["rows", "matrix", dense, *native,
             "torch `_weight_int4pack_mm_for_cpu`", "torch `_weight_int8pack_mm`"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def row(rows: int, out_features: int, in_features: int, paths: list[tuple[str, int, bool | None]],
        activations: list[str] = ("int16",)) -> str:
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    dense = dense_matmul(w)  # oneDNN on a packed weight where it runs, F.linear otherwise
    times = [best_ms(lambda: dense(x, w, None))]
    q4, q8 = quantize_rtn(w, 4, 32), quantize_rtn(w, 8, 32)
    for act in activations:
        for _, isa, tiled in paths:
            for q in (q4, q8):
                call = partial(quant_ops.gemm, x, *q._kernel_args(), isa_override=isa, tiled=tiled,
                               levels=quant_ops.ACTIVATION_LEVELS[act])
                times.append(best_ms(call))
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zero = torch.randn(in_features // 32, out_features, 2).bfloat16()
    xb = x.bfloat16()
    times.append(best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, 32, scale_zero)))
    int8 = torch.randint(-127, 127, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features).bfloat16()
    times.append(best_ms(lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, scales)))
    name = f"{out_features}x{in_features}" + (" (LM head)" if out_features == 49152 else "")
    return f"| {rows} | {name} | " + " | ".join(f"{v:.3f}" for v in times) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,64", help="comma-separated activation row counts")
    parser.add_argument("--paths", default=None,
                        help="comma-separated native paths (default: the best this CPU runs and its "
                             "per-row kernel)")
    parser.add_argument("--activations", default="int16",
                        help="comma-separated activation modes of the native kernels: int16 (two int8 levels), int8")
    parser.add_argument("--shapes", default=None, help="comma-separated OUTxIN matrices (default: the model's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this thread's CPU time, which a machine shared with "
                             "other jobs does not inflate (only with --threads 1: other threads' work is not counted)")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        raise ConfigError("--clock cpu counts the calling thread only: use it with --threads 1")
    global _clock
    _clock = CLOCKS[args.clock]
    if not quant_ops.available():
        raise ConfigError("the native quantized kernels are not available (no C compiler?)")
    torch.set_num_threads(args.threads)
    paths = parse_paths(args.paths or default_paths())
    activations = [a.strip() for a in args.activations.split(",") if a.strip()]
    if not activations or any(a not in quant_ops.ACTIVATION_LEVELS for a in activations):
        raise ConfigError(f"--activations: use a comma-separated list of {', '.join(quant_ops.ACTIVATION_LEVELS)}")
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(header(paths, activations), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        for out_features, in_features in shapes:
            print(row(rows, out_features, in_features, paths, activations), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
