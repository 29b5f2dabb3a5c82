"""GGUF loading: metadata, dequantization, the q/k row permutation, rope frequency
factors, the sliding window and the disk cache."""

from __future__ import annotations

import math
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_loader import (
    hf_tensor_name,
    load_gguf_checkpoint,
    permute_for_rope,
    unpermute_for_rope,
)
from pagedllm.models.loader import load_model

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128, 64, 96, 2, 4, 2

# HF suffix -> GGUF suffix inside blk.N
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def _hf_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": FFN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **overrides,
        }
    )
    return LlamaForCausalLM(config).eval()


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{LAYER_TENSORS[suffix]}"


def _write_gguf(
    path,
    state: dict[str, torch.Tensor],
    qtypes: dict[str, QType],
    arch="llama",
    *,
    context_length=64,
    rope_theta=10000.0,
    rope_freqs: np.ndarray | None = None,
    sliding_window: int | None = None,
):
    """Write HF-named tensors the way llama.cpp's converter would (q/k permuted),
    plus a ``rope_freqs`` tensor and a sliding-window key when given.

    Returns the tensors, by HF name, that a correct loader must produce: the
    package's own dequantization of what was written, un-permuted.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(context_length)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(rope_theta)
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    expected = {}
    for hf_name, tensor in state.items():
        array = tensor.float().numpy()
        heads = HEADS if ".q_proj." in hf_name else KV_HEADS if ".k_proj." in hf_name else None
        if heads is not None:
            array = permute_for_rope(torch.from_numpy(array), heads).numpy()
        qtype = qtypes.get(hf_name, QType.F32)
        data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(_gguf_name(hf_name), data, raw_dtype=qtype)
        back = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        expected[hf_name] = unpermute_for_rope(back, heads) if heads else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_permutation_round_trips():
    w = torch.randn(HEADS * 16, HIDDEN)
    permuted = permute_for_rope(w, HEADS)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_for_rope(permuted, HEADS), w)
    # within one head, the first half's row j lands at row 2j, the second half's at 2j+1
    assert torch.equal(permuted[2], w[1]) and torch.equal(permuted[3], w[8 + 1])


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_quantized_tensors_load_as_the_package_dequantizes(tmp_path):
    state = _state(_hf_model())
    qtypes = {
        "model.embed_tokens.weight": QType.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": QType.Q8_0,
        "model.layers.0.self_attn.k_proj.weight": QType.Q4_0,
        "model.layers.0.mlp.gate_proj.weight": QType.Q4_1,
        "model.layers.1.mlp.up_proj.weight": QType.Q5_0,
        "model.layers.1.mlp.down_proj.weight": QType.BF16,
        "model.layers.1.self_attn.v_proj.weight": QType.F16,
    }
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, state, qtypes)
    checkpoint = load_gguf_checkpoint(path)
    loaded = dict(checkpoint.weights)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name
    config = checkpoint.hf_config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        LAYERS,
        HIDDEN,
        VOCAB,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_unquantized_gguf_gives_hf_logits_and_q_k_round_trip(tmp_path):
    hf_model = _hf_model()
    state = _state(hf_model)
    path = tmp_path / "tiny-f32.gguf"
    _write_gguf(path, state, {})
    loaded = load_model(
        str(path),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attn_backend=TorchAttentionBackend(),
    )
    # the permuted q/k written to the file come back as the original HF rows
    attn = loaded.model.layers[1].self_attn
    q_rows = HEADS * HIDDEN // HEADS
    assert torch.equal(
        attn.qkv_proj.dense_weight()[:q_rows], state["model.layers.1.self_attn.q_proj.weight"]
    )
    k = attn.qkv_proj.dense_weight()[q_rows : q_rows + KV_HEADS * HIDDEN // HEADS]
    assert torch.equal(k, state["model.layers.1.self_attn.k_proj.weight"])
    assert loaded.generation_config == {}
    assert loaded.config.eos_token_ids == (2,)
    tokens = list(range(3, 40))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert (_prefill_logits(loaded, tokens) - expected).abs().max().item() <= 1e-4


def _prefill_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """One prompt through a contiguous block table; logits of every position."""
    block_size = 8
    num_blocks = -(-len(tokens) // block_size)
    cfg = loaded.config
    cache = KVCache(
        num_layers=cfg.num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    n = len(tokens)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        seq_lens_host=[n],
        query_lens_host=[n],
    )
    with torch.no_grad():
        return loaded.model(torch.tensor(tokens), torch.arange(n), cache.layers, md)


def test_second_load_comes_from_cache_and_file_change_invalidates(tmp_path):
    state = _state(_hf_model())
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, state, {"model.embed_tokens.weight": QType.Q8_0})
    first = load_gguf_checkpoint(path)
    first_weights = dict(first.weights)
    assert not first.from_cache
    cached = list((tmp_path / "cache" / "gguf").glob("*.safetensors"))
    assert len(cached) == 1
    assert not list((tmp_path / "cache" / "gguf").glob(".*tmp"))
    second = load_gguf_checkpoint(path)
    assert second.from_cache
    assert second.hf_config == first.hf_config
    second_weights = dict(second.weights)
    assert all(torch.equal(second_weights[k], v) for k, v in first_weights.items())
    # Touching the file keeps its bytes, and so its cache entry.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_gguf_checkpoint(path).from_cache
    # New bytes are a new entry.
    _write_gguf(path, state, {"model.embed_tokens.weight": QType.Q4_1})
    assert not load_gguf_checkpoint(path).from_cache
    assert len(list((tmp_path / "cache" / "gguf").glob("*.safetensors"))) == 2


def test_copies_of_one_file_share_a_cache_entry(tmp_path):
    state = _state(_hf_model())
    first = tmp_path / "env-a" / "model.gguf"
    first.parent.mkdir()
    _write_gguf(first, state, {})
    assert not load_gguf_checkpoint(first).from_cache
    second = tmp_path / "env-b" / "model.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)  # another install of the same model: new path, new mtime
    assert load_gguf_checkpoint(second).from_cache
    assert len(list((tmp_path / "cache" / "gguf").glob("*.safetensors"))) == 1


def test_writing_an_entry_removes_entries_of_other_cache_formats(tmp_path, monkeypatch):
    from pagedllm.models import gguf_loader

    state = _state(_hf_model())
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, state, {})
    monkeypatch.setattr(gguf_loader, "CACHE_FORMAT_VERSION", "old")
    load_gguf_checkpoint(path)
    (old_entry,) = (tmp_path / "cache" / "gguf").glob("*.safetensors")
    monkeypatch.setattr(gguf_loader, "CACHE_FORMAT_VERSION", "new")
    assert not load_gguf_checkpoint(path).from_cache  # the old format is not read
    (entry,) = (tmp_path / "cache" / "gguf").glob("*.safetensors")
    assert entry != old_entry and not old_entry.exists()
    assert load_gguf_checkpoint(path).from_cache


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="llama"):
        load_gguf_checkpoint(path)


# Llama 3.1 scaling on a tiny model: with head_dim 16 and theta 100 the eight
# rotary wavelengths run from 6 to about 350 tokens, so against an original
# context of 32 (thresholds 8 and 32) one pair is kept, two are blended and
# five are slowed by the full factor.
LLAMA3_THETA = 100.0
LOGITS_ATOL = 1e-4
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _llama3_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 scaling:
    per rotary pair, the factor its wavelength is stretched by (``factor`` past
    the long threshold, 1 below the short one, and in between the reciprocal of
    the blend of 1/factor and 1 that llama3 scaling applies to the frequency)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for pair in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * pair / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _llama31_gguf(tmp_path, rope_freqs: np.ndarray | None):
    """An HF Llama with llama3 rope scaling, and its GGUF the way llama.cpp
    writes one: no scaling metadata, the scaling carried by ``rope_freqs``."""
    hf_model = _hf_model(
        max_position_embeddings=128, rope_theta=LLAMA3_THETA, rope_scaling=dict(LLAMA3_SCALING)
    )
    path = tmp_path / "llama31.gguf"
    _write_gguf(
        path, _state(hf_model), {}, context_length=128, rope_theta=LLAMA3_THETA, rope_freqs=rope_freqs
    )
    return hf_model, path


def _load(path):
    return load_model(
        str(path), dtype=torch.float32, device=torch.device("cpu"), attn_backend=TorchAttentionBackend()
    )


def _greedy(last_logits, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy argmax continuation (no EOS handling); ``last_logits(tokens)`` is
    the model's [vocab] logits after ``tokens``."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(last_logits(tokens).argmax()))
    return tokens[len(prompt):]


def test_gguf_rope_freqs_give_hf_llama3_logits_and_greedy_tokens(tmp_path):
    factors = _llama3_rope_freqs(HIDDEN // HEADS, LLAMA3_THETA, LLAMA3_SCALING)
    assert factors[0] == 1.0 and factors[-1] == LLAMA3_SCALING["factor"]
    assert ((factors > 1.0) & (factors < LLAMA3_SCALING["factor"])).sum() == 2
    hf_model, path = _llama31_gguf(tmp_path, factors)
    loaded = _load(path)
    assert loaded.config.rope_scaling is None
    assert loaded.config.rope_frequency_factors == tuple(factors.tolist())
    tokens = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert (_prefill_logits(loaded, tokens) - expected).abs().max().item() <= LOGITS_ATOL
    prompt = tokens[:90]
    with torch.no_grad():
        hf_tokens = _greedy(lambda t: hf_model(torch.tensor([t])).logits[0, -1], prompt, 10)
    assert _greedy(lambda t: _prefill_logits(loaded, t)[-1], prompt, 10) == hf_tokens
    assert _load(path).config == loaded.config  # the factors survive the weight cache


def test_gguf_without_rope_freqs_differs_from_hf_llama3(tmp_path):
    """The same weights without the tensor: plain rope, far outside the tolerance
    the test above holds the match to."""
    hf_model, path = _llama31_gguf(tmp_path, rope_freqs=None)
    loaded = _load(path)
    assert loaded.config.rope_frequency_factors is None
    tokens = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert (_prefill_logits(loaded, tokens) - expected).abs().max().item() > 10 * LOGITS_ATOL


def test_rope_freqs_of_the_wrong_length_are_refused(tmp_path):
    _, path = _llama31_gguf(tmp_path, rope_freqs=np.ones(5, dtype=np.float32))
    with pytest.raises(ModelLoadError, match=r"rope_freqs.weight has 5 values .* needs 8"):
        load_gguf_checkpoint(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("window", "expected"), [(16, 16), (0, None), (None, None)])
def test_gguf_sliding_window_reaches_the_model_config(tmp_path, arch, window, expected):
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, _state(_hf_model()), {}, arch=arch, sliding_window=window)
    config = ModelConfig.from_hf_config(load_gguf_checkpoint(path).hf_config)
    assert config.sliding_window == expected
