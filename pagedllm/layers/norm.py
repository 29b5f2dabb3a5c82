"""RMSNorm, optionally fused with the residual add of the sublayer before it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedllm.layers.dispatch import KernelPath, kernel_path
from pagedllm.native import cpu_ops


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistic computed in float32 whatever the input dtype.

    Called with a ``residual``, it first adds ``x`` into ``residual`` in place
    and normalises the sum: the residual add of the sublayer before, fused.
    Shapes: ``x``, ``residual`` ``[T, hidden]``.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.path = KernelPath.TORCH

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.path = kernel_path(self.weight.device, self.weight.dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self.path is KernelPath.NATIVE_CPU:
            if residual is None:
                return cpu_ops.rms_norm(x.contiguous(), None, self.weight, self.eps)
            if residual.is_contiguous():
                return cpu_ops.rms_norm(residual, x, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual += x
        return self._norm(residual)

    def _norm(self, x: Tensor) -> Tensor:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))  # [T, 1]
        if x.dtype == torch.float32:
            return self.weight * (x32 * inv_rms)
        return self.weight * (x32 * inv_rms).to(x.dtype)
