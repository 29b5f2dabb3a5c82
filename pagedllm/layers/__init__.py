"""The building blocks of a decoder, each choosing its kernels once, when it is bound.

Every layer here has a ``bind()`` that looks at the device and dtype its
weights ended up on and picks how its forward pass runs (native CPU kernels,
oneDNN, plain PyTorch); a model calls it after loading or moving its weights,
so ``forward`` never asks. Linear layers delegate storage and matmul to a
:class:`~pagedllm.layers.linear.LinearMethod` (dense today; quantized formats
plug in beside it) and are column- or row-parallel over a
:class:`~pagedllm.distributed.TensorParallelGroup`.
"""

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.dispatch import KernelPath, kernel_path
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    DenseLinearMethod,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, StepRotary, rotate

__all__ = [
    "DenseLinearMethod", "KernelPath", "LinearMethod", "MergedColumnParallelLinear", "ParallelLMHead",
    "QKVParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul", "StepRotary",
    "VocabParallelEmbedding", "kernel_path", "rotate",
]
