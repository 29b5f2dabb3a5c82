"""Batch-1 packed matmuls streamed from memory, as one decode token of the default model reads them.

    python benchmarks/batch1_stream.py [--tokens 40] [--threads 2] [--path avx2|avx512-vnni|...]
    PAGEDLLM_QUANT_ROW_TABLES=0 python benchmarks/batch1_stream.py    # the scales transposed per call
    PAGEDLLM_QUANT_LANES=0 python benchmarks/batch1_stream.py         # 4-bit codes kept in rows

Builds the default model's packed matrices with random weights (30 decoder layers of the fused
qkv, o, gate|up and down (Q4 with mins, as Q4_1), plus the tied LM head in Q8 with group 32), far more
bytes than the caches hold, and runs one activation row through every matrix in the model's
order, the way a batch-1 decode step does (the kernels alone: no attention, norms or
interpreter). Prints the median and best milliseconds per token and the bytes read per second
(codes, scales and mins), beside a float32 ``sum`` over 1 GiB on the same threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.native import quant_ops
from pagedllm.quant import quantize_rtn

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate|up, down
HEAD = (49152, 576)


def nbytes(q) -> int:
    return sum(t.numel() * t.element_size() for t in (q.qweight, q.scales, q.mins) if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=40)  # tokens timed
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--path", default=None, help="a quant_ops ISA name (default: the best this CPU runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not quant_ops.available():
        raise SystemExit("the native quantized kernels are not available (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(LAYERS):
        for out, inp in LAYER_SHAPES:
            mats.append(quantize_rtn(torch.randn(out, inp, generator=gen), 4, 32))
    mats.append(quantize_rtn(torch.randn(*HEAD, generator=gen), 8, 32))
    total = sum(nbytes(q) for q in mats)
    isa = None
    if args.path:
        isa = {name: i for i, name in quant_ops.ISA_NAMES.items()}[args.path]
    x576, x1536 = torch.randn(1, 576, generator=gen), torch.randn(1, 1536, generator=gen)

    # each matrix bound once, as the layers bind theirs (quant_ops.bind_gemm), its codes first put
    # in the layout the CPU's own path reads (QuantizedWeight.native_codes)
    if isa is None:
        for q in mats:
            q.native_codes()
    calls = [(quant_ops.bind_gemm(*q._kernel_args(), isa_override=isa, tables=q.row_tables()),
              x1536 if q.padded_in >= 1536 else x576) for q in mats]

    def token() -> float:
        start = time.perf_counter()
        for call, x in calls:
            call(x)
        return time.perf_counter() - start

    for _ in range(3):
        token()
    times = [token() for _ in range(args.tokens)]
    big = torch.ones(256 * 1024 * 1024)
    big.sum()
    read = min((lambda t: (big.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
    med, best = statistics.median(times), min(times)
    tables = sum(q.table_nbytes for q in mats)
    print(f"path {quant_ops.ISA_NAMES[isa if isa is not None else quant_ops.isa()]}, {len(mats)} matrices, "
          f"row-scale tables {tables / 1e6:.1f} MB, "
          f"{total / 1e6:.1f} MB per token, {args.threads} threads")
    print(f"ms per token: median {1000 * med:.2f}, best {1000 * best:.2f}; "
          f"GB/s {total / med / 1e9:.1f} (median) {total / best / 1e9:.1f} (best); "
          f"1 GiB float32 sum {big.numel() * 4 / read / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
