"""The quantized-KV oracle: the format of ``attention/base.py`` written out in torch.

``quantize`` gives each (token, KV head) row a float16 scale (absmax over
head_dim / the format's largest code, rounded to float16, at least 2**-14)
and 8-bit codes (x / scale rounded: int8 half to even and clamped to
[-127, 127], fp8 by torch's cast). ``QuantizedBatch`` is a random paged batch
whose cache holds such codes, with the dense dequantized rows for
``attention_reference.naive_attention``. Shared by the kernel tests and
``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import torch
from attention_reference import PagedBatch, make_paged_batch, naive_attention

FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., D] of ``cache_dtype``, scales [...] float16) per the format's definition."""
    absmax = x.float().abs().amax(dim=-1)  # [...]
    scale = (absmax / QMAX[cache_dtype]).to(torch.float16).clamp_min(2.0**-14)
    y = x.float() / scale.float().unsqueeze(-1)
    if cache_dtype == torch.int8:
        codes = y.round().clamp(-127, 127).to(torch.int8)  # torch.round: half to even
    else:
        codes = y.to(cache_dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float().unsqueeze(-1)


class QuantizedBatch:
    """A paged batch whose cache holds codes and scales; old context pre-quantized.

    ``batch.dense_keys``/``dense_values`` are the dequantized rows (context and
    new tokens alike: write_kv quantizes the new ones), ``original`` the batch
    before quantization, for the sanity bound.
    """

    def __init__(self, specs, cache_dtype: torch.dtype, *, device, seed: int, **kwargs) -> None:
        self.original: PagedBatch = make_paged_batch(specs, device=device, seed=seed, **kwargs)
        b = self.original
        gen = torch.Generator().manual_seed(seed + 1000)
        # Garbage everywhere a kernel must not read: random codes and scales.
        shape = b.k_cache.shape
        self.k_cache = _random_codes(shape, cache_dtype, gen).to(device)
        self.v_cache = _random_codes(shape, cache_dtype, gen).to(device)
        self.k_scale = (torch.rand(shape[:3], generator=gen) * 4).to(torch.float16).to(device)
        self.v_scale = (torch.rand(shape[:3], generator=gen) * 4).to(torch.float16).to(device)
        md, block_size = b.metadata, shape[1]
        dense_k, dense_v = [], []
        for i, (seq_len, q_len) in enumerate(zip(md.seq_lens_host, md.query_lens_host)):
            k_codes, k_sc = quantize(b.dense_keys[i], cache_dtype)  # [seq_len, KH, D], [seq_len, KH]
            v_codes, v_sc = quantize(b.dense_values[i], cache_dtype)
            pos = torch.arange(seq_len - q_len, device=device)  # the cached context
            slots = md.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
            for cache, scales, codes, sc in ((self.k_cache, self.k_scale, k_codes, k_sc),
                                             (self.v_cache, self.v_scale, v_codes, v_sc)):
                cache.view(torch.uint8).view(-1, *shape[2:])[slots] = codes[: len(pos)].view(torch.uint8)
                scales.view(-1, shape[2])[slots] = sc[: len(pos)]
            dense_k.append(dequantize(k_codes, k_sc).to(b.query.dtype))
            dense_v.append(dequantize(v_codes, v_sc).to(b.query.dtype))
        self.batch = PagedBatch(
            query=b.query, new_key=b.new_key, new_value=b.new_value, k_cache=self.k_cache,
            v_cache=self.v_cache, metadata=md, dense_keys=dense_k, dense_values=dense_v, scale=b.scale,
        )

    def run(self, backend) -> tuple[torch.Tensor, torch.Tensor, int]:
        """write_kv then forward; (output, oracle over the dequantized rows, real rows)."""
        b, md = self.batch, self.batch.metadata
        backend.write_kv(b.new_key, b.new_value, self.k_cache, self.v_cache, md.slot_mapping,
                         self.k_scale, self.v_scale)
        out = backend.forward(b.query, self.k_cache, self.v_cache, md, b.scale, self.k_scale, self.v_scale)
        return out, naive_attention(b.query, b), sum(md.query_lens_host)


def _random_codes(shape, cache_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if cache_dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    return (torch.randn(shape, generator=gen) * 8).to(cache_dtype)
