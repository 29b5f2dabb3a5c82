"""Decode attention time per KV cache format on the native CPU kernels.

``python -m pagedllm.kv.kernel_bench [--batch 64] [--context 340] [--isa PATH ...]``
times one native paged-attention call over a decode batch (``batch``
sequences of ``context`` tokens each, the default model's heads: 9 query and
3 KV heads of 64) for every cache format -- float32, bfloat16 and the 8-bit
ones with float32 and bfloat16 queries -- on each ISA path, all in one
invocation and interleaved (each round times every case once; the figure is
the best round), so the formats compare under the same machine load. It
prints ms per call and the K/V bytes read per second.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch

from pagedllm.kv import kv_format
from pagedllm.native import cpu_ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CACHE_FORMATS = ("float32", "bfloat16", *kv_format.FORMATS)


@dataclass
class KernelCase:
    isa: str
    query_dtype: torch.dtype
    cache_format: str
    call: object  # () -> None
    kv_bytes: int  # bytes of codes/values and scales one call reads
    best_s: float = math.inf


DECODE_BLOCKS = 5  # blocks a W64 sequence adds one at a time while decoding (128 tokens)


def engine_tables(batch: int, blocks_per_seq: int) -> torch.Tensor:
    """Block tables as a fresh pool hands blocks out under a W64-like run.

    A fresh pool hands out blocks 0, 1, 2, ... in order, so each sequence's
    prompt blocks lie side by side; the blocks decode adds every 16 tokens are
    then taken in turn by the batch's sequences.
    """
    prompt = max(blocks_per_seq - DECODE_BLOCKS, 0)
    tables = torch.empty(batch, blocks_per_seq, dtype=torch.int32)
    tables[:, :prompt] = torch.arange(batch * prompt, dtype=torch.int32).view(batch, prompt)
    decode = torch.arange(batch * prompt, batch * blocks_per_seq, dtype=torch.int32)
    tables[:, prompt:] = decode.view(blocks_per_seq - prompt, batch).t()
    return tables


def _decode_inputs(batch: int, context: int, gen: torch.Generator):
    """Random K/V [num_blocks, BLOCK_SIZE, KH, D] float32, shuffled block tables, the tile list."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    tile_tokens = cpu_ops.tile_tokens(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    tiles = cpu_ops.make_tiles([context] * batch, [1] * batch, tile_tokens)
    return keys, values, tables, tiles


def make_cases(isas: list[str], batch: int, context: int) -> list[KernelCase]:
    gen = torch.Generator().manual_seed(0)
    keys, values, tables, tiles = _decode_inputs(batch, context, gen)
    query32 = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    tokens = batch * context
    cases = []
    for isa in isas:
        library = cpu_ops.build_library(isa=isa)
        for name in CACHE_FORMATS:
            fmt = kv_format.FORMATS.get(name)
            query_dtypes = (torch.float32, torch.bfloat16) if fmt else (getattr(torch, name),)
            if fmt is None:
                k, v, ks, vs = keys.to(getattr(torch, name)), values.to(getattr(torch, name)), None, None
                per_token = 2 * NUM_KV_HEADS * HEAD_DIM * k.element_size()
            else:
                (k, ks), (v, vs) = kv_format.quantize_kv(keys, fmt.storage_dtype), kv_format.quantize_kv(values, fmt.storage_dtype)
                per_token = 2 * NUM_KV_HEADS * (HEAD_DIM + 2)
            for query_dtype in query_dtypes:
                query = query32.to(query_dtype)

                def call(query=query, k=k, v=v, ks=ks, vs=vs, library=library):
                    cpu_ops.paged_attention(query, k, v, tables, tiles, scale, library=library,
                                            k_scale=ks, v_scale=vs)

                cases.append(KernelCase(isa, query_dtype, name, call, tokens * per_token))
    return cases


def run(cases: list[KernelCase], rounds: int, calls_per_round: int) -> None:
    for case in cases:
        case.call()  # warm-up: first touch of the pages, thread pool start
    for _ in range(rounds):
        for case in cases:
            start = time.perf_counter()
            for _ in range(calls_per_round):
                case.call()
            case.best_s = min(case.best_s, (time.perf_counter() - start) / calls_per_round)


def format_table(cases: list[KernelCase]) -> str:
    lines = ["| ISA | query | KV cache | ms / call | KV GB/s |", "|---|---|---|---|---|"]
    for c in cases:
        query = "fp32" if c.query_dtype == torch.float32 else "bf16"
        lines.append(f"| {c.isa} | {query} | {c.cache_format} | {1e3 * c.best_s:.3f} | {c.kv_bytes / c.best_s / 1e9:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=340, help="tokens per sequence")
    parser.add_argument("--isa", nargs="+", default=None, help=f"ISA paths (default: every one this CPU runs: "
                        f"{', '.join(cpu_ops.cpu_isa_paths())})")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per case per round")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args(argv)
    if not cpu_ops.available():
        parser.error("the native CPU kernels are not available here (no C compiler?)")
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isa or list(cpu_ops.cpu_isa_paths())
    cases = make_cases(isas, args.batch, args.context)
    run(cases, args.rounds, args.calls)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {cpu_ops.cpu_model()}, {torch.get_num_threads()} threads, 1-min load average {load:.2f}")
    print(f"decode batch {args.batch} x {args.context} tokens, {NUM_HEADS} query / {NUM_KV_HEADS} KV heads of "
          f"{HEAD_DIM}, block size {BLOCK_SIZE}; best of {args.rounds} rounds of {args.calls} calls")
    print(format_table(cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
