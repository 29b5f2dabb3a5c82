"""Rope scaling overrides (linear, dynamic, yarn, llama3) against HF transformers on a
tiny random Llama, and the context-length checks they unlock."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch
from test_model_vs_hf import PagedSequences
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.cli import build_parser, engine_config_from_args, parse_json_object
from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.models import llama, rope_scaling
from pagedllm.models.config import ModelConfig
from pagedllm.native import cpu_ops

TRAINED_LEN = 32
VOCAB = 256
ATOL = 1e-4
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TRAINED_LEN,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    rope_theta=10000.0,
)

# Each form users write; every one extends the 32 trained positions to 64 (factor 2).
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "linear_type_key": {"type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAINED_LEN},
    "yarn_mscale": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAINED_LEN,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
    },
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "truncate": False},
    "llama3": {
        "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": TRAINED_LEN,
    },
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _hf_model(scaling: dict | None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**BASE, rope_scaling=dict(scaling) if scaling else None)
    return LlamaForCausalLM(config).eval()


def _ours_with_override(hf_model: LlamaForCausalLM, scaling: dict) -> llama.LlamaForCausalLM:
    """pagedllm's model from the unscaled config plus the scaling as a user override."""
    config = ModelConfig.from_hf_config({**BASE, "model_type": "llama"}, rope_scaling=scaling)
    model = llama.LlamaForCausalLM(config, TorchAttentionBackend())
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaled_logits_match_hf_past_the_trained_length(name, native):
    """64 tokens (twice the trained length): prefill 40, then decode one at a time.

    For dynamic NTK, HF computes the base from the length of the sequence it is
    given (64 here, all in one forward pass); pagedllm fixes it at the scaled
    context, factor x trained = 64, so the two agree at this length.
    """
    scaling = SCALINGS[name]
    hf_model = _hf_model(scaling)
    ours = _ours_with_override(hf_model, scaling)
    assert ours.config.max_context_len == 2 * TRAINED_LEN
    tokens = torch.randint(3, VOCAB, (2 * TRAINED_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]  # [64, vocab]
    with contextlib.nullcontext() if native else cpu_ops.disabled():
        paged = PagedSequences(ours.config)
        seq = paged.add()
        got = [paged.step(ours, {seq: tokens[:40]})]
        got += [paged.step(ours, {seq: [t]}) for t in tokens[40:]]
    diff = (torch.cat(got) - expected).abs().max().item()
    assert diff <= ATOL, f"{name}: max |logit difference| {diff}"


def test_scalings_change_the_logits():
    """The comparison above would pass vacuously if a scaling were ignored."""
    tokens = list(range(3, 3 + 2 * TRAINED_LEN))
    plain = _hf_model(None)
    with torch.no_grad():
        unscaled = plain(torch.tensor([tokens])).logits[0]
    for name, scaling in SCALINGS.items():
        ours = _ours_with_override(plain, scaling)
        paged = PagedSequences(ours.config)
        scaled = paged.step(ours, {paged.add(): tokens})
        assert (scaled - unscaled).abs().max().item() > 10 * ATOL, name  # 10x the match tolerance


def test_dynamic_base_is_hf_formula_at_the_scaled_context():
    head_dim, theta, factor = 16, 10000.0, 4.0
    got = rope_scaling.inverse_frequencies(head_dim, theta, {"rope_type": "dynamic", "factor": factor}, 100)
    seq_len = factor * 100
    base = theta * ((factor * seq_len / 100) - (factor - 1)) ** (head_dim / (head_dim - 2))
    expected = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(got, expected)


def test_yarn_attention_factor_defaults():
    assert rope_scaling.attention_factor(None) == 1.0
    assert rope_scaling.attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0
    assert rope_scaling.attention_factor({"rope_type": "yarn", "factor": 4.0}) == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1
    )
    assert rope_scaling.attention_factor({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5}) == 0.5


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, "not supported"),
        ({"factor": 2.0}, "needs a 'rope_type'"),
        ({"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1"),
        ({"rope_type": "linear"}, "factor must be a number >= 1"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "does not take"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}, "positive integer"),
        ("yarn", "must be a dict"),
    ],
)
def test_bad_override_is_a_config_error(scaling, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(BASE, rope_scaling=scaling)


def test_checkpoint_scaling_errors_are_load_errors():
    with pytest.raises(ModelLoadError, match="the checkpoint's rope_scaling factor"):
        ModelConfig.from_hf_config({**BASE, "rope_scaling": {"rope_type": "yarn"}})


def test_override_replaces_the_checkpoints_scaling():
    llama31 = {**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert ModelConfig.from_hf_config(llama31).rope_scaling["rope_type"] == "llama3"
    replaced = ModelConfig.from_hf_config(llama31, rope_scaling={"type": "linear", "factor": 3})
    assert replaced.rope_scaling == {"rope_type": "linear", "factor": 3.0}
    assert replaced.max_context_len == 3 * TRAINED_LEN
    assert ModelConfig.from_hf_config(llama31, rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_checkpoint_with_its_scaled_length_keeps_it():
    """A Llama 3.1 config states its scaled length in max_position_embeddings already."""
    cfg = {**BASE, "max_position_embeddings": 1024, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_hf_config(cfg).max_context_len == 1024


# ---- the engine: max_model_len past the trained context ---------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-rope")
    hf_model = _hf_model(None)
    hf_model.save_pretrained(directory, safe_serialization=True)
    words = RustTokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(directory)
    return directory


def _llm(directory, **options) -> LLM:
    return LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_kv_blocks=32, **options)


def test_max_model_len_past_the_trained_length_needs_a_scaling(tiny_dir):
    with pytest.raises(ConfigError) as info:
        _llm(tiny_dir, max_model_len=2 * TRAINED_LEN)
    assert "max_model_len=64" in str(info.value) and "trained context of 32 tokens" in str(info.value)
    assert "rope_scaling" in str(info.value)
    assert _llm(tiny_dir).llm_engine.max_model_len == TRAINED_LEN


def test_max_model_len_past_the_scaled_length_is_refused(tiny_dir):
    with pytest.raises(ConfigError, match="exceeds the 64 tokens that rope_scaling linear with factor 2"):
        _llm(tiny_dir, rope_scaling={"type": "linear", "factor": 2.0}, max_model_len=65)


def test_engine_with_yarn_generates_hf_greedy_tokens_past_the_trained_length(tiny_dir):
    scaling = SCALINGS["yarn"]
    llm = _llm(tiny_dir, rope_scaling=scaling, max_model_len=2 * TRAINED_LEN)
    assert llm.llm_engine.max_model_len == 2 * TRAINED_LEN
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    hf_model, tokens = _hf_model(scaling), list(prompt)
    with torch.no_grad():
        for _ in range(12):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert list(out.token_ids) == tokens[len(prompt):]


def test_cli_flag_parses_json_into_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "hi", "--rope-scaling", '{"rope_type": "dynamic", "factor": 2}', "--max-model-len", "64"]
    )
    config = engine_config_from_args(args)
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 2}
    assert config.max_model_len == 64
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_json_object(bad)
