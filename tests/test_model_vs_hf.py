"""The Llama implementation against HF transformers on tiny random-weight models."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models import llama
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import load_model
from pagedllm.models.registry import resolve_architecture
from pagedllm.native import cpu_ops

ATOL = 1e-4
BLOCK_SIZE = 4
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny matmuls gain nothing from intra-op threads; on a shared CPU the
    threads' spin-waiting only slows them down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _hf_llama(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "tie_word_embeddings": True, **overrides})
    return LlamaForCausalLM(config).eval()


def _hf_qwen2():
    torch.manual_seed(1)
    config = Qwen2Config(**{**COMMON, "tie_word_embeddings": False, "rope_theta": 10000.0})
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


HF_MODELS = {
    "llama_tied": lambda: _hf_llama(),
    "llama_untied": lambda: _hf_llama(tie_word_embeddings=False),
    "llama_bias": lambda: _hf_llama(attention_bias=True),
    "llama3_rope": lambda: _hf_llama(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": _hf_qwen2,
}


def _ours(hf_model) -> llama.LlamaForCausalLM:
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = llama.LlamaForCausalLM(config, TorchAttentionBackend())
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


class PagedSequences:
    """A minimal stand-in for the runner: shuffled block tables and metadata."""

    def __init__(self, config: ModelConfig, num_blocks: int = 64, seed: int = 0):
        self.cache = KVCache(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=torch.float32,
            device="cpu",
        )
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def step(self, model, new_tokens: dict[int, list[int]], logits_indices=None) -> torch.Tensor:
        """Feed new tokens per sequence; returns logits of the new tokens [T, vocab]."""
        ids, positions, slots, qsl = [], [], [], [0]
        for seq, tokens in new_tokens.items():
            for token in tokens:
                pos = self.lens[seq]
                if pos % BLOCK_SIZE == 0:
                    self.tables[seq].append(self.free.pop())
                slots.append(self.tables[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                ids.append(token)
                positions.append(pos)
                self.lens[seq] += 1
            qsl.append(qsl[-1] + len(tokens))
        seqs = list(new_tokens)
        max_blocks = max(len(self.tables[s]) for s in seqs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for row, s in enumerate(seqs):
            tables[row, : len(self.tables[s])] = torch.tensor(self.tables[s])
        seq_lens = [self.lens[s] for s in seqs]
        query_lens = [len(t) for t in new_tokens.values()]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            seq_lens_host=seq_lens,
            query_lens_host=query_lens,
        )
        with torch.no_grad():
            return model(
                torch.tensor(ids), torch.tensor(positions), self.cache.layers, md, logits_indices
            )


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_prefill_then_decode_matches_hf(name, native):
    """Both CPU paths: the native kernels (where they build) and plain PyTorch operators."""
    with contextlib.nullcontext() if native else cpu_ops.disabled():
        _check_prefill_then_decode(name)


def _check_prefill_then_decode(name):
    hf_model = HF_MODELS[name]()
    ours = _ours(hf_model)
    tokens = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt_len = 11
    paged = PagedSequences(ours.config)
    seq = paged.add()
    expected = _hf_logits(hf_model, tokens)  # causal: row i depends on tokens[:i+1] only
    _close(paged.step(ours, {seq: tokens[:prompt_len]}), expected[:prompt_len])
    for i in range(prompt_len, len(tokens)):
        _close(paged.step(ours, {seq: [tokens[i]]}), expected[i : i + 1])


def test_batched_sequences_and_chunked_prefill_match_hf():
    hf_model = HF_MODELS["llama_tied"]()
    ours = _ours(hf_model)
    gen = torch.Generator().manual_seed(9)
    a = torch.randint(3, VOCAB, (30,), generator=gen).tolist()
    b = torch.randint(3, VOCAB, (13,), generator=gen).tolist()
    exp_a, exp_b = _hf_logits(hf_model, a), _hf_logits(hf_model, b)
    paged = PagedSequences(ours.config, seed=3)
    sa, sb = paged.add(), paged.add()
    out = paged.step(ours, {sa: a[:9], sb: b[:4]})  # two prompts of different lengths
    _close(out[:9], exp_a[:9])
    _close(out[9:], exp_b[:4])
    out = paged.step(ours, {sa: a[9:20], sb: b[4:5]})  # second chunk + a decode token
    _close(out[:11], exp_a[9:20])
    _close(out[11:], exp_b[4:5])
    for i in range(20, 28):  # decode-only batch
        j = i - 15
        out = paged.step(ours, {sa: [a[i]], sb: [b[j]]})
        _close(out[0:1], exp_a[i : i + 1])
        _close(out[1:2], exp_b[j : j + 1])


def test_logits_indices_select_rows():
    hf_model = HF_MODELS["llama_tied"]()
    ours = _ours(hf_model)
    tokens = list(range(3, 15))
    full = PagedSequences(ours.config)
    expected = full.step(ours, {full.add(): tokens})
    paged = PagedSequences(ours.config)
    picked = paged.step(ours, {paged.add(): tokens}, logits_indices=torch.tensor([11, 4]))
    assert picked.shape == (2, VOCAB) and picked.dtype == torch.float32
    _close(picked, expected[[11, 4]])


def test_bfloat16_runs_close_to_fp32():
    hf_model = HF_MODELS["llama_tied"]()
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = llama.LlamaForCausalLM(config, TorchAttentionBackend()).to(torch.bfloat16)
    model.load_weights(hf_model.state_dict().items())
    tokens = list(range(3, 20))
    paged = PagedSequences(config)
    paged.cache = KVCache(
        num_layers=config.num_layers,
        num_blocks=64,
        block_size=BLOCK_SIZE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.bfloat16,
        device="cpu",
    )
    seq = paged.add()
    out = paged.step(model, {seq: tokens})
    assert out.dtype == torch.float32
    assert (out - _hf_logits(hf_model, tokens)).abs().max().item() < 0.1


def _save(hf_model, directory, **kwargs):
    hf_model.save_pretrained(directory, safe_serialization=True, **kwargs)
    hf_model.generation_config.save_pretrained(directory)


def _loaded_logits(directory, tokens):
    loaded = load_model(
        str(directory),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attn_backend=TorchAttentionBackend(),
    )
    paged = PagedSequences(loaded.config)
    return loaded, paged.step(loaded.model, {paged.add(): tokens})


@pytest.mark.parametrize("name", ["llama_untied", "qwen2"])
def test_hf_directory_round_trip(tmp_path, name):
    hf_model = HF_MODELS[name]()
    _save(hf_model, tmp_path)
    tokens = list(range(5, 30))
    loaded, out = _loaded_logits(tmp_path, tokens)
    _close(out, _hf_logits(hf_model, tokens))
    assert loaded.path == tmp_path
    assert loaded.hf_config["model_type"] == hf_model.config.model_type
    assert loaded.generation_config.get("eos_token_id") == 2
    assert loaded.config.eos_token_ids == (2,)


def test_sharded_hf_directory_round_trip(tmp_path):
    hf_model = HF_MODELS["llama_tied"]()
    _save(hf_model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    tokens = list(range(7, 19))
    _, out = _loaded_logits(tmp_path, tokens)
    _close(out, _hf_logits(hf_model, tokens))


def test_unsupported_architecture(tmp_path):
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        resolve_architecture({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    hf_model = HF_MODELS["llama_tied"]()
    _save(hf_model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        _loaded_logits(tmp_path, [3])


def test_missing_weights_file_is_reported(tmp_path):
    hf_model = HF_MODELS["llama_tied"]()
    _save(hf_model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        _loaded_logits(tmp_path, [3])


def test_incomplete_checkpoint_is_reported():
    hf_model = HF_MODELS["llama_tied"]()
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = llama.LlamaForCausalLM(config, TorchAttentionBackend())
    partial = [(k, v) for k, v in hf_model.state_dict().items() if "k_proj" not in k]
    with pytest.raises(ModelLoadError, match="qkv_proj"):
        model.load_weights(partial)


def test_registry_resolves_family():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert resolve_architecture({"architectures": [arch]}) is llama.LlamaForCausalLM
    assert resolve_architecture({"model_type": "mistral"}) is llama.LlamaForCausalLM


def test_uninitialised_cache_slots_do_not_leak():
    """CPU KV pools start uninitialised; NaN in every unwritten slot must not reach the logits."""
    hf_model = HF_MODELS["llama_tied"]()
    ours = _ours(hf_model)
    tokens = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(8)).tolist()
    paged = PagedSequences(ours.config)
    for k_cache, v_cache in paged.cache.layers:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    seq = paged.add()
    expected = _hf_logits(hf_model, tokens)
    _close(paged.step(ours, {seq: tokens[:6]}), expected[:6])  # ends mid-block (BLOCK_SIZE 4)
    for i in range(6, len(tokens)):
        _close(paged.step(ours, {seq: [tokens[i]]}), expected[i : i + 1])


def test_reloading_weights_refreshes_packed_matmuls():
    """Matmul weights are packed for the CPU on first use; loading new weights must repack."""
    first, second = HF_MODELS["llama_tied"](), HF_MODELS["llama_tied"]()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in second.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    model = _ours(first)
    tokens = list(range(4, 17))
    paged = PagedSequences(model.config)
    _close(paged.step(model, {paged.add(): tokens}), _hf_logits(first, tokens))
    model.load_weights(second.state_dict().items())
    paged = PagedSequences(model.config)
    _close(paged.step(model, {paged.add(): tokens}), _hf_logits(second, tokens))


WINDOW = 16


def _hf_mistral_windowed():
    """Mistral with a 16-token window; eager attention applies it in HF's mask."""
    torch.manual_seed(2)
    config = MistralConfig(
        **{**COMMON, "tie_word_embeddings": False, "sliding_window": WINDOW},
        attn_implementation="eager",
    )
    return MistralForCausalLM(config).eval()


def test_sliding_window_model_matches_hf_up_to_the_window_and_not_past_it():
    """Full causal attention equals Mistral's windowed attention for sequences of
    at most ``WINDOW`` tokens, which is why the engine caps max_model_len there;
    one token more and the outputs part, so the cap is the exact bound."""
    hf_model = _hf_mistral_windowed()
    ours = _ours(hf_model)
    assert ours.config.sliding_window == WINDOW
    tokens = torch.randint(3, VOCAB, (WINDOW + 1,), generator=torch.Generator().manual_seed(6)).tolist()
    expected = _hf_logits(hf_model, tokens)
    paged = PagedSequences(ours.config)
    seq = paged.add()
    prompt_len = 6
    _close(paged.step(ours, {seq: tokens[:prompt_len]}), expected[:prompt_len])
    for i in range(prompt_len, WINDOW):
        _close(paged.step(ours, {seq: [tokens[i]]}), expected[i : i + 1])
    past_window = paged.step(ours, {seq: [tokens[WINDOW]]})
    assert (past_window - expected[WINDOW:]).abs().max().item() > 10 * ATOL
