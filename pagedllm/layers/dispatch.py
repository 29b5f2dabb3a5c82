"""The one place that decides which kernels a layer runs: native CPU, oneDNN or PyTorch.

Decided per layer when it is bound (after its weights reached their device
and dtype), never inside a forward pass. ``cpu_ops.disabled()`` around the
bind (or ``PAGEDLLM_NATIVE_OPS=0``) selects the PyTorch path. Triton
element-wise kernels would be a third :class:`KernelPath` chosen here on CUDA.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.native import cpu_ops

logger = logging.getLogger("pagedllm")


class KernelPath(enum.Enum):
    NATIVE_CPU = "native_cpu"  # pagedllm/native/cpu_ops (C, per ISA)
    TORCH = "torch"  # PyTorch operators: any device, the reference


def kernel_path(device: torch.device, dtype: torch.dtype) -> KernelPath:
    """Native kernels for CPU float32/bfloat16 tensors where they built; PyTorch otherwise."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_ops.available():
        return KernelPath.NATIVE_CPU
    return KernelPath.TORCH


_onednn_probe: dict[torch.dtype, bool] = {}

# What a private torch.ops.mkldnn op raises where a build lacks it or refuses its input.
MKLDNN_OP_ERRORS = (RuntimeError, AttributeError, NotImplementedError)


def private_mkldnn_op(name: str) -> Callable:
    """``torch.ops.mkldnn.<name>``, the one door to torch's private oneDNN ops.

    Raises one of :data:`MKLDNN_OP_ERRORS` (AttributeError, RuntimeError)
    where this torch build lacks the op; every caller catches them and takes
    a public-API fallback instead.
    """
    return getattr(torch.ops.mkldnn, name)

# oneDNN builds one primitive per input shape (the row count T changes from
# step to step) and keeps it in two LRU caches: its own primitive cache and
# the ideep cache of each calling thread, 1,024 entries each by default. An
# entry holds 0.5 MiB at T=16 and 3 MiB at T=2,000 (this model's four matmul
# shapes, measured), so a server that sees hundreds of distinct T grows by
# gigabytes before the caches fill. 64 entries bound them to about 100-200 MiB
# and still hold every shape of a step (a model's few matmul shapes, reused
# by all its layers) and of the last dozen steps; a miss costs about 0.5 ms.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's shape-keyed caches at ``capacity`` entries; returns the settings in force.

    Both caches read their size from the environment once, when first used
    (the ideep one once per thread), so this must run before the process's
    first oneDNN operation; a variable the user set is left as it is.
    """
    if capacity < 1:  # ideep crashes on an LRU_CACHE_CAPACITY of 0
        raise ValueError(f"oneDNN cache capacity must be >= 1, got {capacity}")
    return {name: os.environ.setdefault(name, str(capacity)) for name in ONEDNN_CACHE_ENV}


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed-weight linear runs, and agrees with ``F.linear``, for ``dtype``.

    ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` are
    private ops: a build may lack them or refuse a dtype. One small probe per
    dtype answers that instead of trusting flags; any failure means the
    layer takes ``F.linear``. The probe is the process's first oneDNN call,
    so the caches are bounded before it (:func:`bound_onednn_caches`).
    """
    bound_onednn_caches()
    if dtype not in _onednn_probe:
        _onednn_probe[dtype] = _probe_onednn(dtype)
    return _onednn_probe[dtype]


def _probe_onednn(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(3, 32, generator=gen).to(dtype)
            weight = torch.randn(16, 32, generator=gen).to(dtype)
            packed = private_mkldnn_op("_reorder_linear_weight")(weight, None)
            got = private_mkldnn_op("_linear_pointwise")(x, packed, None, "none", [], "")
            want = F.linear(x, weight)
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            return bool(torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance))
    except MKLDNN_OP_ERRORS as error:
        logger.debug("oneDNN packed linear unavailable for %s: %s", dtype, error)
        return False


# The CPU flags (/proc/cpuinfo) under which oneDNN runs each 16-bit dtype natively.
_NATIVE_DTYPE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
_MKLDNN_DTYPE_QUERIES = {
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}


def onednn_native_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes ``dtype`` matmuls on native instructions of this CPU.

    Asks torch's private ``torch.ops.mkldnn._is_mkldnn_{bf16,fp16}_supported``;
    where that op is missing or raises, answers from public facts instead:
    ``torch.backends.mkldnn.is_available()`` and the CPU's own flags.
    float32 is native everywhere.
    """
    if dtype == torch.float32:
        return True
    if dtype not in _MKLDNN_DTYPE_QUERIES:
        return False
    try:
        return bool(private_mkldnn_op(_MKLDNN_DTYPE_QUERIES[dtype])())
    except MKLDNN_OP_ERRORS as error:
        logger.debug("torch.ops.mkldnn cannot say whether %s is native: %s", dtype, error)
        return native_dtype_from_cpu_flags(dtype)


def native_dtype_from_cpu_flags(dtype: torch.dtype) -> bool:
    """The public-API answer of :func:`onednn_native_dtype`: oneDNN is built in and the CPU has the instructions."""
    if not torch.backends.mkldnn.is_available():
        return False
    flags = cpu_ops.cpu_flags()
    return any(flag in flags for flag in _NATIVE_DTYPE_FLAGS.get(dtype, ()))
