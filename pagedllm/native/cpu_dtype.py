"""Which floating-point formats this CPU computes natively, for dtype resolution.

torch runs bfloat16 (and float16) matmuls on the CPU through oneDNN only where
the CPU has instructions for them (AVX-512-BF16 or AMX for bf16; AVX-512-FP16
or AMX-FP16 for fp16). Elsewhere it emulates them, and the matmuls, most of a
forward pass, become about 20x slower than float32. ``dtype="auto"`` picks
float32 on every CPU; :func:`check_cpu_dtype` says so loudly when a user asks
for a 16-bit dtype that this CPU would emulate.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

logger = logging.getLogger("pagedllm")


@functools.cache
def native_matmul(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmuls in ``dtype`` run on native instructions here
    (oneDNN's own answer where its private query exists, the CPU flags otherwise)."""
    from pagedllm.layers.dispatch import onednn_native_dtype

    return onednn_native_dtype(dtype)


def emulated_dtype_message(dtype: torch.dtype) -> str | None:
    """Why ``dtype`` will be slow on this CPU, or None when its matmuls are native."""
    if native_matmul(dtype):
        return None
    from pagedllm.native.cpu_ops import cpu_model

    name = str(dtype).removeprefix("torch.")
    return (
        f"dtype={name}: this CPU ({cpu_model()}) has no native {name} matmul "
        f"(oneDNN reports none), so torch emulates it and the model's matmuls run "
        f"about 20x slower than in float32; weights and KV cache would take half the memory. "
        f"Use dtype='float32' or 'auto' (float32 on this CPU) for speed, or packed weights: a GGUF "
        f"file with quantization unset or 'gguf', or quantization='int8' / 'int4'."
    )


def check_cpu_dtype(dtype: torch.dtype, device: torch.device, dense: bool = True) -> None:
    """Warn (a RuntimeWarning and a log line) when ``dtype`` is emulated on this CPU and the
    model's matmuls take ``dense`` weights of it. Packed weights run the native integer kernels
    on ``dtype`` activations (widened to float32 inside), so then a log line says so instead."""
    if device.type != "cpu":
        return
    message = emulated_dtype_message(dtype)
    if message is None:
        return
    if not dense:
        name = str(dtype).removeprefix("torch.")
        logger.info("dtype=%s: this CPU has no native %s matmul; the packed weights' matmuls run on the "
                    "native integer kernels, and activations and KV cache stay %s", name, name, name)
        return
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
