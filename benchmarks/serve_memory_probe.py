"""``pagedllm serve`` with a sampler thread that says where the resident memory is.

    PAGEDLLM_MEMORY_PROBE=probe.jsonl python benchmarks/serve_memory_probe.py serve --port 8000 ...

Every ``PAGEDLLM_MEMORY_PROBE_INTERVAL`` seconds (default 15) one JSON line:
the process's resident MiB (VmRSS), how much of the KV pools is resident
(``mincore`` over each pool tensor: pages the OS gave them so far), glibc's
malloc figures (``mallinfo2``: bytes in use and free in its arenas, bytes in
mmapped chunks) and the number of live pagedllm Request / Sequence /
RequestStream objects. ``rss - kv_resident`` is everything but the KV pools.
A diagnostic for Linux + glibc; it is not part of the package.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time

_libc = ctypes.CDLL(None)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


_libc.mallinfo2.restype = _Mallinfo2
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(address: int, num_bytes: int) -> int:
    """Bytes of [address, address + num_bytes) that are in RAM now (whole pages)."""
    start = address - address % _PAGE
    length = address + num_bytes - start
    pages = (ctypes.c_ubyte * ((length + _PAGE - 1) // _PAGE))()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        return 0
    return sum(b & 1 for b in bytes(pages)) * _PAGE


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(field + ":"))


def sample() -> dict:
    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.engine.sequence import Request, Sequence
    from pagedllm.kv.kv_cache import KVCache

    counts = {Request: 0, Sequence: 0, RequestStream: 0}
    pools = []
    for obj in gc.get_objects():
        kind = type(obj)
        if kind in counts:
            counts[kind] += 1
        elif kind is KVCache:
            pools = obj.block_tensors() + obj.cpu_block_tensors()
    malloc = _libc.mallinfo2()
    return {
        "rss_mib": _status_mib("VmRSS"),
        "kv_mib": sum(t.numel() * t.element_size() for t in pools) // _MIB,
        "kv_resident_mib": sum(resident_bytes(t.data_ptr(), t.numel() * t.element_size()) for t in pools) // _MIB,
        "malloc_in_use_mib": malloc.uordblks // _MIB,
        "malloc_free_mib": malloc.fordblks // _MIB,
        "malloc_mmapped_mib": malloc.hblkhd // _MIB,
        "requests": counts[Request],
        "sequences": counts[Sequence],
        "streams": counts[RequestStream],
    }


def _run_sampler(path: str, interval_s: float) -> None:
    start = time.monotonic()
    while True:
        time.sleep(interval_s)
        try:
            record = {"t_s": round(time.monotonic() - start, 1), **sample()}
        except Exception as exc:  # a diagnostic never takes the server down
            record = {"t_s": round(time.monotonic() - start, 1), "error": repr(exc)}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> int:
    path = os.environ.get("PAGEDLLM_MEMORY_PROBE")
    if not path:
        print("set PAGEDLLM_MEMORY_PROBE to the JSONL file to write", file=sys.stderr)
        return 2
    interval_s = float(os.environ.get("PAGEDLLM_MEMORY_PROBE_INTERVAL", "15"))
    threading.Thread(target=_run_sampler, args=(path, interval_s), name="memory-probe", daemon=True).start()
    from pagedllm.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
