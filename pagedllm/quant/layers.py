"""Quantized weights inside the layers of pagedllm.layers.

A linear layer serves a packed matrix through :class:`QuantizedLinearMethod`
(its ``weight`` parameter becomes an empty placeholder that only keeps the
model's dtype and device); the embedding and the LM head are replaced by
:class:`QuantizedEmbedding` / :class:`QuantizedLMHead` over one packed
``[vocab, hidden]`` matrix (one object for both when they are tied).
:func:`install_quantized` does the swap on a loaded model, single-process
only (tensor parallelism with quantization raises ConfigError earlier).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import LinearBase, LinearMethod
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

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None) -> Tensor:
        y = self.matmul(x)  # [T, out] in x's dtype
        return y if bias is None else y + bias


class QuantizedEmbedding(nn.Module):
    """``ids [T] -> [T, hidden]`` in ``weight``'s dtype, looked up in a packed ``[vocab, hidden]`` matrix."""

    def __init__(self, quantized: QuantizedWeight, like: Tensor) -> None:
        super().__init__()
        self.quantized = quantized
        self.weight = _placeholder(like)  # the model's dtype and device

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.quantized.embed(input_ids).to(self.weight.dtype)


class QuantizedLMHead(nn.Module):
    """``hidden [N, hidden] -> logits [N, vocab]`` float32 on a packed ``[vocab, hidden]`` matrix."""

    def __init__(self, quantized: QuantizedWeight) -> None:
        super().__init__()
        self.quantized = quantized
        self.matmul = quantized.apply  # until bind() chooses the kernel once

    def bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.matmul = self.quantized.matmul(device)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.matmul(hidden).float()


def install_quantized(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Serve the named parameters of ``model`` (a LlamaForCausalLM) from packed matrices.

    ``weights`` maps parameter names (``layers.0.mlp.gate_up_proj.weight``,
    ``embed_tokens.weight``, ``lm_head.weight``) to matrices of the full
    parameter's shape. A quantized ``embed_tokens.weight`` also serves a tied
    LM head. Raises ModelLoadError on a shape mismatch or a name that cannot
    be quantized. Call ``model.bind_kernels()`` afterwards.
    """
    if model.tp.size != 1:
        raise ModelLoadError("quantized weights with tensor parallelism are not supported yet")
    for name, weight in weights.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, LinearBase):
            _check_shape(name, weight, (module.output_size, module.input_size))
            module.method = QuantizedLinearMethod(weight)
            module.weight = _placeholder(module.weight)
        elif isinstance(module, VocabParallelEmbedding):
            _check_shape(name, weight, tuple(module.weight.shape))
            tied = isinstance(model.lm_head, ParallelLMHead) and bool(model.lm_head._tied)
            model.embed_tokens = QuantizedEmbedding(weight, module.weight)
            if tied:
                model.lm_head = QuantizedLMHead(weight)
        elif isinstance(module, ParallelLMHead):
            _check_shape(name, weight, tuple(module.weight_tensor.shape))
            model.lm_head = QuantizedLMHead(weight)
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
