"""The native CPU layer kernels against the PyTorch operators they replace.

Each kernel runs twice: the build for this CPU (AVX-512 where it has it) and
the portable scalar build. float32 results must agree with PyTorch to
rounding; bfloat16 results to one bfloat16 step (the kernels and PyTorch may
sum the mean of squares in a different order).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.models.llama import rotate
from pagedllm.native import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=["native", "portable"])
def library(request):
    if request.param == "native":
        return cpu_ops.build_library()
    try:
        return cpu_ops.build_library(("-mno-avx512f",))
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"compiler cannot build without AVX-512: {exc}")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    else:  # one bfloat16 step
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-3)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (300, 64)])  # 100: a masked tail
def test_rms_norm_with_and_without_residual(library, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    _close(cpu_ops.rms_norm(x.clone(), None, weight, 1e-5, library=library), _torch_rms_norm(x, weight, 1e-5))
    residual = x.clone()
    out = cpu_ops.rms_norm(residual, delta, weight, 1e-5, library=library)
    assert torch.equal(residual, x + delta)  # the add is rounded once, as PyTorch does
    _close(out, _torch_rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (70, 40), (3, 17)])
def test_silu_mul(library, dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # far tails of the exponential
    gate, up = gate_up.split(width, dim=-1)
    _close(cpu_ops.silu_mul(gate_up, library=library), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_rows(library, dtype):
    gen = torch.Generator().manual_seed(5)
    rows, heads, head_dim, extra = 9, 5, 64, 3
    buffer = torch.randn(rows, (heads + extra) * head_dim, generator=gen).to(dtype)
    x = buffer[:, : heads * head_dim].view(rows, heads, head_dim)  # row stride > heads * head_dim
    positions = torch.tensor([0, 1, 2, 50, 7, 7, 100, 3, 9])
    angles = torch.arange(128).float()[:, None] * (1e-4 ** (torch.arange(0, head_dim, 2) / head_dim))[None]
    cos_table, sin_table = angles.cos(), angles.sin()
    untouched = buffer[:, heads * head_dim :].clone()
    expected = rotate(x.float(), cos_table[positions][:, None], sin_table[positions][:, None]).to(dtype)
    cpu_ops.rotary_(x, positions, cos_table, sin_table, library=library)
    _close(x, expected)
    assert torch.equal(buffer[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_padding(library, dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 3 * kv_heads * head_dim).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(5, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(5, kv_heads, head_dim)
    slots = torch.tensor([3, -1, 22, 0, -1])
    cpu_ops.write_kv(key, value, k_cache, v_cache, slots, library=library)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    assert torch.count_nonzero(flat_k.flatten(1).any(1)) == 3


@pytest.mark.parametrize("width", [49152, 1000, 5])
def test_argmax_logsumexp(library, width):
    gen = torch.Generator().manual_seed(width)
    logits = 10 * torch.randn(6, width, generator=gen)
    logits[1] = 0.0  # all tied: the first index wins, as torch.argmax
    logits[2, width // 2 :] = logits[2].max() + 1  # a tie of the maximum in later lanes
    logits[3, -1] = 1e4  # maximum in the masked tail
    argmax, lse = cpu_ops.argmax_logsumexp(logits, library=library)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_native_and_torch_paths_agree(dtype):
    cache_shape = (8, 16, 3, 64)
    key, value = torch.randn(20, 3, 64).to(dtype), torch.randn(20, 3, 64).to(dtype)
    slots = torch.randperm(128)[:20]
    slots[4] = -1
    caches = []
    for use_native in (True, False):
        k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
        TorchAttentionBackend(use_native=use_native).write_kv(key, value, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_rotary_rejects_positions_past_the_table():
    """The native path reads the cos/sin tables by position without bounds checks of
    its own, so the step refuses positions the tables do not have."""
    from pagedllm.models.config import ModelConfig
    from pagedllm.models.llama import rotary_embedding

    config = ModelConfig.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 100, "max_position_embeddings": 32, "rms_norm_eps": 1e-5}
    )
    rotary = rotary_embedding(config)
    rotary.bind(torch.device("cpu"), torch.float32)
    like = torch.zeros(2, 64)
    with torch.inference_mode():
        rotary.for_step(torch.tensor([0, 31]), like)  # the last position is fine
        with pytest.raises(ValueError, match="rotary positions"):
            rotary.for_step(torch.tensor([3, 32]), like)
