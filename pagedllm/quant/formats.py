"""Weight-only quantized matrices: each format one class, all on one packed layout.

Every format stores a ``[out, in]`` matrix as

    w[n, k] = scales[n, k // G] * (q[n, k] - zero) + mins[n, k // G]    (no mins: 0)

with unsigned codes ``q`` (4 or 8 bits), float16 scales/mins per group of
``G`` weights and one integer zero point per format. The codes are packed
as :mod:`pagedllm.native.quant_ops` reads them (4-bit: per 64-weight group,
byte ``i`` holds weight ``i`` in its low nibble and weight ``32 + i`` in its
high one); ``in`` is padded to a multiple of 64 and of ``G`` with groups whose
scale and min are 0. Resident bytes equal the GGUF blocks' bytes for Q4_0,
Q4_1 and Q8_0 (plus padding, none for widths that are multiples of 64).
Where the CPU's per-row kernel reads 4-bit codes best in the lane layout (the
outputs interleaved by 8, :func:`to_lanes`), a matrix reorders its codes once
when first bound to the native kernel: the same bytes, no second copy.

``apply(x)`` runs the native kernel (activations quantized per 32 on the fly,
to two int8 levels or one: ``activation_levels``); ``dequantize()`` is the
float32 reference the tests compare with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedllm.errors import ConfigError
from pagedllm.native import quant_ops

logger = logging.getLogger("pagedllm")

GROUP_SIZES = (32, 64, 128)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack_nibbles(codes: Tensor) -> Tensor:
    """``[N, Kp]`` uint8 codes 0..15 (Kp a multiple of 64) -> ``[N, Kp / 2]`` packed bytes."""
    rows, width = codes.shape
    groups = codes.reshape(rows, width // 64, 2, 32)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(rows, width // 2)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    rows, half = packed.shape
    groups = packed.reshape(rows, half // 32, 1, 32)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(rows, half * 2)


LANE_OUTPUTS = 8  # outputs interleaved per pass of the lane layout


def to_lanes(packed: Tensor) -> Tensor:
    """``[N, Kp / 2]`` packed 4-bit rows (N a multiple of 8) -> the same bytes in the lane layout
    of pagedllm/native/quant_ops.c, ``[N / 8, Kp / 32, 128]`` uint8: per pass of 8 outputs and
    block of 32 weights, 4 chunks of 32 bytes; byte ``4 j + t`` of chunk ``c`` holds output ``j``'s
    weight ``8 c + t`` of the block in its low nibble and ``8 c + 4 + t`` in its high one. The
    kernels know the layout by the three dimensions; :func:`from_lanes` undoes it."""
    rows, half = packed.shape
    assert rows % LANE_OUTPUTS == 0, rows
    codes = unpack_nibbles(packed).view(rows // LANE_OUTPUTS, LANE_OUTPUTS, half // 16, 4, 2, 4)  # p j b c h t
    lanes = codes.permute(0, 2, 3, 1, 5, 4)  # p b c j t h
    return (lanes[..., 0] | (lanes[..., 1] << 4)).reshape(rows // LANE_OUTPUTS, half // 16, 128).contiguous()


def from_lanes(lanes: Tensor) -> Tensor:
    """Inverse of :func:`to_lanes`: packed 4-bit rows ``[N, Kp / 2]``."""
    passes, blocks, _ = lanes.shape
    rows, half = passes * LANE_OUTPUTS, blocks * 16
    b = lanes.view(passes, blocks, 4, LANE_OUTPUTS, 4)  # p b c j t
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1)  # p b c j t h
    return pack_nibbles(codes.permute(0, 3, 1, 2, 5, 4).reshape(rows, half * 2))


@dataclass
class QuantizedWeight:
    """One packed ``[out_features, in_features]`` matrix (see the module docstring)."""

    format_name: str  # "Q4_0", "Q4_1", "Q8_0", "int4", "int8"
    bits: int
    zero: int
    group_size: int
    in_features: int
    qweight: Tensor  # [N, Kp / 2] (4-bit) or [N, Kp] (8-bit) uint8; or 4-bit in the lane layout [N / 8, Kp / 32, 128]
    scales: Tensor  # [N, Kp / G] float16
    mins: Tensor | None  # [N, Kp / G] float16
    # int8 levels per activation the native kernel quantizes inputs to: 2 (16-bit fixed point
    # per 32-block, the dequantized weights' accuracy) or 1 (int8, less integer work)
    activation_levels: int = 2
    # the row-scale tables of the CPU's per-row kernel (quant_ops.row_scale_tables), made by
    # row_tables() on first use; a copy or shard of the weight starts without
    _tables: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def padded_in(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed matrix."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    @property
    def table_nbytes(self) -> int:
        """Resident bytes of the row-scale tables, once made (0 before, or where no kernel reads them)."""
        return sum(t.numel() * t.element_size() for t in (self._tables or ()) if t is not None)

    def row_tables(self) -> tuple | None:
        """The row-scale tables the native per-row kernel of this CPU reads (as many bytes again as
        the scales and mins), made once; None where that kernel takes none or they are turned off
        (``PAGEDLLM_QUANT_ROW_TABLES=0``)."""
        if not quant_ops.row_tables_wanted():
            return None
        if self._tables is None:
            self._tables = quant_ops.row_scale_tables(self.scales, self.mins)
        return self._tables

    def native_codes(self) -> bool:
        """Reorder the codes once into the layout the CPU's native per-row kernel reads best (the
        lane layout where :func:`quant_ops.lanes_wanted`; the old tensor is released, so no
        second copy stays); returns whether ``qweight`` is now in the lane layout."""
        if not self.lanes and quant_ops.lanes_wanted(self.bits, self.out_features):
            self.qweight = to_lanes(self.qweight)
        return self.lanes

    @property
    def lanes(self) -> bool:
        """Whether ``qweight`` holds the codes in the lane layout (3-D; see :meth:`native_codes`)."""
        return self.qweight.dim() == 3

    def plain_qweight(self) -> Tensor:
        """The codes in the row layout of the module docstring (a new tensor where ``qweight`` is in
        the lane layout)."""
        return from_lanes(self.qweight) if self.lanes else self.qweight

    # ---- compute

    def apply(self, x: Tensor) -> Tensor:
        """``x [T, in] -> [T, out]`` in x's dtype (activations quantized per 32 to ``activation_levels`` int8 levels)."""
        return self.matmul(x.device)(x)

    def matmul(self, device: torch.device) -> Callable[[Tensor], Tensor]:
        """``x [T, in] -> [T, out]`` (x's dtype) for inputs on ``device``, chosen once: the native
        kernel on the packed matrix on a CPU that built it, else a dense matmul on the
        dequantized matrix (made at each call: the reference, not a serving path)."""
        if device.type != "cpu" or not quant_ops.available():
            return lambda x: F.linear(x, self.dequantize().to(x.device, x.dtype))
        self.native_codes()
        native = quant_ops.bind_gemm(*self._kernel_args(), levels=self.activation_levels, tables=self.row_tables())
        # bfloat16 activations in many rows: the AMX-BF16 tiles on the weights dequantized to
        # bfloat16 where the CPU has them (faster from AMX_BF16_MIN_ROWS rows, kernel_bench; that
        # kernel reads the row layout only: gemm_bf16 gives None for lane-layout codes)
        amx_bf16, args = quant_ops.amx_bf16_available(), self._kernel_args()

        def apply(x: Tensor) -> Tensor:
            if x.dtype == torch.float32:
                return native(x if x.is_contiguous() else x.contiguous())
            if amx_bf16 and x.dtype == torch.bfloat16 and x.shape[0] >= quant_ops.AMX_BF16_MIN_ROWS:
                y = quant_ops.gemm_bf16(x.contiguous(), *args)
                if y is not None:
                    return y
            return native(x.float().contiguous()).to(x.dtype)

        return apply

    def embed(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` [T] in float32 ``[T, in]``: an embedding lookup that never unpacks the whole matrix."""
        if not quant_ops.available():
            return self.dequantize_rows(ids)
        ids = ids if ids.dtype == torch.int64 else ids.to(torch.int64)
        return quant_ops.dequantize_rows(ids, *self._kernel_args(), self.in_features)

    def _kernel_args(self) -> tuple:
        return (self.qweight, self.scales, self.mins, self.bits, self.group_size, self.zero, self.padded_in)

    # ---- the reference

    def codes(self) -> Tensor:
        """``[N, Kp]`` int16 codes, unpacked."""
        q = unpack_nibbles(self.plain_qweight()) if self.bits == 4 else self.qweight
        return q.to(torch.int16)

    def dequantize(self) -> Tensor:
        """The float32 ``[out, in]`` matrix this format represents."""
        return self.dequantize_rows(None)

    def dequantize_rows(self, ids: Tensor | None) -> Tensor:
        qweight, scales = self.plain_qweight(), self.scales
        mins = self.mins
        if ids is not None:
            qweight, scales = qweight[ids], scales[ids]
            mins = None if mins is None else mins[ids]
        q = unpack_nibbles(qweight) if self.bits == 4 else qweight
        rows = q.shape[0]
        grouped = (q.to(torch.float32) - self.zero).reshape(rows, -1, self.group_size)
        w = grouped * scales.float()[:, :, None]
        if mins is not None:
            w = w + mins.float()[:, :, None]
        return w.reshape(rows, -1)[:, : self.in_features].contiguous()

    # ---- row operations (fusing q/k/v and gate/up, undoing llama.cpp's rope permutation)

    def map_rows(self, fn) -> QuantizedWeight:
        """The same format with ``fn`` applied to every per-row tensor (``fn`` acts on dim 0)."""
        return QuantizedWeight(
            self.format_name, self.bits, self.zero, self.group_size, self.in_features,
            fn(self.plain_qweight()).contiguous(), fn(self.scales).contiguous(),
            None if self.mins is None else fn(self.mins).contiguous(), self.activation_levels,
        )

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows ``[start, end)``: a column-parallel shard."""
        return self.map_rows(lambda t: t[start:end])

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack matrices of one format by rows (``[q | k | v]``)."""
        first = parts[0]
        layout = (first.format_name, first.group_size, first.in_features, first.activation_levels)
        if any((p.format_name, p.group_size, p.in_features, p.activation_levels) != layout for p in parts):
            raise ValueError("only matrices of one format, group size, width and activation levels can be fused")
        return QuantizedWeight(
            first.format_name, first.bits, first.zero, first.group_size, first.in_features,
            torch.cat([p.plain_qweight() for p in parts]), torch.cat([p.scales for p in parts]),
            None if first.mins is None else torch.cat([p.mins for p in parts]), first.activation_levels,
        )


# ---------------------------------------------------------------- GGUF blocks

# llama.cpp block layouts: bytes per block of 32 weights.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def from_gguf_blocks(format_name: str, blocks: np.ndarray, in_features: int) -> QuantizedWeight:
    """Repack a GGUF tensor's raw blocks (uint8 ``[N, in / 32 * block_bytes]``) without
    dequantizing: the codes are reordered, the float16 scales and mins kept bit for bit."""
    if format_name not in GGUF_BLOCK_BYTES:
        raise ConfigError(f"GGUF type {format_name} has no quantized kernel")
    rows = blocks.shape[0]
    num_blocks = in_features // 32
    raw = np.asarray(blocks, dtype=np.uint8).reshape(rows, num_blocks, GGUF_BLOCK_BYTES[format_name])
    padded = _round_up(in_features, 64)
    pad_blocks = (padded - in_features) // 32
    scales = _pad_cols(torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16).reshape(rows, num_blocks)), pad_blocks)
    if format_name == "Q8_0":
        codes = (raw[:, :, 2:] ^ np.uint8(0x80)).reshape(rows, in_features)  # int8 q -> q + 128 as uint8
        codes = _pad_cols(torch.from_numpy(np.ascontiguousarray(codes)), padded - in_features)
        return QuantizedWeight("Q8_0", 8, 128, 32, in_features, codes, scales, None)
    first = 2 if format_name == "Q4_0" else 4
    nibbles = raw[:, :, first:]  # [N, B, 16]: byte j holds weight j (low) and j + 16 (high)
    codes = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=2).reshape(rows, in_features)
    if padded != in_features:
        codes = np.pad(codes, ((0, 0), (0, padded - in_features)))
    groups = codes.reshape(rows, padded // 64, 2, 32)
    qweight = torch.from_numpy(np.ascontiguousarray((groups[:, :, 0] | (groups[:, :, 1] << np.uint8(4))).reshape(rows, padded // 2)))
    if format_name == "Q4_0":
        return QuantizedWeight("Q4_0", 4, 8, 32, in_features, qweight, scales, None)
    mins = _pad_cols(torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16).reshape(rows, num_blocks)), pad_blocks)
    return QuantizedWeight("Q4_1", 4, 0, 32, in_features, qweight, scales, mins)


def _pad_cols(t: Tensor, extra: int) -> Tensor:
    return t if extra == 0 else F.pad(t, (0, extra))


# ---------------------------------------------------------------- round to nearest (float checkpoints)


def quantize_rtn(weight: Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float ``[out, in]`` matrix.

    int8: symmetric, scale = max|w| / 127 per group. int4: asymmetric, scale =
    (max - min) / 15 and min per group. Scales and mins are rounded to float16
    first and the codes computed against the rounded values.
    """
    if bits not in (4, 8):
        raise ConfigError(f"RTN quantization has 4 or 8 bits, not {bits}")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"quantization group size {group_size} is not supported; choose one of {list(GROUP_SIZES)}")
    rows, in_features = weight.shape
    padded = _round_up(in_features, max(64, group_size))
    w = _pad_cols(weight.detach().float(), padded - in_features).reshape(rows, -1, group_size)
    if bits == 8:
        scales = (w.abs().amax(-1) / 127).to(torch.float16)
        inv = torch.where(scales > 0, 1 / scales.float(), torch.zeros(()))
        codes = (w * inv[:, :, None]).round().clamp(-127, 127).to(torch.int16) + 128
        return QuantizedWeight("int8", 8, 128, group_size, in_features,
                               codes.to(torch.uint8).reshape(rows, padded), scales, None)
    low, high = w.amin(-1), w.amax(-1)
    mins = low.to(torch.float16)
    scales = ((high - mins.float()) / 15).to(torch.float16)
    inv = torch.where(scales > 0, 1 / scales.float(), torch.zeros(()))
    codes = ((w - mins.float()[:, :, None]) * inv[:, :, None]).round().clamp(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", 4, 0, group_size, in_features,
                           pack_nibbles(codes.reshape(rows, padded)), scales, mins)
