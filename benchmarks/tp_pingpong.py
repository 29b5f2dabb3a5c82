"""Cross-core round trip through shared memory: two processes hand a counter back and forth.

    python benchmarks/tp_pingpong.py [--rounds 20000]

Each process spins on the other's counter in a numpy view of a /dev/shm file, as the
shared-memory collectives of tensor parallelism wait for their peer
(pagedllm.distributed.SharedMemoryAllReduce). Prints microseconds per round trip: the floor
under every one of a TP step's collectives on this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch


def _rank(rank: int, path: str, rounds: int, out) -> None:
    counters = torch.from_file(path, shared=True, size=128, dtype=torch.uint8).view(torch.int64).numpy()[::8]
    start = time.perf_counter()
    for i in range(1, rounds + 1):
        counters[rank] = i
        while counters[1 - rank] < i:
            pass
    if rank == 0:
        out.put((time.perf_counter() - start) / rounds * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    path = f"/dev/shm/pagedllm-pingpong-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(128)
    out = mp.get_context("spawn").SimpleQueue()
    try:
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, path, args.rounds, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print(f"{out.get():.2f} us per round trip ({args.rounds} rounds)")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
