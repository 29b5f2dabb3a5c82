"""int8 KV caches hold Hadamard-rotated K and V (pagedllm/kv/kv_format.py).

Oracles: the Walsh-Hadamard matrix's own algebra (H H = n I; dot products
scale by n), the PyTorch ``kv_format.hadamard`` for the native kernel (bit for
bit, every ISA path), a float32 cache for what the int8 cache must hold once
rotated back, and, on the default model, the same int8 cache without the
rotation for how much it buys.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kv import kv_format
from pagedllm.kv.accuracy import prefill
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.tiers import MANIFEST
from pagedllm.models.loader import load_model
from pagedllm.native import cpu_ops

VOCAB = 512


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [2, 16, 64, 128])
def test_hadamard_is_the_sylvester_matrix_and_its_own_inverse_up_to_n(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-50, 50, (5, 3, n), generator=gen).float()  # small integers: every sum is exact
    y = kv_format.hadamard(x)
    assert torch.equal(y.double(), x.double() @ _sylvester(n))  # H is symmetric
    assert torch.equal(kv_format.hadamard(y), n * x)
    q, k = torch.randn(4, n, generator=gen), torch.randn(4, n, generator=gen)
    dots = (kv_format.hadamard(q) * kv_format.hadamard(k)).sum(-1)
    torch.testing.assert_close(dots, n * (q * k).sum(-1), rtol=1e-5, atol=1e-4)
    assert torch.equal(kv_format.hadamard(x, 0.25), y * 0.25)


@pytest.fixture(scope="module", params=cpu_ops.cpu_isa_paths())
def library(request):
    if not cpu_ops.available():
        pytest.skip("no C compiler for the native CPU kernels")
    return cpu_ops.build_library(isa=request.param)


@pytest.mark.parametrize("head_dim", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("scale", [1.0, 1 / 64])
def test_native_hadamard_equals_the_reference_bit_for_bit(library, head_dim, scale):
    gen = torch.Generator().manual_seed(head_dim)
    wide = torch.randn(37, 5 * head_dim + 7, generator=gen) * 10
    x = wide[:, 3 : 3 + 4 * head_dim].view(37, 4, head_dim)  # strided rows, as q/k/v inside qkv
    want = kv_format.hadamard(x.clone(), scale)
    untouched = wide[:, 4 * head_dim + 3 :].clone()
    cpu_ops.hadamard_(x, scale, library=library)
    assert torch.equal(x, want)
    assert torch.equal(wide[:, 4 * head_dim + 3 :], untouched)  # nothing past the heads was written


@pytest.mark.parametrize("head_dim", [8, 16, 64, 128])
def test_native_bfloat16_hadamard_is_the_modules_rotation(library, head_dim):
    """hadamard_bf16 (the layer stack's rotation of bfloat16 rows): every head widened and
    transformed as ``kv_format.rotate`` does, the first heads written back rounded to bfloat16
    as ``.to(torch.bfloat16)`` does, all heads to float32 when asked; nothing else touched."""
    gen = torch.Generator().manual_seed(head_dim)
    rows, heads, narrow = 37, 5, 3
    wide = (torch.randn(rows, heads * head_dim + 9, generator=gen) * 10).to(torch.bfloat16)
    x = wide[:, : heads * head_dim].view(rows, heads, head_dim)
    want_f32 = kv_format.hadamard(x.float(), 0.5)
    untouched, tail = x[:, narrow:].clone(), wide[:, heads * head_dim :].clone()
    y = torch.full((rows, heads * head_dim + 4), float("nan"))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    library.hadamard_bf16.argtypes = [p, i64, i64, i64, i64, ctypes.c_float, i64, p, i64]
    library.hadamard_bf16(x.data_ptr(), rows, wide.stride(0), heads, head_dim, 0.5, narrow, y.data_ptr(), y.stride(0))
    assert torch.equal(y[:, : heads * head_dim].view(rows, heads, head_dim), want_f32)
    assert torch.equal(x[:, :narrow], want_f32[:, :narrow].to(torch.bfloat16))
    assert torch.equal(x[:, narrow:], untouched) and torch.equal(wide[:, heads * head_dim :], tail)
    assert y[:, heads * head_dim :].isnan().all()  # y's row past the heads untouched
    again = torch.randn(rows, heads, head_dim, generator=gen).to(torch.bfloat16)
    want = kv_format.rotate(again, 1.0 / head_dim).to(torch.bfloat16)
    library.hadamard_bf16(again.data_ptr(), rows, heads * head_dim, heads, head_dim, 1.0 / head_dim, heads, None, 0)
    assert torch.equal(again, want)  # no float32 copy asked for: the attention output's way back


def test_rotate_is_the_same_bits_on_either_path():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 3, 64, generator=gen)
    assert torch.equal(kv_format.rotate(x.clone(), 1 / 64), kv_format.hadamard(x, 1 / 64))
    bf16 = x.to(torch.bfloat16)
    got = kv_format.rotate(bf16)
    assert got.dtype == torch.float32 and torch.equal(got, kv_format.hadamard(bf16.float()))


@pytest.mark.parametrize("n", [16, 64, 128])
def test_the_matrix_form_used_off_the_cpu_is_the_same_transform(n):
    gen = torch.Generator().manual_seed(n)
    matrix = kv_format.hadamard_matrix(n, torch.device("cpu"))
    assert torch.equal(matrix.double(), _sylvester(n))
    x = torch.randn(7, 3, n, generator=gen)
    torch.testing.assert_close(x @ matrix * 0.5, kv_format.hadamard(x, 0.5), rtol=1e-6, atol=1e-5)


def test_only_int8_with_a_power_of_two_head_size_is_stored_rotated():
    assert kv_format.FORMATS["int8"].rotated
    assert kv_format.stores_rotated(torch.int8, 64) and kv_format.stores_rotated(torch.int8, 128)
    assert not kv_format.stores_rotated(torch.int8, 80)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.bfloat16):
        assert not kv_format.stores_rotated(dtype, 64)


def _tiny_dir(tmp_path_factory, hidden: int, heads: int):
    return save_tiny_llama(tmp_path_factory.mktemp(f"tiny-llama-rot-{hidden}"), vocab_size=VOCAB, hidden_size=hidden,
                           intermediate_size=256, num_attention_heads=heads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_dir(tmp_path_factory, 256, 4)  # head_dim 64


@pytest.fixture(scope="module")
def tiny80_dir(tmp_path_factory):
    return _tiny_dir(tmp_path_factory, 320, 4)  # head_dim 80: not a power of two




def _stored(cache: KVCache, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n slots' K and V of one layer as floats [n, KH, D] (dequantized for 8-bit)."""
    tensors = cache.layers[layer]
    kh, d = tensors[0].shape[2], tensors[0].shape[3]
    if len(tensors) == 2:
        return tuple(t.reshape(-1, kh, d)[:n].float() for t in tensors)
    k, v, ks, vs = tensors
    return tuple(kv_format.dequantize_kv(c.reshape(-1, kh, d)[:n], s.reshape(-1, kh)[:n]) for c, s in ((k, ks), (v, vs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_cache_holds_rotated_vectors_that_rotate_back_to_the_float_ones(tiny_dir, dtype):
    loaded = load_model(str(tiny_dir), dtype=dtype, device=torch.device("cpu"), attn_backend=TorchAttentionBackend())
    tokens = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    want_logits, dense = prefill(loaded, tokens, dtype)
    got_logits, int8 = prefill(loaded, tokens, torch.int8)
    d = loaded.config.head_dim
    for layer in range(loaded.config.num_layers):
        for want, stored in zip(_stored(dense, layer, len(tokens)), _stored(int8, layer, len(tokens)), strict=True):
            back = kv_format.hadamard(stored, 1.0 / d)
            # int8 keeps ~8 bits of each rotated vector's absmax; the vectors themselves are
            # the float cache's (in bf16, up to its own rounding)
            tolerance = 0.02 * want.abs().amax().item()
            assert (back - want).abs().max().item() < tolerance
            assert (stored - want).abs().max().item() > 10 * tolerance  # stored as they are, they would not match
    torch.testing.assert_close(got_logits.float(), want_logits.float(), atol=0.05, rtol=0)


def test_a_head_size_that_is_not_a_power_of_two_is_stored_as_it_is(tiny80_dir):
    loaded = load_model(str(tiny80_dir), dtype=torch.float32, device=torch.device("cpu"),
                        attn_backend=TorchAttentionBackend())
    assert loaded.config.head_dim == 80
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    want_logits, dense = prefill(loaded, tokens, torch.float32)
    got_logits, int8 = prefill(loaded, tokens, torch.int8)
    for want, stored in zip(_stored(dense, 0, 40), _stored(int8, 0, 40), strict=True):
        assert (stored - want).abs().max().item() < 0.02 * want.abs().amax().item()
    torch.testing.assert_close(got_logits, want_logits, atol=0.05, rtol=0)


def test_the_disk_tier_key_names_the_rotation(tiny_dir, tmp_path):
    def manifest(kv_cache_dtype: str) -> dict:
        llm = LLM(str(tiny_dir), device="cpu", dtype="float32", block_size=8, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_dir=str(tmp_path / kv_cache_dtype), kv_cache_memory=2**22)
        llm.generate([{"prompt_token_ids": list(range(3, 30))}], SamplingParams(max_tokens=2))
        path = llm.llm_engine.disk_tier.directory / MANIFEST
        return json.loads(path.read_text())

    assert "kv=hadamard" in manifest("int8")["model"]
    assert "kv=" not in manifest("fp8_e4m3")["model"]


@pytest.mark.slow
def test_rotation_cuts_the_int8_cache_error_on_the_default_model(monkeypatch):
    """Next-token logits over 256 tokens of English, int8 KV against float32 KV, with and
    without the rotation: the rotation must cut the mean KL at least in half."""
    from pathlib import Path

    from pagedllm.tokenizer import Tokenizer

    loaded = load_model(None, dtype=torch.float32, device=torch.device("cpu"), attn_backend=TorchAttentionBackend())
    text = (Path(__file__).parent / "data" / "english_text.txt").read_text()
    tokens = Tokenizer.load(loaded.path).encode(text)[:256]
    want = prefill(loaded, tokens, torch.float32)[0].log_softmax(-1)

    def kl() -> float:
        got = prefill(loaded, tokens, torch.int8)[0].log_softmax(-1)
        return (want.exp() * (want - got)).sum(-1).mean().item()

    rotated = kl()
    monkeypatch.setattr(kv_format, "stores_rotated", lambda *args: False)
    plain = kl()
    assert rotated < 0.5 * plain, (rotated, plain)
