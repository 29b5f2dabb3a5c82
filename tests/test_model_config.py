"""ModelConfig's sliding window and rope frequency factors, and the engine's
max_model_len on a sliding-window model (a tiny random Mistral, HF as the oracle)."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoConfig, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError, ModelLoadError, RequestError
from pagedllm.models.config import ModelConfig

# Published config.json files, shape keys shrunk; the window keys as shipped.
MISTRAL_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "vocab_size": 256,
}
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 28,
    "vocab_size": 256,
}
LLAMA = {**MISTRAL_V01, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
del LLAMA["sliding_window"]

WINDOW_CASES = {
    "mistral_v0.1": (MISTRAL_V01, 4096),
    "mistral_null": ({**MISTRAL_V01, "sliding_window": None}, None),
    # HF's MistralConfig fills in a 4096-token window when the key is missing
    "mistral_absent": ({k: v for k, v in MISTRAL_V01.items() if k != "sliding_window"}, 4096),
    "llama": (LLAMA, None),
    "qwen2_disabled": (QWEN25, None),
    "qwen2_flag_absent": ({k: v for k, v in QWEN25.items() if k != "use_sliding_window"}, None),
    # from layer max_window_layers on: layers 2 and 3 of 4 are windowed
    "qwen2_upper_layers": ({**QWEN25, "use_sliding_window": True, "max_window_layers": 2}, 131072),
    # max_window_layers past the last layer: no layer is windowed
    "qwen2_no_layer": ({**QWEN25, "use_sliding_window": True}, None),
    "qwen2_layer_types": (
        {**QWEN25, "use_sliding_window": True, "max_window_layers": 4,
         "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
        131072,
    ),
}


def _hf_window(cfg: dict) -> int | None:
    """The window HF transformers applies to at least one layer of this config."""
    hf = AutoConfig.for_model(**cfg)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(hf, "sliding_window", None)


@pytest.mark.parametrize("name", sorted(WINDOW_CASES))
def test_sliding_window_is_read_as_hf_applies_it(name):
    cfg, expected = WINDOW_CASES[name]
    assert ModelConfig.from_hf_config(cfg).sliding_window == expected
    assert _hf_window(cfg) == expected


def test_bad_sliding_window_is_refused():
    with pytest.raises(ModelLoadError, match="sliding_window=-4"):
        ModelConfig.from_hf_config({**MISTRAL_V01, "sliding_window": -4})


def test_rope_frequency_factors_are_validated():
    # head_dim 16: one factor per rotary pair, so 8
    config = ModelConfig.from_hf_config({**LLAMA, "rope_frequency_factors": [1.0] * 4 + [8.0] * 4})
    assert config.rope_frequency_factors == (1.0,) * 4 + (8.0,) * 4
    with pytest.raises(ModelLoadError, match="has 7 values but head_dim=16 needs 8"):
        ModelConfig.from_hf_config({**LLAMA, "rope_frequency_factors": [1.0] * 7})
    with pytest.raises(ModelLoadError, match="positive"):
        ModelConfig.from_hf_config({**LLAMA, "rope_frequency_factors": [1.0] * 7 + [0.0]})


# ---- the engine on a sliding-window model ----------------------------------

WINDOW = 16
VOCAB = 256
PROMPT = [5, 17, 99, 3, 250, 42]


@pytest.fixture(scope="module")
def mistral():
    """A tiny random Mistral with a 16-token window (HF, eager attention, so that
    the window is applied) and its directory with a word-level tokenizer."""
    torch.manual_seed(3)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mistral_dir(mistral, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-mistral")
    mistral.save_pretrained(directory, safe_serialization=True)
    words = RustTokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    tokenizer.save_pretrained(directory)
    return directory


def _llm(directory, **options) -> LLM:
    # 64 blocks x 8 slots: the KV cache and max_position_embeddings (128) both exceed the window
    return LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64, **options)


def _hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy argmax continuation, one full forward pass per token (no EOS handling)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_default_max_model_len_is_capped_at_the_window_and_says_why(mistral_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = _llm(mistral_dir)
    assert llm.llm_engine.max_model_len == WINDOW
    why = [r for r in caplog.records if "sliding attention window" in r.getMessage()]
    assert len(why) == 1 and why[0].levelno == logging.INFO


def test_greedy_tokens_match_hf_up_to_the_window(mistral, mistral_dir):
    llm = _llm(mistral_dir)
    num_new = WINDOW - len(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == _hf_greedy(mistral, PROMPT, num_new)
    too_long = SamplingParams(temperature=0.0, max_tokens=num_new + 1, ignore_eos=True)
    with pytest.raises(RequestError, match="exceeds the context of 16 tokens"):
        llm.generate({"prompt_token_ids": PROMPT}, too_long, use_tqdm=False)


def test_explicit_max_model_len_within_the_window_is_kept(mistral_dir):
    assert _llm(mistral_dir, max_model_len=WINDOW).llm_engine.max_model_len == WINDOW
    assert _llm(mistral_dir, max_model_len=12).llm_engine.max_model_len == 12


def test_explicit_max_model_len_past_the_window_is_a_config_error(mistral_dir):
    with pytest.raises(ConfigError, match="sliding-window attention is not implemented") as info:
        _llm(mistral_dir, max_model_len=WINDOW + 1)
    assert "max_model_len <= 16" in str(info.value)
