"""Batch-1 packed matmuls of two versions of quant_ops.c, alternating in one process.

    python benchmarks/quant_row_ab.py BEFORE.c AFTER.c [--threads N] [--rounds R]

Each source is compiled with the flags quant_ops.py uses; the two libraries
then take turns on the same weights and one activation row (the default
model's shapes, int4 with mins and int8, group 32, i.e. Q4_1's and Q8_0's
layouts), and the best time of each over the rounds is printed. Alternating in
one process keeps a VM's drift out of the ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.native import quant_ops
from pagedllm.quant.formats import quantize_rtn

SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576)]


def load(source: str, directory: Path, name: str):
    target = directory / f"{name}.so"
    subprocess.run(["gcc", "-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off", source,
                    "-o", str(target), "-lm"], check=True)
    build = quant_ops._build
    quant_ops._build = lambda compiler, flags: target
    try:
        return quant_ops.build_library()
    finally:
        quant_ops._build = build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    assert quant_ops.available(), "the quantized kernels did not build"
    torch.set_num_threads(args.threads)
    directory = Path(tempfile.mkdtemp())
    libraries = {"before": load(args.before, directory, "before"), "after": load(args.after, directory, "after")}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        weights[(n, k)] = [quantize_rtn(w, 4, 32), quantize_rtn(w, 8, 32)]
    rows = {k: torch.randn(1, k, generator=gen) for k in {k for _, k in SHAPES}}
    best: dict[tuple, float] = {}
    saved = quant_ops._library
    try:
        for _ in range(args.rounds):
            for name, library in libraries.items():
                quant_ops._library = library
                for (n, k), pair in weights.items():
                    for weight in pair:
                        call_args = weight._kernel_args()
                        reps = 20 if n > 10_000 else 400
                        quant_ops.gemm(rows[k], *call_args)
                        start = time.perf_counter()
                        for _ in range(reps):
                            quant_ops.gemm(rows[k], *call_args)
                        elapsed = (time.perf_counter() - start) / reps
                        key = (name, n, k, weight.bits)
                        best[key] = min(best.get(key, float("inf")), elapsed)
    finally:
        quant_ops._library = saved
    print(f"threads {args.threads}, best of {args.rounds} rounds, microseconds per call")
    print("| matrix | bits | before | after | before / after |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        for bits in (4, 8):
            a, b = best[("before", n, k, bits)], best[("after", n, k, bits)]
            print(f"| {n}x{k} | {bits} | {a * 1e6:.1f} | {b * 1e6:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
