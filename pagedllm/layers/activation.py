"""SiLU-and-multiply, the gate of a SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.layers.dispatch import KernelPath, kernel_path
from pagedllm.native import cpu_ops


class SiluAndMul(nn.Module):
    """``[T, 2n] = [gate | up] -> silu(gate) * up``, ``[T, n]``."""

    def __init__(self) -> None:
        super().__init__()
        self.path = KernelPath.TORCH

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        """Pick the kernel for activations of this device and dtype (the layer has no weights)."""
        self.path = kernel_path(device, dtype)

    def forward(self, gate_up: Tensor) -> Tensor:
        if self.path is KernelPath.NATIVE_CPU:
            return cpu_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
