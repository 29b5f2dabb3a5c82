"""A/B in one process: the tiled (many-row) packed matmuls of two builds of quant_ops.c.

    python benchmarks/quant_tile_ab.py OLD.c NEW.c ROWS [ISA [PASSES [BITS]]]   (ISA: 2 = AVX-512 VNNI, 1 = AVX2)

Six layers of the default model's four matmul shapes, int4 (or BITS=8) with per-32
scales and mins (Q4_1's layout), ROWS activation rows at two levels (the default int16
activations), the builds called through ctypes in alternating passes; prints the
median and best pass of each and checks that both builds give the same bits.
"""

from __future__ import annotations

import sys
import time

import torch
from quant_row_kernels_ab import SHAPES, load  # beside this script: same build and shapes

from pagedllm.quant import quantize_rtn

# the calling thread's CPU time: with OMP_NUM_THREADS=1 the kernels run on it, and a busy VM's
# waits between time slices do not count
CLOCK = time.thread_time


def main() -> None:
    sources, rows = sys.argv[1:3], int(sys.argv[3])
    isa = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    passes = int(sys.argv[5]) if len(sys.argv) > 5 else 20
    bits = int(sys.argv[6]) if len(sys.argv) > 6 else 4
    kernels = [load(source, i) for i, source in enumerate(sources)]
    torch.manual_seed(0)
    weights = {shape: quantize_rtn(torch.randn(*shape), bits, 32) for shape in SHAPES}
    matrices = [(shape, weights[shape]) for _ in range(6) for shape in SHAPES]
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    ys = [{n: torch.empty(rows, n) for n in (960, 576, 3072)} for _ in kernels]

    def one_pass(i: int) -> float:
        start = CLOCK()
        for (n, k), w in matrices:
            kernels[i](isa, 1, 2, xs[k].data_ptr(), rows, k, w.qweight.data_ptr(), w.scales.data_ptr(),
                       w.mins.data_ptr() if w.mins is not None else None, None, None, n, w.padded_in, bits, w.group_size // 32, w.zero, ys[i][n].data_ptr())
        return CLOCK() - start

    for i in range(2):
        one_pass(i)
    times = [[], []]
    for _ in range(passes):
        for i in range(2):
            times[i].append(one_pass(i))
    for n in ys[0]:
        if not torch.equal(ys[0][n], ys[1][n]):
            print(f"the builds disagree at N={n} (max abs difference "
                  f"{(ys[0][n] - ys[1][n]).abs().max().item():.3g}): a measurement variant, or a bug")
    for source, t in zip(sources, times, strict=True):
        t.sort()
        print(f"rows {rows} isa {isa} bits {bits} {source}: median {t[len(t) // 2] * 1e3:.2f} ms, best {t[0] * 1e3:.2f}")


if __name__ == "__main__":
    main()
