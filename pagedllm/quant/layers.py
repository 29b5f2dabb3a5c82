"""Quantized weights inside the layers of pagedllm.layers.

A linear layer serves a packed matrix through :class:`QuantizedLinearMethod`
(its ``weight`` parameter becomes an empty placeholder that only keeps the
model's dtype and device); the embedding and the LM head are replaced by
:class:`QuantizedEmbedding` / :class:`QuantizedLMHead` over one packed
``[vocab, hidden]`` matrix (one object for both when they are tied).
:func:`install_quantized` does the swap on a loaded model. Under tensor
parallelism each rank serves its shard (:func:`local_shard`), the same bytes
as that part of the full matrix: column-parallel layers and the vocabulary by
rows, and the row-parallel ones (o_proj, down_proj) by rows too, over every
input column (:class:`QuantizedRowParallelMethod`), so that each output is
computed whole, in one rank's float sequence, exactly as at TP=1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedllm.distributed import SINGLE_PROCESS, TensorParallelGroup
from pagedllm.errors import ModelLoadError
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_lookup
from pagedllm.layers.linear import (
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedllm.quant.formats import QuantizedWeight


def _placeholder(like: Tensor) -> nn.Parameter:
    """An empty parameter with ``like``'s dtype and device (what bind() and .to() look at)."""
    return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False)


def _check_shape(what: str, weight: QuantizedWeight, expected: tuple[int, ...]) -> None:
    if weight.shape != tuple(expected):
        raise ModelLoadError(f"quantized {what} has shape {weight.shape}, expected {tuple(expected)}")


class QuantizedLinearMethod(LinearMethod):
    """A linear layer's matmul on one packed ``[out, in]`` matrix; the bias stays dense."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight
        self.matmul = weight.apply  # until bind() chooses the kernel once

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        _check_shape("linear weight", self.weight, (output_size, input_size))
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def bind(self, layer: nn.Module) -> None:
        self.matmul = self.weight.matmul(layer.weight.device)  # the packed layout is the kernel's

    def rows_matmul(self, layer: nn.Module, ranges: list[tuple[int, int]]):
        matmul = QuantizedWeight.cat_rows([self.weight.rows(a, b) for a, b in ranges]).matmul(layer.weight.device)
        bias = None if layer.bias is None else torch.cat([layer.bias[a:b] for a, b in ranges])
        return matmul if bias is None else (lambda x: matmul(x) + bias)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None) -> Tensor:
        y = self.matmul(x)  # [T, out] in x's dtype
        return y if bias is None else y + bias


class QuantizedRowParallelMethod(QuantizedLinearMethod):
    """A row-parallel layer's packed matrix under tensor parallelism, held by output rows.

    Splitting a packed matrix by input columns would leave each output as two partial block
    sequences summed across ranks, which round differently from TP=1's single sequence; the
    next layer's int8 activations then turn that rounding into different codes and, at
    near ties, different tokens. Instead each rank holds rows ``[out_start, out_end)`` over
    every input column: it gathers the full input from every rank's columns (exact), computes
    its outputs as TP=1 does, and the outputs are gathered the same way
    (:meth:`TensorParallelGroup.all_gather_columns`). Two gathers instead of one sum of
    partial products.
    """

    gathers_input = True

    def __init__(self, weight: QuantizedWeight, out_start: int) -> None:
        super().__init__(weight)
        self.out_start = out_start

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None, overlaps: tuple[int, ...] = ()) -> Tensor:
        tp = layer.tp
        full = tp.all_gather_columns(x.contiguous(), layer.input_start, layer.full_input_size, overlaps)
        y = self.matmul(full)  # [T, this rank's outputs]
        if bias is not None:
            y = y + bias[self.out_start : self.out_start + y.shape[1]]
        return tp.all_gather_columns(y.contiguous(), self.out_start, layer.output_size)


class QuantizedEmbedding(nn.Module):
    """``ids [T] -> [T, hidden]`` in ``weight``'s dtype, looked up in a packed ``[vocab, hidden]``
    matrix; under tensor parallelism, the rows ``[vocab_start, vocab_end)`` of it, as
    :class:`VocabParallelEmbedding` (zeros for the ids another rank holds, then an all-reduce)."""

    def __init__(self, quantized: QuantizedWeight, like: Tensor, tp: TensorParallelGroup = SINGLE_PROCESS,
                 vocab_start: int = 0) -> None:
        super().__init__()
        self.quantized = quantized
        self.weight = _placeholder(like)  # the model's dtype and device
        self.tp, self.vocab_start = tp, vocab_start
        self.vocab_end = vocab_start + quantized.out_features

    def forward(self, input_ids: Tensor) -> Tensor:
        def lookup(ids: Tensor) -> Tensor:
            rows = self.quantized.embed(ids)  # float32
            # a same-dtype .to() is no copy, but costs a decode step tens of microseconds with cold caches
            return rows if rows.dtype == self.weight.dtype else rows.to(self.weight.dtype)

        if self.tp.size == 1:
            return lookup(input_ids)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.vocab_end, self.tp, lookup)


class QuantizedLMHead(nn.Module):
    """``hidden [N, hidden] -> logits [N, vocab]`` float32 on a packed ``[vocab, hidden]`` matrix;
    under tensor parallelism on this rank's vocabulary rows, gathered on the first rank as
    :class:`ParallelLMHead` does (None on the others)."""

    def __init__(self, quantized: QuantizedWeight, tp: TensorParallelGroup = SINGLE_PROCESS,
                 vocab_size: int | None = None) -> None:
        super().__init__()
        self.quantized = quantized
        self.matmul = quantized.apply  # until bind() chooses the kernel once
        self.tp = tp
        self.vocab_size = quantized.out_features if vocab_size is None else vocab_size

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.matmul = self.quantized.matmul(device)

    def forward(self, hidden: Tensor) -> Tensor | None:
        gathered = self.tp.gather_columns(self.matmul(hidden), self.vocab_size)  # itself at one rank
        return None if gathered is None else gathered.float()


def local_shard(module: nn.Module, parts: list[QuantizedWeight]) -> QuantizedWeight:
    """This rank's share of a packed parameter, from its checkpoint matrices ``parts`` (q, k, v
    or gate, up for a fused layer; one otherwise), each of the checkpoint's full shape."""
    if isinstance(module, MergedColumnParallelLinear):
        return QuantizedWeight.cat_rows([part.rows(first, first + rows)
                                         for part, (first, rows) in zip(parts, module.parts, strict=True)])
    (whole,) = parts
    if isinstance(module, RowParallelLinear):  # by output rows over every column: QuantizedRowParallelMethod
        return whole.rows(*module.tp.shard(module.output_size))
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return whole.rows(module.vocab_start, module.vocab_end)
    if isinstance(module, LinearBase):  # not split
        return whole
    raise ModelLoadError(f"{type(module).__name__} cannot hold a quantized matrix")


def install_quantized(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Serve the named parameters of ``model`` (a LlamaForCausalLM) from packed matrices.

    ``weights`` maps parameter names (``layers.0.mlp.gate_up_proj.weight``,
    ``embed_tokens.weight``, ``lm_head.weight``) to matrices of this rank's
    parameter's shape (:func:`local_shard`). A quantized ``embed_tokens.weight`` also serves a tied
    LM head. Raises ModelLoadError on a shape mismatch or a name that cannot
    be quantized. Call ``model.bind_kernels()`` afterwards.
    """
    tp = model.tp
    for name, weight in weights.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, RowParallelLinear) and tp.size > 1:
            start, end = tp.shard(module.output_size)
            _check_shape(name, weight, (end - start, module.full_input_size))
            module.method = QuantizedRowParallelMethod(weight, start)
            module.weight = _placeholder(module.weight)
        elif isinstance(module, LinearBase):
            _check_shape(name, weight, (module.output_size, module.input_size))
            module.method = QuantizedLinearMethod(weight)
            module.weight = _placeholder(module.weight)
        elif isinstance(module, VocabParallelEmbedding):
            _check_shape(name, weight, tuple(module.weight.shape))
            tied = isinstance(model.lm_head, ParallelLMHead) and bool(model.lm_head._tied)
            model.embed_tokens = QuantizedEmbedding(weight, module.weight, tp, module.vocab_start)
            if tied:
                model.lm_head = QuantizedLMHead(weight, tp, module.vocab_size)
        elif isinstance(module, ParallelLMHead):
            _check_shape(name, weight, tuple(module.weight_tensor.shape))
            model.lm_head = QuantizedLMHead(weight, tp, module.vocab_size)
        else:
            raise ModelLoadError(f"{name} cannot be quantized")


def quantizable_weights(model: nn.Module) -> list[str]:
    """Names of the parameters :func:`install_quantized` accepts: linear weights, the embedding, an untied LM head."""
    names = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, LinearBase)]
    names.append("embed_tokens.weight")
    if isinstance(model.lm_head, ParallelLMHead) and not model.lm_head._tied:
        names.append("lm_head.weight")
    return names


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every distinct packed matrix ``model`` serves (a tied embedding/head once)."""
    found: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        method = getattr(module, "method", None)
        for weight in (getattr(module, "quantized", None), getattr(method, "weight", None)):
            if isinstance(weight, QuantizedWeight):
                found[id(weight)] = weight
    return list(found.values())
