"""Scatter new K/V rows into the paged cache, quantizing them for an 8-bit cache.

Quantization (``attention/base.py``), per token and KV head: ``scale`` =
absmax over head_dim (fp32) / the format's largest code, rounded to float16
and raised to at least 2**-14 (the smallest normal float16, so an all-zero
row has a usable scale); ``code = x / scale`` (IEEE division) rounded: int8
half to even and clamped to [-127, 127]; fp8 to the nearest code, ties to
even, as torch's ``.to(float8)`` rounds.

fp8 codes are encoded with integer operations on the fp32 bits and stored
through a ``uint8`` view of the cache: the same instructions in the CPU
interpreter (whose own fp32 -> fp8 cast does not round to nearest) and on a
GPU, so the interpreter tests check the encoding a GPU runs. Values past the
largest finite code saturate to it (the scale keeps them within rounding of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.attention.kernels.common import kv_scale_args

# Smallest normal float16: the floor of every scale.
MIN_SCALE = tl.constexpr(2.0**-14)
# fp32 round-to-nearest-even to an integer: adding 1.5 * 2**23 leaves no
# fraction bits for |y| < 2**22, so the add itself rounds.
RNE_MAGIC = tl.constexpr(1.5 * 2.0**23)


@dataclass(frozen=True)
class CodeFormat:
    """Constants of one 8-bit format for the quantizing kernel.

    qmax: largest finite code value. man_bits/bias: the fp8 mantissa width and
    exponent bias (0 for int8); max_code: the largest finite code's bit pattern.
    sub_magic: a power of two whose fp32 ulp is the fp8 subnormal step, so
    ``|y| + sub_magic`` rounds |y| onto the subnormal grid; sub_magic_bits its fp32 bits.
    """

    qmax: float
    man_bits: int = 0
    bias: int = 0
    max_code: int = 0

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def sub_magic_exponent(self) -> int:
        return 24 - self.bias - self.man_bits  # ulp(2**k) = 2**(k - 23) = 2**(1 - bias - man_bits)

    @property
    def sub_magic(self) -> float:
        return 2.0**self.sub_magic_exponent

    @property
    def sub_magic_bits(self) -> int:
        return (127 + self.sub_magic_exponent) << 23


CODE_FORMATS = {
    "none": CodeFormat(qmax=1.0),
    "int8": CodeFormat(qmax=127.0),
    "fp8_e4m3": CodeFormat(qmax=448.0, man_bits=3, bias=7, max_code=0x7E),  # 0x7F is NaN
    "fp8_e5m2": CodeFormat(qmax=57344.0, man_bits=2, bias=15, max_code=0x7B),  # 0x7C is inf
}


@triton.jit
def _fp8_bits(
    y,  # fp32, |y| <= qmax up to float16 rounding of the scale
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
):
    """The fp8 bit pattern nearest to ``y`` (ties to even), as uint8."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Subnormal range: the fp32 add rounds onto the subnormal grid; the low bits
    # are then the code (a carry into 2**MAN_BITS is the smallest normal's code).
    subnormal = (mag + SUB_MAGIC).to(tl.int32, bitcast=True) - SUB_MAGIC_BITS
    # Normal range: drop 23 - MAN_BITS mantissa bits, ties to even (a carry
    # moves into the exponent), then rebias the exponent from 127 to BIAS.
    drop: tl.constexpr = 23 - MAN_BITS
    half_minus_one: tl.constexpr = (1 << (drop - 1)) - 1
    normal = (mag_bits + half_minus_one + ((mag_bits >> drop) & 1)) >> drop
    normal = normal - ((127 - BIAS) << MAN_BITS)
    code = tl.where(mag < MIN_NORMAL, subnormal, normal)
    code = tl.minimum(code, MAX_CODE)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_rows(
    x,  # [rows, HEAD_DIM_PAD] fp32, padding columns zero
    KV_FORMAT: tl.constexpr, QMAX: tl.constexpr,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
):
    """(codes [rows, HEAD_DIM_PAD] int8 or uint8 fp8 bits, scales [rows] float16) of each row."""
    absmax = tl.max(tl.abs(x), axis=1)  # [rows]
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32)).to(tl.float16).to(tl.float32)
    scale = tl.maximum(scale, MIN_SCALE)
    y = tl.math.div_rn(x, scale[:, None])
    if KV_FORMAT == "int8":
        codes = (y + RNE_MAGIC) - RNE_MAGIC  # round half to even
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
    else:
        codes = _fp8_bits(y, MAN_BITS, BIAS, MAX_CODE, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS)
    return codes, scale.to(tl.float16)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; int8 or uint8 (fp8 bits) when quantized
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16; written only when KV_FORMAT != "none"
    v_scale_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by k_cache and v_cache
    stride_sb, stride_ss, stride_sh,  # shared by k_scale and v_scale
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEADS_PAD: tl.constexpr,  # next power of two >= num_kv_heads
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim
    KV_FORMAT: tl.constexpr,  # "none" or the 8-bit format (common.KV_FORMATS)
    QMAX: tl.constexpr,  # CodeFormat fields of KV_FORMAT, below
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
):
    """Copy (or quantize) one token's K and V, all KV heads, into its cache slot.

    Grid: ``(num_tokens,)``. Program ``t`` reads ``slot = slot_mapping[t]``; if the
    slot is -1 (a padding row) it writes nothing, otherwise it stores the
    ``[num_kv_heads, head_dim]`` tile of ``key[t]`` / ``value[t]`` at
    ``cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]``, and for a quantized cache
    each head's scale at ``scale[slot // BLOCK_SIZE, slot % BLOCK_SIZE, head]``.
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    head_idx = tl.arange(0, HEADS_PAD)
    heads = head_idx[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]  # [1, HEAD_DIM_PAD]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    if KV_FORMAT == "none":
        # The unquantized copy, exactly as compiled before quantization existed.
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        k_src = key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd
        v_src = value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd
        k = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
        k_codes, k_scale = _quantize_rows(
            k, KV_FORMAT, QMAX, MAN_BITS, BIAS, MAX_CODE, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS
        )
        v_codes, v_scale = _quantize_rows(
            v, KV_FORMAT, QMAX, MAN_BITS, BIAS, MAX_CODE, MIN_NORMAL, SUB_MAGIC, SUB_MAGIC_BITS
        )
        dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
        tl.store(k_cache_ptr + dst, k_codes, mask=mask)
        tl.store(v_cache_ptr + dst, v_codes, mask=mask)
        scale_dst = block * stride_sb + offset * stride_ss + head_idx * stride_sh  # [HEADS_PAD]
        head_ok = head_idx < num_kv_heads
        tl.store(k_scale_ptr + scale_dst, k_scale, mask=head_ok)
        tl.store(v_scale_ptr + scale_dst, v_scale, mask=head_ok)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp16; quantized caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` rows at their slots; rows with slot -1 are skipped.

    An int8 / fp8 cache stores codes and each (slot, head)'s scale into
    ``k_scale``/``v_scale`` (the module docstring gives the rounding).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    scales = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    fmt = CODE_FORMATS[scales.kv_format]
    if scales.kv_format.startswith("fp8"):
        # Codes are written as their bit patterns (see the module docstring).
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, scales.k_scale, scales.v_scale, slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *scales.strides,
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FORMAT=scales.kv_format,
        QMAX=fmt.qmax,
        MAN_BITS=fmt.man_bits,
        BIAS=fmt.bias,
        MAX_CODE=fmt.max_code,
        MIN_NORMAL=fmt.min_normal,
        SUB_MAGIC=fmt.sub_magic,
        SUB_MAGIC_BITS=fmt.sub_magic_bits,
    )
