"""The native paged-attention kernel per ISA path against this machine's limits.

    python benchmarks/attention_kernel.py [--json FILE] [--paths scalar,avx2,...] [--layout shuffled|engine]
                                          [--kv-layouts token,head]

On a CPU with AMX-BF16 the avx512_bf16 path runs bfloat16 caches on the tiles;
its vector kernels are then measured too, as ``avx512_bf16-vector``.

Shapes are SmolLM2-135M's (9 query / 3 KV heads, head_dim 64, block 16).
Decode: a batch of 64 sequences of context 340, every layer its own cache
(30 layers, 1.0 GB of fp32 K/V, more than the caches hold), so each call
streams its K/V from memory as in a W64 decode step; the figure is the K/V
bytes read per second, set against a measured read bandwidth (a
float32 ``sum`` over 1 GiB on all threads) and against the rate at which the
same K/V bytes are read in the kernel's order with nothing but a sum
(``kv_read_ceiling.c``: scattered blocks, K and V side by side, the same L2
prefetch), the ceiling for this access pattern. ``--layout`` sets where the
decode blocks lie: ``shuffled`` (the default) draws every block at random from
the pool, as a long-running server's churned free queue does; ``engine`` puts
them where a fresh pool does under W64 (each prompt's blocks side by side,
decode blocks taken in turn). ``--kv-layouts`` measures each path over the pools in
each of the kernels' layouts (KVCache's ``layout``: token-major blocks, or each head's
part of a block contiguous with its keys stored dims by tokens); the same values, so
the same outputs. Prefill: one 300-token prompt, one
layer, causal; the figure is GFLOP/s (4 * head_dim flops per query head per
visible key), set against a float32 matmul's rate. ``torch`` is the
PyTorch path of TorchAttentionBackend (SDPA for prefill, the gathered-context
decode) for comparison.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_reference import make_paged_batch  # noqa: E402

from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.bench import report  # noqa: E402
from pagedllm.kv.kernel_bench import engine_tables  # noqa: E402
from pagedllm.kv.kv_cache import in_layout  # noqa: E402
from pagedllm.native import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gbs(repeats: int) -> float:
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    x.sum()
    return x.numel() * 4 / best_of(lambda: x.sum(), repeats) / 1e9


def matmul_gflops(dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    a @ b
    return 2 * 2048**3 / best_of(lambda: a @ b, repeats) / 1e9


def build_read_ceiling() -> ctypes.CDLL | None:
    """kv_read_ceiling.c, compiled for this machine (None without a compiler or AVX2)."""
    out = Path(tempfile.mkdtemp()) / "kv_read_ceiling.so"
    source = Path(__file__).with_name("kv_read_ceiling.c")
    try:
        subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", str(source), "-o", str(out)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    library = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.read_kv_blocks.argtypes = [p, p, p, i64, p, i64, i64, i64, i64, i64]
    library.read_kv_blocks.restype = ctypes.c_float
    return library


def pattern_read_gbs(library: ctypes.CDLL, decode, kv_bytes: int, repeats: int, work: int = 0) -> float:
    """GB/s of reading every decode layer's K/V in the kernel's block order (a sum, no attention;
    ``work`` dependent FMAs per line read, kv_read_ceiling.c)."""
    args = []
    for b in decode:
        md = b.metadata
        tables = md.block_tables.to(torch.int32).contiguous()
        lens = md.seq_lens.to(torch.int32).contiguous()
        token_bytes = b.k_cache.shape[2] * b.k_cache.shape[3] * b.k_cache.element_size()
        args.append((b, tables, lens, token_bytes))

    def all_layers():
        for b, tables, lens, token_bytes in args:
            library.read_kv_blocks(b.k_cache.data_ptr(), b.v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                                   lens.data_ptr(), lens.numel(), b.k_cache.shape[1], token_bytes, 64 // BLOCK, work)

    all_layers()
    return kv_bytes / (best_of(all_layers, repeats) / len(decode)) / 1e9


def to_engine_layout(b) -> None:
    """Move a batch's blocks to where a fresh pool puts them (``kernel_bench.engine_tables``)."""
    md = b.metadata
    old = md.block_tables.long()
    new = engine_tables(*old.shape).long() + 1  # block 0 stays unused
    k, v = b.k_cache.clone(), b.v_cache.clone()
    k[new.flatten()], v[new.flatten()] = b.k_cache[old.flatten()], b.v_cache[old.flatten()]
    b.k_cache.copy_(k)
    b.v_cache.copy_(v)
    md.block_tables.copy_(new.to(md.block_tables.dtype))


def decode_layers(dtype: torch.dtype, layers: int = 30, batch: int = 64, context: int = 340,
                  layout: str = "shuffled"):
    """``layers`` independent decode batches (one token per sequence) and their caches."""
    specs = [(context - 1, 1)] * batch
    out = []
    for layer in range(layers):
        b = make_paged_batch(specs, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, dtype=dtype, seed=layer)
        md = b.metadata
        TorchAttentionBackend().write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, md.slot_mapping)
        if layout == "engine":
            to_engine_layout(b)
        out.append(b)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    return out, kv_bytes


def batch_in_layout(batch, kv_layout: str):
    """``batch`` with its caches in ``kv_layout`` (KVCache's): the same values, rearranged."""
    if kv_layout == "token":
        return batch
    k, v = in_layout(batch.k_cache, kv_layout, values=False), in_layout(batch.v_cache, kv_layout, values=True)
    assert cpu_ops.kv_layout(k, v) == cpu_ops.KV_LAYOUT_HEAD
    return dataclasses.replace(batch, k_cache=k, v_cache=v)


def run_kernel(batch, use_native: bool):
    md = batch.metadata
    backend = TorchAttentionBackend(use_native=use_native)
    return lambda: backend.forward(batch.query, batch.k_cache, batch.v_cache, md, batch.scale)


def measure_path(path: str, dtype: torch.dtype, repeats: int, decode, kv_bytes, prefill) -> dict:
    use_native = path != "torch"
    calls = [run_kernel(b, use_native) for b in decode]

    def all_layers():
        for call in calls:
            call()

    all_layers()
    decode_s = best_of(all_layers, repeats) / len(calls)
    prefill_call = run_kernel(prefill, use_native)
    prefill_call()
    prefill_s = best_of(prefill_call, repeats)
    n = prefill.metadata.query_lens_host[0]
    flops = 4 * HEAD_DIM * HEADS * n * (n + 1) / 2
    return {
        "path": path, "dtype": str(dtype).removeprefix("torch."),
        "decode_ms_per_layer": decode_s * 1e3, "decode_gbs": kv_bytes / decode_s / 1e9,
        "prefill_ms": prefill_s * 1e3, "prefill_gflops": flops / prefill_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", default=",".join([*cpu_ops.cpu_isa_paths(), "torch"]))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--layout", choices=("shuffled", "engine"), default="shuffled",
                        help="decode block tables: drawn at random from the pool, or as a fresh pool "
                             "hands them out under W64 (prompts side by side, decode blocks in turn)")
    parser.add_argument("--kv-layouts", default="token",
                        help="comma-separated pool layouts to measure each path over: token, head")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    assert cpu_ops.available(), "the native kernels did not build"
    limits = {
        "layout": args.layout,
        "read_gbs": read_bandwidth_gbs(args.repeats),
        "matmul_gflops_fp32": matmul_gflops(torch.float32, args.repeats),
        "matmul_gflops_bf16": matmul_gflops(torch.bfloat16, args.repeats),
    }
    print(json.dumps(limits), flush=True)
    rows = []
    ceiling = build_read_ceiling()
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        decode, kv_bytes = decode_layers(dtype, layout=args.layout)
        pattern_gbs = pattern_read_gbs(ceiling, decode, kv_bytes, args.repeats) if ceiling else None
        limits[f"pattern_read_gbs_{str(dtype).removeprefix('torch.')}"] = pattern_gbs
        print(json.dumps({"dtype": str(dtype), "pattern_read_gbs": pattern_gbs}), flush=True)
        prefill = make_paged_batch([(0, 300)], block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                   head_dim=HEAD_DIM, dtype=dtype, seed=99)
        md = prefill.metadata
        TorchAttentionBackend().write_kv(prefill.new_key, prefill.new_value, prefill.k_cache,
                                         prefill.v_cache, md.slot_mapping)
        paths = args.paths.split(",")
        if "avx512_bf16" in paths and dtype == torch.bfloat16 and cpu_ops.attention_amx():
            paths.insert(paths.index("avx512_bf16") + 1, "avx512_bf16-vector")  # the same path without AMX
        for path, kv_layout in [(p, k) for p in paths for k in args.kv_layouts.split(",")]:
            laid = [batch_in_layout(b, kv_layout) for b in decode]
            laid_prefill = batch_in_layout(prefill, kv_layout)
            if path == "torch":
                row = measure_path(path, dtype, args.repeats, laid, kv_bytes, laid_prefill)
            else:
                isa = path.removesuffix("-vector")
                with cpu_ops.using_isa(isa) as library, cpu_ops.attention_amx_set(isa == path, library):
                    row = measure_path(path, dtype, args.repeats, laid, kv_bytes, laid_prefill)
                    row["attention_amx"] = dtype == torch.bfloat16 and cpu_ops.attention_amx(library)
            row["kv_layout"] = kv_layout
            del laid
            row["decode_pct_of_read_bw"] = 100 * row["decode_gbs"] / limits["read_gbs"]
            if pattern_gbs:
                row["decode_pct_of_pattern_read"] = 100 * row["decode_gbs"] / pattern_gbs
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                report.write_json(args.json, {"limits": limits, "results": rows, "env": report.environment(),
                                              "threads": torch.get_num_threads(), "pid": os.getpid()})
        del decode


if __name__ == "__main__":
    main()
