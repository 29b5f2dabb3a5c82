"""Rotary position embedding (the HF "rotate_half" convention).

The frequencies come from the model (``inverse_frequencies``, with whatever
scaling its config asks for); this module only builds the tables and rotates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from pagedllm.layers.dispatch import KernelPath, kernel_path
from pagedllm.native import cpu_ops


class RotaryEmbedding(nn.Module):
    """cos/sin tables over positions ``0 .. max_positions - 1`` and the step-wise rotation.

    The tables are built once per device on first use (not registered as
    buffers, so a model built on the meta device and materialised later still
    gets them, and casting the model to bfloat16 keeps them float32).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        inverse_frequencies: Callable[[], Tensor],
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inverse_frequencies = inverse_frequencies  # () -> [head_dim / 2] float32
        # YaRN-style scalings scale cos and sin (so q.k) by this factor squared.
        self.attention_factor = attention_factor
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.path = KernelPath.TORCH

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.path = kernel_path(device, dtype)

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._tables:
            self._tables[device] = self._build_tables(device)
        return self._tables[device]

    @torch.inference_mode(False)
    def _build_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin, each [max_positions, head_dim / 2] float32; built as normal
        tensors even under inference mode so later autograd use is not refused."""
        with torch.no_grad():
            inv_freq = self.inverse_frequencies().to(device)
            positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            angles = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2]
            if self.attention_factor == 1.0:
                return angles.cos(), angles.sin()
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions`` [T], each [T, 1, D/2] in ``dtype``; once per forward pass."""
        cos_table, sin_table = self.tables(positions.device)
        cos = cos_table.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = sin_table.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin

    def for_step(self, positions: Tensor, like: Tensor) -> StepRotary:
        """The angles of one forward pass at ``positions`` [T], for tensors like ``like``."""
        return StepRotary(self, positions, like)


def check_positions(positions: Tensor, cos_table: Tensor) -> None:
    """Raise ValueError when a position is past the rows of the rotary tables (the native
    kernels index them unchecked)."""
    if positions.numel() and int(positions.max()) >= cos_table.shape[0]:
        raise ValueError(
            f"position {int(positions.max())} is past the model's {cos_table.shape[0]} rotary positions"
        )


class StepRotary:
    """The rotary angles of one forward pass, shared by every layer.

    On the native CPU path heads are rotated in place reading the float32
    tables at each position; otherwise cos/sin are gathered once here and
    :func:`rotate` builds a new tensor per layer.
    """

    def __init__(self, rotary: RotaryEmbedding, positions: Tensor, like: Tensor) -> None:
        self.native = rotary.path is KernelPath.NATIVE_CPU and positions.dtype == torch.int64
        if self.native:
            self.cos_table, self.sin_table = rotary.tables(positions.device)
            check_positions(positions, self.cos_table)
            self.positions = positions.contiguous()
        else:
            self.cos, self.sin = rotary.cos_sin(positions, like.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, N, D] (rows may be strided) rotated; in place on the native path."""
        if self.native:
            cpu_ops.rotary_(x, self.positions, self.cos_table, self.sin_table)
            return x
        return rotate(x, self.cos, self.sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, N, D] rotated by angle pairs (cos, sin [T, 1, D/2]) into a new contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)  # x2 cos + x1 sin
    return out
