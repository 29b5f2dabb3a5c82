"""Linear layers: a weight format (:class:`LinearMethod`) inside a column- or row-parallel layer.

The layer owns the sharding (which rows or columns of the checkpoint's
matrix this rank holds, and the all-reduce after a row-parallel matmul); the
method owns how the weight is stored and multiplied by (dense float today; a
quantized format is another method with its own ``create_weights``). Both
are fixed when the model is built; ``bind()`` then prepares the kernel for
the device and dtype the weights ended up on (for dense CPU weights: a copy
packed once into oneDNN's blocked layout, which then is the only copy: the
plain ``weight`` is freed and comes back from the packed one when it is
needed again, see :func:`restore_dense_weight`).

Shapes: ``x [T, in_local] -> [T, out_local]``; a row-parallel layer's output
is the full ``[T, out]`` after the all-reduce.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.distributed import (
    SINGLE_PROCESS,
    HeadShard,
    SharedHeadRows,
    TensorParallelGroup,
    head_shard,
    shard_range,
)
from pagedllm.errors import ModelLoadError
from pagedllm.layers.dispatch import onednn_linear_available, private_mkldnn_op
from pagedllm.native import cpu_ops, quant_ops


class LinearMethod(ABC):
    """How a linear layer's weight is stored and applied."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """Register the layer's parameters (``weight``, ``bias`` or a quantized format's own)."""

    @abstractmethod
    def bind(self, layer: nn.Module) -> None:
        """Prepare the kernel for the weights as they are now (after loading or moving them)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None) -> Tensor:
        """``x [T, in] -> [T, out]``, plus ``bias`` when given."""

    def rows_matmul(self, layer: nn.Module, ranges: list[tuple[int, int]]) -> Callable[[Tensor], Tensor]:
        """``x [T, in] -> [T, n]``: the outputs in ``ranges`` (``[start, end)`` of the weight's rows,
        in order), plus their bias, from a copy of those rows made now (after :meth:`bind`)."""
        weight = torch.cat([layer.dense_weight()[a:b] for a, b in ranges]).contiguous()
        bias = None if layer.bias is None else torch.cat([layer.bias[a:b] for a, b in ranges])
        matmul = dense_matmul(weight)
        return lambda x: matmul(x, weight, bias)


class _TorchMatmul:
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.linear(x, weight, bias)


class _HeldMatmul:
    """A matmul that holds the weight in a layout of its own (which can stand in for the plain one)."""

    packed: Tensor

    def dense(self) -> Tensor:
        """The weight in its plain ``[out, in]`` layout again (a new tensor, bit for bit the original)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class _PackedMatmul(_HeldMatmul):
    """oneDNN on a weight reordered once into its blocked layout.

    On this class of CPU that runs float32 matmuls 2-3x faster than
    ``F.linear`` (MKL) at every batch size above a few rows, and bfloat16
    ones a little faster.
    """

    def __init__(self, weight: Tensor) -> None:
        self.packed = private_mkldnn_op("_reorder_linear_weight")(weight.detach(), None)
        self._linear_pointwise = private_mkldnn_op("_linear_pointwise")

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    def dense(self) -> Tensor:
        return self.packed.to_dense()


def _bf16_rows(x: Tensor) -> Tensor:
    """``x`` as contiguous ``[rows, in]`` bfloat16, the AMX kernels' input."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
        x2 = x2.to(torch.bfloat16).contiguous()
    return x2


class AmxBf16Matmul(_HeldMatmul):
    """bfloat16 on the AMX-BF16 tiles (pagedllm/native/quant_ops.c, ``gemm_amx_bf16_dense``), or
    where a CPU has AVX512-BF16 but no AMX on VDPBF16PS (``gemm_dp_bf16_dense``, which reads the
    same layout a vector at a time), the weight stored once as the tiles' B operand.

    Every output is the float32 sum over 32-input blocks in one order, rounded
    once, so a row's result is the same whatever other rows share the call
    (oneDNN's is not); and the decoder-layer stack calls the same kernel
    (pagedllm/quant/stack.py), so it gives the modules' bits. Chosen on CPUs
    with AMX-BF16 or AVX512-BF16 for bfloat16 weights (:func:`quant_ops.dense_bf16_kernel`
    says which kernel); ``PAGEDLLM_DENSE_BF16_AMX=0`` keeps oneDNN.

    With ``glu`` the weight is a SwiGLU's ``[gate | up]`` (no bias), stored with the
    halves' groups of outputs in turn, and :meth:`silu_mul` gives ``silu(gate) * up``
    in one pass: the bits of this product followed by ``cpu_ops.silu_mul``.
    """

    def __init__(self, weight: Tensor, glu: bool = False) -> None:
        if not quant_ops.dense_bf16_available():
            raise RuntimeError("the dense bfloat16 kernels (AMX-BF16 or AVX512-BF16) do not run on this CPU "
                               "(or PAGEDLLM_NATIVE_OPS=0)")
        self.out_features, self.in_features = weight.shape
        self.glu = glu
        pack = quant_ops.dense_bf16_pack_glu if glu else quant_ops.dense_bf16_pack
        self.packed = pack(weight.detach())

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.glu:  # the packed order, its halves' groups in turn, put back as [gate | up]
            assert bias is None, "a fused gate/up weight has no bias"
            width = self.packed.shape[0] * quant_ops.DENSE_BF16_GROUP
            return quant_ops.glu_unpair(self._product(x, None, torch.bfloat16, width), self.out_features // 2)
        return self._product(x, bias, torch.bfloat16)

    def silu_mul(self, x: Tensor) -> Tensor:
        """``silu(gate(x)) * up(x)`` (``glu`` weights only): ``[..., out_features / 2]`` bfloat16."""
        assert self.glu
        half = self.out_features // 2
        x2 = _bf16_rows(x)
        y = quant_ops.dense_bf16_silu_mul(x2, self.packed, half)
        if y is None:  # out of memory for the kernel's scratch: the same bits in two passes
            y = cpu_ops.silu_mul(self(x2, None, None))
        return y.view(*x.shape[:-1], half)

    def float_output(self, x: Tensor) -> Tensor:
        """``self(x, ..., None).float()`` in one pass: the kernel writes the rounded bfloat16
        outputs widened to float32 (an LM head's logits)."""
        return self._product(x, None, torch.float32)

    def _product(self, x: Tensor, bias: Tensor | None, out_dtype: torch.dtype, width: int | None = None) -> Tensor:
        """The product with the packed weight's first ``width`` outputs (default: out_features), in its order."""
        width = width or self.out_features
        x2 = _bf16_rows(x)
        y = quant_ops.dense_bf16_linear(x2, self.packed, width, bias, out_dtype=out_dtype)
        if y is None:  # out of memory for the kernel's scratch: the same product through torch
            plain = quant_ops.dense_bf16_unpack(self.packed, width, self.in_features)
            y = F.linear(x2, plain, bias).to(out_dtype)
        return y.view(*x.shape[:-1], width)

    def dense(self) -> Tensor:
        if self.glu:
            return quant_ops.dense_bf16_unpack_glu(self.packed, self.out_features // 2, self.in_features)
        return quant_ops.dense_bf16_unpack(self.packed, self.out_features, self.in_features)


DENSE_BF16_AMX_ENV = "PAGEDLLM_DENSE_BF16_AMX"


def dense_bf16_amx_available() -> bool:
    """Whether dense bfloat16 matmuls run on :class:`AmxBf16Matmul`: a CPU with AMX-BF16 or
    AVX512-BF16 and the native kernels built, unless ``PAGEDLLM_DENSE_BF16_AMX=0``."""
    return os.environ.get(DENSE_BF16_AMX_ENV, "1") != "0" and quant_ops.dense_bf16_available()


def dense_matmul(weight: Tensor, glu: bool = False) -> _TorchMatmul | _HeldMatmul:
    """The kernel for a dense ``[out, in]`` weight: the AMX-BF16 tiles for bfloat16 where the CPU
    has them, packed oneDNN on CPUs where it runs, ``F.linear`` otherwise. ``glu``: the weight is
    a SwiGLU's ``[gate | up]`` without bias, whose activation the AMX kernel may fuse."""
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and dense_bf16_amx_available():
        return AmxBf16Matmul(weight, glu=glu)
    if weight.device.type == "cpu" and onednn_linear_available(weight.dtype):
        return _PackedMatmul(weight)
    return _TorchMatmul()


def weight_released(module: nn.Module) -> bool:
    """Whether ``module.weight`` was freed because its packed copy serves the matmuls."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.numel() == 0 and isinstance(getattr(module, "matmul", None), _HeldMatmul)


def bind_dense(module: nn.Module, weight: Tensor, *, release: bool) -> None:
    """``module.matmul`` for a dense ``weight``; with ``release``, a packed copy becomes the only one.

    The plain tensor is then replaced by an empty one of its dtype and device
    (as a quantized layer's placeholder is), so the layer holds its matrix
    once instead of twice. A bind with nothing moved since keeps the packed copy.
    """
    if release and weight_released(module):
        return
    module.matmul = dense_matmul(weight, glu=getattr(module, "glu", False))
    if release and isinstance(module.matmul, _HeldMatmul):
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def restore_dense_weight(module: nn.Module) -> None:
    """Bring a released ``module.weight`` back from its packed copy (which is dropped; bind again after)."""
    if weight_released(module):
        module.weight.data = module.matmul.dense()
        module.matmul = None


def restore_dense_weights(model: nn.Module) -> None:
    """:func:`restore_dense_weight` on every module of ``model``: before reading or replacing its weights."""
    for module in model.modules():
        restore_dense_weight(module)


class PackedWeightHolder(nn.Module):
    """A module whose dense ``weight`` may live only in its packed copy (see :func:`bind_dense`).

    Moves and casts restore the plain weight first, ``state_dict()`` gives it
    in its plain layout, and :meth:`dense_weight` reads it without changing
    the module.
    """

    def dense_weight(self) -> Tensor:
        """The ``[out, in]`` weight, whether the plain tensor or only its packed copy is held."""
        return self.matmul.dense() if weight_released(self) else self.weight

    def _apply(self, fn, recurse=True):
        restore_dense_weight(self)  # fn (a move or a cast) must see the real values
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if weight_released(self):
            destination[prefix + "weight"] = self.matmul.dense()


class DenseLinearMethod(LinearMethod):
    """A plain ``[out, in]`` weight in the model's dtype (on CPU, held only in oneDNN's packed layout once bound)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def bind(self, layer: nn.Module) -> None:
        bind_dense(layer, layer.weight, release=True)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None) -> Tensor:
        return layer.matmul(x, layer.weight, bias)


def _copy_checked(target: Tensor, source: Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ModelLoadError(
            f"checkpoint tensor {what} has shape {tuple(source.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(source)


class LinearBase(PackedWeightHolder):
    """A linear layer over one weight format; subclasses say which shard of the matrix is here."""

    num_parts = 1  # checkpoint tensors fused into this layer (q/k/v: 3)

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size  # this rank's, not the checkpoint's
        self.tp = tp
        self.method = method or DenseLinearMethod()
        self.method.create_weights(self, input_size, output_size, bias)
        self.matmul = None  # set by bind()

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.method.bind(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.method.apply(self, x, self.bias)

    def load_weight(self, name: str, tensor: Tensor, part: int, what: str) -> None:
        """Copy this rank's share of checkpoint tensor ``tensor`` (part ``part``) into ``name``."""
        restore_dense_weight(self)
        _copy_checked(getattr(self, name).data, tensor, what)


class MergedColumnParallelLinear(LinearBase):
    """Several checkpoint matrices stacked by rows (gate|up, q|k|v), each split by rows across ranks.

    ``parts`` gives, per checkpoint matrix, the rows this rank holds:
    ``(first row, number of rows)``; they are stacked in order. ``glu``: the two parts are a
    SwiGLU's gate and up (equal, without bias), so a dense kernel may fuse the activation
    (``AmxBf16Matmul.silu_mul``).
    """

    def __init__(
        self, input_size: int, parts: list[tuple[int, int]], bias: bool, tp: TensorParallelGroup,
        method: LinearMethod | None = None, glu: bool = False,
    ) -> None:
        super().__init__(input_size, sum(n for _, n in parts), bias, tp, method)
        self.glu = glu and not bias and len(parts) == 2 and parts[0][1] == parts[1][1]
        self.parts = parts
        self.offsets = [sum(n for _, n in parts[:i]) for i in range(len(parts))]
        self.num_parts = len(parts)

    @classmethod
    def split_evenly(
        cls, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup = SINGLE_PROCESS
    ) -> MergedColumnParallelLinear:
        parts = []
        for size in output_sizes:
            start, end = tp.shard(size)
            parts.append((start, end - start))
        return cls(input_size, parts, bias, tp)

    def load_weight(self, name: str, tensor: Tensor, part: int, what: str) -> None:
        restore_dense_weight(self)
        first, rows = self.parts[part]
        offset = self.offsets[part]
        target = getattr(self, name).data[offset : offset + rows]
        if tensor.shape[0] < first + rows:
            raise ModelLoadError(f"checkpoint tensor {what} has {tensor.shape[0]} rows, expected more")
        _copy_checked(target, tensor[first : first + rows], what)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection, split by whole heads (see :func:`head_shard`).

    Output rows: ``[q (num_q * D) | k (num_kv * D) | v (num_kv * D)]`` of this rank's heads.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
        tp: TensorParallelGroup = SINGLE_PROCESS, method: LinearMethod | None = None,
    ) -> None:
        self.heads: HeadShard = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        h = self.heads
        kv = (h.kv_start * head_dim, h.num_kv * head_dim)
        super().__init__(hidden_size, [(h.q_start * head_dim, h.num_q * head_dim), kv, kv], bias, tp, method)
        # the query columns of each KV head this rank computes for part of the rows (head_shard)
        width = num_heads // num_kv_heads * head_dim
        self.shared_q = [(i, i * width, (i + 1) * width) for i, share in enumerate(h.rows) if share != (0, 1)]
        self._row_split = None  # (matmul of the other rows, its column ranges, [(head, c0, c1, matmul)])

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        super().bind(device, dtype)
        self._row_split = None
        if self.shared_q:
            keep, at = [], 0
            for _, c0, c1 in self.shared_q:
                keep += [(at, c0)] if c0 > at else []
                at = c1
            keep += [(at, self.output_size)] if at < self.output_size else []
            parts = [(i, c0, c1, self.method.rows_matmul(self, [(c0, c1)])) for i, c0, c1 in self.shared_q]
            self._row_split = (self.method.rows_matmul(self, keep), keep, parts)

    def forward_rows(self, x: Tensor, head_rows: tuple[tuple[int, int], ...] | None) -> Tensor:
        """:meth:`forward` where a shared KV head's queries are needed only in its rows ``head_rows``:
        those are projected for those rows alone (each rank multiplies its share of them, not all);
        its other rows come back zero. The same values as :meth:`forward` in the rows computed."""
        if self._row_split is None or head_rows is None:
            return self(x)
        main, keep, parts = self._row_split
        y = main(x)
        out = y.new_empty((x.shape[0], self.output_size))
        at = 0
        for a, b in keep:
            out[:, a:b] = y[:, at : at + b - a]
            at += b - a
        for i, c0, c1, matmul in parts:
            r0, r1 = head_rows[i]
            out[:r0, c0:c1] = 0
            out[r1:, c0:c1] = 0
            if r1 > r0:
                out[r0:r1, c0:c1] = matmul(x[r0:r1])
        return out


class RowParallelLinear(LinearBase):
    """Split by input columns; partial products are summed across ranks (one all-reduce).

    ``input_range`` is this rank's ``[start, end)`` of the input features
    (default: an even split); the bias is added on rank 0 only, so the sum
    carries it once.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup = SINGLE_PROCESS,
        input_range: tuple[int, int] | None = None, method: LinearMethod | None = None,
    ) -> None:
        start, end = input_range or shard_range(input_size, tp.size, tp.rank)
        super().__init__(end - start, output_size, bias, tp, method)
        self.input_start = start
        self.full_input_size = input_size

    def forward(self, x: Tensor, shared_rows: SharedHeadRows | None = None) -> Tensor:
        """``shared_rows``: the input columns this rank shares with a neighbour (an o_proj over a
        straddling KV head's attention), zero in the rows the neighbour computes."""
        if getattr(self.method, "gathers_input", False):  # it does its own collectives
            if shared_rows is None:
                return self.method.apply(self, x, self.bias)
            return self.method.apply(self, x, self.bias, overlaps=shared_rows.overlaps)
        bias = self.bias if self.tp.is_first else None
        return self.tp.all_reduce(self.method.apply(self, x, bias))

    def load_weight(self, name: str, tensor: Tensor, part: int, what: str) -> None:
        restore_dense_weight(self)
        if name == "weight" and tensor.dim() == 2:
            tensor = tensor[:, self.input_start : self.input_start + self.input_size]
        _copy_checked(getattr(self, name).data, tensor, what)
