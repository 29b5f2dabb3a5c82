"""The attention backend contract.

One metadata shape serves prefill, chunked prefill, prefix-cache hits and
decode: every sequence in the batch contributes ``query_len`` new tokens
(flattened, in order) whose K/V are written to ``slot_mapping`` and which
attend causally to the first ``seq_len`` tokens of that sequence, read through
its block table. For a sequence, its new tokens sit at positions
``seq_len - query_len .. seq_len - 1``.

KV cache layout per layer: ``k_cache`` and ``v_cache`` each
``[num_blocks, block_size, num_kv_heads, head_dim]``. The slot of the token at
position ``p`` of a sequence is ``table[p // block_size] * block_size + p % block_size``.
Those are the tensors' shapes, not necessarily their memory order: a backend
names the physical layout it wants (:meth:`AttentionBackend.kv_layout`, see
``KVCache``), and on the CPU the native kernels' "head" layout makes K and V
permuted views whose blocks keep each KV head's part contiguous.

Quantized KV (``kv_cache_dtype`` other than ``auto``): the cache tensors hold
8-bit codes (``torch.int8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``;
the cache tensor's dtype names the format) and ``k_scale``/``v_scale``, each
``[num_blocks, block_size, num_kv_heads]`` float16, hold one scale per slot and
KV head: the stored vector ``x`` of a token and head is ``code.float() * scale``.
Backends quantize on write (scale = absmax / the format's largest code, rounded
to float16 first and then used to quantize) and dequantize inside attention.
Unquantized caches pass ``k_scale=None, v_scale=None``.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-forward-pass attention inputs, as tensors on the model's device.

    slot_mapping:     [num_tokens] int64; the cache slot for each new token, -1 for padding.
    block_tables:     [num_seqs, max_blocks_per_seq] int32; unused entries are 0.
    seq_lens:         [num_seqs] int32; context length of each sequence *including*
                      this step's new tokens.
    query_start_loc:  [num_seqs + 1] int32; prefix sums of query lengths, so sequence i's
                      new tokens are rows query_start_loc[i] : query_start_loc[i+1].
    max_query_len, max_seq_len: host ints (no device sync needed to size kernels).
    seq_lens_host, query_lens_host: the same numbers as Python lists, for backends
                      that loop on the host (the reference backend).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    seq_lens_host: list[int]
    query_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention reading from it."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
        k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float16
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def kv_layout(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The layout of the KV pools of ``dtype`` this backend reads on ``device`` (``KVCache``'s ``layout``)."""
        return "token"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # quantized caches only, as in write_kv
        v_scale: torch.Tensor | None = None,
        head_rows: tuple[tuple[int, int], ...] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``head_rows``: one ``(r0, r1)`` per KV head of the caches; rows outside ``[r0, r1)``
        of that head's query heads need not be computed (they may hold anything). Tensor
        parallelism gives the ranks holding one KV head disjoint rows of it."""


# name -> "module:Class"; imported only when asked for, so `import pagedllm`
# works on machines without Triton or CUDA.
_REGISTRY: dict[str, str] = {
    "torch": "pagedllm.attention.torch_backend:TorchAttentionBackend",
    "triton": "pagedllm.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """Instantiate a backend by name; ``None`` picks the best one for the device."""
    from pagedllm.errors import ConfigError

    if name is None:
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name not in _REGISTRY:
        raise ConfigError(f"attention_backend={name!r} is unknown; choose one of {available_backends()}")
    module_name, class_name = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"attention backend {name!r} cannot be loaded here: {exc}") from exc
    return getattr(module, class_name)()


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
