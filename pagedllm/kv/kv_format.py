"""8-bit KV cache formats: their names, storage dtypes, and the reference quantizer.

A quantized cache keeps, per layer, K and V codes
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the format's storage
dtype and one float16 scale per slot and KV head
``[num_blocks, block_size, num_kv_heads]`` beside each. The vector a token
stores for a head is ``code.float() * scale``.

Quantizing one vector ``x`` (``head_dim`` values) -- the rule every backend
follows, and which :func:`quantize_kv` implements as the reference the
kernels are tested against:

1. ``scale = absmax(x) / QMAX`` in float32, rounded to float16 (round to
   nearest even) and raised to at least ``2**-14`` (the smallest positive
   normal float16), so an all-zero vector still has a usable scale;
2. ``code = x / float(scale)`` in float32, clamped to ``[-QMAX, QMAX]`` and
   rounded: int8 to the nearest integer (ties to even), fp8 by torch's
   ``.to(float8)`` (round to nearest even). The clamp only matters when the
   float16 rounding of the scale went down, and keeps fp8 codes finite.

Per slot and head, rather than per block and head, because a block is filled
a token at a time: a per-block scale would have to be known before the
block's later tokens exist (or the block requantized as they arrive).

**int8 stores rotated vectors.** A head's keys have a few channels much larger
than the rest, and one absmax scale per vector spends most of int8's range on
them. So for int8 (``KVFormat.rotated``, where ``head_dim`` is a power of two)
the model stores ``H k`` and ``H v`` instead, ``H`` the Walsh-Hadamard matrix
of +-1 entries (:func:`hadamard`; orthogonal up to a factor ``head_dim``),
which spreads every channel over all of them. Attention is unchanged up to
exact powers of two: ``(H q) . (H k) = head_dim * (q . k)``, so the query is
rotated too and the softmax scale divided by ``head_dim``; the output,
``sum p (H v) = H (sum p v)``, is rotated back and divided by ``head_dim``
(:func:`rotated_attention_scale`, done by the model around the backend, so
every backend and kernel reads the cache as any other int8 cache). On the
default model this halves the keys' relative int8 error (1.1% -> 0.56%,
values 0.72% -> 0.59%). The float formats' error is relative to each value
already, and rotating did not help them (measured), so they store vectors
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import KV_CACHE_DTYPE_ALIASES, SUPPORTED_KV_CACHE_DTYPES
from pagedllm.errors import ConfigError

SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0**-14  # the smallest positive normal float16


@dataclass(frozen=True)
class KVFormat:
    """One 8-bit KV format: its canonical name, the cache tensor's dtype and the largest code."""

    name: str
    storage_dtype: torch.dtype
    qmax: float

    @property
    def is_float(self) -> bool:
        return self.storage_dtype != torch.int8

    @property
    def rotated(self) -> bool:
        """Whether vectors are stored Hadamard-rotated (where ``head_dim`` is a power of two)."""
        return not self.is_float


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
ALIASES = KV_CACHE_DTYPE_ALIASES  # vLLM's spelling fp8 = fp8_e4m3
KV_CACHE_DTYPES = SUPPORTED_KV_CACHE_DTYPES  # every accepted name of kv_cache_dtype
assert set(KV_CACHE_DTYPES) == {"auto", *FORMATS, *ALIASES}
_BY_DTYPE = {fmt.storage_dtype: fmt for fmt in FORMATS.values()}


def resolve(kv_cache_dtype: str) -> KVFormat | None:
    """The format a ``kv_cache_dtype`` names; None for ``auto`` (the model's dtype, unquantized).

    Raises ConfigError naming the choices for anything else."""
    if kv_cache_dtype == "auto":
        return None
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if name not in FORMATS:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported yet; pagedllm accepts kv_cache_dtype "
            f"{' or '.join(repr(v) for v in KV_CACHE_DTYPES)} only"
        )
    return FORMATS[name]


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V cache tensors: the model's for ``auto``, else the format's storage dtype."""
    fmt = resolve(kv_cache_dtype)
    return model_dtype if fmt is None else fmt.storage_dtype


def format_of(dtype: torch.dtype) -> KVFormat | None:
    """The format whose storage dtype ``dtype`` is, or None for an unquantized (float) cache."""
    return _BY_DTYPE.get(dtype)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _BY_DTYPE


def stores_rotated(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a cache of ``cache_dtype`` holds Hadamard-rotated vectors of ``head_dim``
    (see the module docstring): int8, with a power-of-two head size."""
    fmt = _BY_DTYPE.get(cache_dtype)
    return fmt is not None and fmt.rotated and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def hadamard(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of each vector ``x[..., :]`` (a power-of-two
    length), times ``scale``: butterflies from the widest stride down, in ``x``'s dtype.
    The reference for the native ``hadamard_f32``, which gives the same bits."""
    n = x.shape[-1]
    shape = x.shape
    half = n // 2
    while half >= 1:
        pairs = x.reshape(*shape[:-1], n // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        half //= 2
    return x * scale if scale != 1.0 else x


def rotate(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``hadamard(x) * scale`` in float32 for ``x`` ``[rows, heads, head_dim]``: on the CPU in
    place where ``x`` is a float32 tensor the native kernel takes (rows may be strided), else a
    new tensor, the same bits either way; on other devices a matmul with :func:`hadamard_matrix`."""
    from pagedllm.native import cpu_ops

    x = x.float()  # x itself when float32
    if x.device.type != "cpu":  # one matmul, not six kernels of butterflies per call
        return (x @ hadamard_matrix(x.shape[-1], x.device)) * scale
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and cpu_ops.available():
        cpu_ops.hadamard_(x, scale)
        return x
    return hadamard(x, scale)


_MATRICES: dict[tuple[int, str], torch.Tensor] = {}


def hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (+-1, symmetric) in float32 on ``device``, cached:
    ``x @ hadamard_matrix(n)`` is ``hadamard(x)`` up to the order of the sums."""
    key = (n, str(device))
    if key not in _MATRICES:
        _MATRICES[key] = hadamard(torch.eye(n, dtype=torch.float32)).to(device)
    return _MATRICES[key]


def rotated_attention_scale(scale: float, head_dim: int) -> float:
    """The softmax scale for rotated queries and keys: their dot products are ``head_dim`` times
    the originals' (an exact power of two)."""
    return scale / head_dim


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``x`` ``[..., head_dim]`` (any float dtype) in the format of ``dtype``.

    Returns ``(codes [..., head_dim] in dtype, scales [...] float16)``; see the module docstring."""
    fmt = _BY_DTYPE[dtype]
    x32 = x.float()
    scales = (x32.abs().amax(dim=-1) / fmt.qmax).to(SCALE_DTYPE).clamp_min_(MIN_SCALE)
    scaled = (x32 / scales.float().unsqueeze(-1)).clamp_(-fmt.qmax, fmt.qmax)
    if fmt.is_float:
        return scaled.to(dtype), scales
    return scaled.round_().to(torch.int8), scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes [..., head_dim] * scales [...]`` computed in float32, returned as ``dtype``."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an 8-bit tensor, for indexing ops CPU float8 lacks (index_copy_, ...)."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor
