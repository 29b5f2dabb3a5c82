"""Streamed K/V reads with N dependent FMAs per line: do the reads overlap the arithmetic?

    python benchmarks/kv_read_overlap.py [--layout engine|shuffled] [WORK,...]

The default model's decode step (64 sequences x 340 tokens, 30 layers' bfloat16 caches, as
attention_kernel.py builds them). ``address order`` is attention_kernel.py's pattern read
(kv_read_ceiling.c: each block in address order, every head of a token together, the next
group's blocks prefetched into L2) with the arithmetic added; ``head order, group of G``
reads as the AMX attention kernel does (kv_read_overlap.c): per group of G blocks, head
after head, each head's 128 bytes of every token, with no software prefetch (mode 0), the
next group's rows of the same head (mode 1, as the kernel) or of all heads in address order
(mode 2). Prints GB/s of K/V, best of 5.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import attention_kernel
import torch


def build_head_order() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "kv_read_overlap.so"
    source = Path(__file__).with_name("kv_read_overlap.c")
    subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", str(source), "-o", str(out)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.read_heads.argtypes = [p, p, p, i64, p, i64, i64, i64, i64, i64, i64, i64]
    lib.read_heads.restype = ctypes.c_float
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("engine", "shuffled"), default="engine")
    parser.add_argument("work", nargs="?", default="0,4,8", help="comma-separated FMAs per line")
    args = parser.parse_args()
    ceiling, heads = attention_kernel.build_read_ceiling(), build_head_order()
    decode, kv_bytes = attention_kernel.decode_layers(torch.bfloat16, layout=args.layout)
    layers = []
    for b in decode:
        md = b.metadata
        layers.append((b, md.block_tables.to(torch.int32).contiguous(), md.seq_lens.to(torch.int32).contiguous()))

    def head_order(work: int, group: int, mode: int) -> None:
        for b, tables, lens in layers:
            heads.read_heads(b.k_cache.data_ptr(), b.v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                             lens.data_ptr(), lens.numel(), b.k_cache.shape[1], b.k_cache.shape[2],
                             b.k_cache.shape[3] * 2, group, work, mode)

    for work in (int(w) for w in args.work.split(",")):
        rate = attention_kernel.pattern_read_gbs(ceiling, decode, kv_bytes, 5, work=work)
        print(f"work {work}: address order {rate:.1f} GB/s", flush=True)
        for group in (4, 1):
            for mode in (0, 1, 2):
                def run(work=work, group=group, mode=mode):
                    head_order(work, group, mode)

                run()
                rate = kv_bytes / (attention_kernel.best_of(run, 5) / len(layers)) / 1e9
                print(f"work {work}: head order, group of {group}, prefetch mode {mode}: {rate:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
