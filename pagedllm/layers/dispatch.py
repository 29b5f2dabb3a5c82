"""The one place that decides which kernels a layer runs: native CPU, oneDNN or PyTorch.

Decided per layer when it is bound (after its weights reached their device
and dtype), never inside a forward pass. ``cpu_ops.disabled()`` around the
bind (or ``PAGEDLLM_NATIVE_OPS=0``) selects the PyTorch path. Triton
element-wise kernels would be a third :class:`KernelPath` chosen here on CUDA.
"""

from __future__ import annotations

import enum
import logging

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


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed-weight linear runs, and agrees with ``F.linear``, for ``dtype``.

    ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` are
    private ops: a build may lack them or refuse a dtype. One small probe per
    dtype answers that instead of trusting flags; any failure means the
    layer takes ``F.linear``.
    """
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
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            want = F.linear(x, weight)
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            return bool(torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance))
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        logger.debug("oneDNN packed linear unavailable for %s: %s", dtype, error)
        return False
