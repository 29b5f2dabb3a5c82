"""All-reduce latency between two CPU ranks: gloo (TCP loopback) against pagedllm's shared memory.

Two processes with one thread each, as tensor parallelism runs them on a
2-core machine; the tensors are SmolLM2's ``[tokens, 576]`` float32 hidden
states (a decode step of 1 and 64 sequences, prefill chunks of 512 and 2048
tokens). Both transports are timed in the same invocation, one after the
other per shape, and so is the column gather of packed GGUF layers
(``all_gather_columns``: each rank's half of the columns, through the
shared-memory slots; "shm-gather" below).

    python benchmarks/tp_all_reduce.py --iters 200 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed import ALL_REDUCE_ENV, TensorParallelGroup, attach_shared_memory

SHAPES = [(1, 576), (64, 576), (512, 576), (2048, 576)]


def _rank_main(rank: int, port: int, iters: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TensorParallelGroup(rank=rank, size=2, group=dist.group.WORLD, control_group=dist.group.WORLD)
    os.environ[ALL_REDUCE_ENV] = "shm"  # the opt-in path, timed beside gloo
    attach_shared_memory(tp, max(r * c for r, c in SHAPES) * 4 + 64, timeout_s=60)
    for shape in SHAPES:
        x = torch.randn(*shape)
        half = x[:, : shape[1] // 2].contiguous() if rank == 0 else x[:, shape[1] // 2 :].contiguous()
        start_col = 0 if rank == 0 else shape[1] // 2
        calls = {"gloo": lambda x=x: dist.all_reduce(x), "shm": lambda x=x: tp.shared_memory.all_reduce(x),
                 "shm-gather": lambda h=half, s=start_col, c=shape[1]: tp.shared_memory.all_gather_columns(h, s, c)}
        for name, call in calls.items():
            for _ in range(5):
                call()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            if rank == 0:
                results.put({"transport": name, "shape": list(shape), "bytes": x.numel() * 4,
                             "us_per_call": 1e6 * (time.perf_counter() - start) / iters})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(port, args.iters, results), nprocs=2)
    rows = []
    while not results.empty():
        rows.append(results.get())
    load = os.getloadavg()[0]
    print(f"1-min load average {load:.2f}")
    for row in rows:
        print(f"{row['transport']:10s} {str(tuple(row['shape'])):12s} {row['bytes'] / 1e3:8.0f} KB  "
              f"{row['us_per_call']:9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average_1min": load, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
