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

    def after(self, gate_up_proj: nn.Module, x: Tensor) -> Tensor:
        """``self(gate_up_proj(x))``, in one pass where the projection's kernel fuses this
        activation (the AMX-BF16 matmul of a ``glu`` weight: the same bits, without the
        ``[T, 2n]`` product going to memory and back)."""
        matmul = getattr(gate_up_proj, "matmul", None)
        if self.path is KernelPath.NATIVE_CPU and getattr(matmul, "glu", False):
            return matmul.silu_mul(x)
        return self(gate_up_proj(x))

    def forward(self, gate_up: Tensor) -> Tensor:
        if self.path is KernelPath.NATIVE_CPU:
            return cpu_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
