"""Large host buffers on transparent huge pages (2 MiB) where the kernel allows them.

The KV pools are the largest host allocation of a CPU engine (gigabytes), and
decode attention reads them in scattered 16-token blocks: with 4 KiB pages a
step touches hundreds of thousands of pages, far more than the TLB maps, so
most block reads begin with a page walk, and the first write of every page
costs a fault that zeroes 4 KiB. Linux backs a region with 2 MiB pages when it
is asked to (``madvise(MADV_HUGEPAGE)``; the default ``enabled`` setting of
most distributions is ``madvise``, which does nothing without that call), so
the pools are placed in one 2 MiB-aligned buffer marked that way. On AMD Zen 4
streamed decode attention read 15-16 GB/s on 4 KiB pages and 18 on huge pages
(docs/benchmarks.md, "Huge pages for the KV pools").

Where the kernel has no transparent huge pages (``never``, another OS) the
buffer is an ordinary one: ``madvise`` failing is not an error.
``PAGEDLLM_HUGE_PAGES=0`` turns the call off, for comparison.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger("pagedllm")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
ALIGN = 64  # every tensor carved from a buffer starts on a cache line

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        fn = ctypes.CDLL(name, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def huge_pages_enabled() -> bool:
    """Whether buffers are marked for huge pages: Linux, and ``PAGEDLLM_HUGE_PAGES`` is not 0."""
    return sys.platform.startswith("linux") and os.environ.get("PAGEDLLM_HUGE_PAGES", "1") != "0"


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Mark the whole 2 MiB pages inside ``tensor``'s memory for huge pages, before it is touched.

    Returns the bytes marked (0 where the tensor holds no whole huge page, off
    Linux, when turned off, or when the kernel refuses).
    """
    if not huge_pages_enabled() or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    length = (end - first) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return 0
    try:
        if _libc_madvise()(first, length, MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
            return 0
    except (OSError, AttributeError):
        return 0
    return length


def host_tensors(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], *, zero: bool,
                 huge: bool = True) -> list[torch.Tensor]:
    """One tensor per ``(shape, dtype)``, all carved from one buffer (aligned and marked for huge
    pages when ``huge``).

    One buffer rather than one per tensor: each separate allocation would round
    to whole huge pages and waste up to 2 MiB. ``zero``: fill with zeros now
    (every page resident from the start); otherwise the memory is untouched
    and the OS supplies it as it is first written.
    """
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    huge = huge and huge_pages_enabled() and total >= HUGE_PAGE
    pad = HUGE_PAGE if huge else ALIGN
    raw = torch.empty(total + pad, dtype=torch.uint8)
    base = -raw.data_ptr() % pad
    buffer = raw[base:base + total]
    if huge:
        advise_huge_pages(buffer)
    if zero:
        buffer.zero_()
    return [buffer[offset:offset + size].view(dtype).view(shape)
            for (shape, dtype), offset, size in zip(specs, offsets, sizes, strict=True)]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 128 << 20
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep the engine's freed buffers (up to 32 MiB each) in the process instead of handing them back.

    glibc serves an allocation above a threshold that starts at 128 KiB with
    a fresh ``mmap`` and unmaps it on ``free``, and trims the heap's free top
    above another: every step's activation buffers, logits and the packed
    matmuls' scratch were then new pages that the kernel zeroed and mapped page
    by page, step after step (about 300,000 page faults in a W64 run). This
    fixes both thresholds: allocations up to 32 MiB come from the heap, and up
    to 128 MiB of freed heap stays mapped for the next step. Called once by a
    CPU worker. Skipped where the user tunes malloc (``GLIBC_TUNABLES`` or
    ``MALLOC_*`` in the environment), off glibc, and when
    ``PAGEDLLM_MALLOC_TUNING=0``. Returns whether the thresholds were set.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get("PAGEDLLM_MALLOC_TUNING", "1") == "0"
            or "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _malloc_tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _malloc_tuned
