"""A GGUF model on the CPU is served packed unless asked otherwise, and as accurately as dense.

``quantization=None`` (the default) resolves per checkpoint and device
(:func:`pagedllm.models.loader.default_quantization`): a GGUF file on the CPU in
float32 keeps its Q4_0 / Q4_1 / Q8_0 tensors packed, as llama.cpp serves them;
anything else loads dense. The packed path's default int16 activations (two
int8 levels per 32-block) must give the dequantized weights' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import default_quantization
from pagedllm.models.paths import default_model_path
from pagedllm.native import quant_ops
from pagedllm.quant.layers import quantized_weights

needs_kernels = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels")

# prompts of varied kinds (prose, code, lists, chat-like); 24 greedy tokens each
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short list of fruits:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "import numpy as np\n\n# compute the mean of",
]


@needs_kernels
def test_a_gguf_on_the_cpu_in_float32_defaults_to_packed_weights(tmp_path, monkeypatch):
    gguf_file = default_model_path()
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert default_quantization(gguf_file, "cpu", "auto") == "gguf"
    assert default_quantization(gguf_file, "cpu", "float32") == "gguf"
    # a 16-bit dtype asks for dense weights of that dtype where the CPU computes it natively;
    # an HF directory has nothing packed
    from pagedllm.native import cpu_dtype

    native = cpu_dtype.native_matmul(torch.bfloat16)
    assert default_quantization(gguf_file, "cpu", "bfloat16") == ("none" if native else "gguf")
    # where it would be emulated (about 20x slower), the packed weights serve it instead
    monkeypatch.setattr(cpu_dtype, "native_matmul", lambda dtype: dtype == torch.float32)
    assert default_quantization(gguf_file, "cpu", "bfloat16") == "gguf"
    assert default_quantization(gguf_file, "cpu", "float16") == "gguf"
    assert default_quantization(hf_dir, "cpu", "bfloat16") == "none"
    monkeypatch.setattr(cpu_dtype, "native_matmul", lambda dtype: True)
    assert default_quantization(gguf_file, "cpu", "bfloat16") == "none"
    monkeypatch.undo()
    assert default_quantization(hf_dir, "cpu", "auto") == "none"
    assert default_quantization(gguf_file, "cuda", "auto") == "none"
    # without the native kernels a packed matmul would dequantize at every call: dense instead
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    assert default_quantization(gguf_file, "cpu", "auto") == "none"


def _greedy(llm: LLM) -> list[tuple[list[int], float]]:
    """Each prompt's 24 greedy tokens and their cumulative logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob)
            for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def dense_run() -> list[tuple[list[int], float]]:
    llm = LLM(quantization="none", num_kv_blocks=128)
    assert llm.llm_engine.config.quantization == "none"
    assert not quantized_weights(llm.llm_engine.worker.model)
    return _greedy(llm)


@pytest.fixture(scope="module")
def default_run() -> list[tuple[list[int], float]]:
    llm = LLM(num_kv_blocks=128)  # no quantization given
    engine = llm.llm_engine
    assert engine.config.quantization == "gguf"
    packed = quantized_weights(engine.worker.model)
    # every linear layer of the 30 decoder layers (4 matrices each) and the tied embedding / head
    assert len(packed) == 4 * 30 + 1
    assert {w.activation_levels for w in packed} == {2}
    assert {w.format_name for w in packed} <= {"Q4_0", "Q4_1", "Q8_0"}
    return _greedy(llm)


@pytest.mark.slow
@needs_kernels
def test_the_default_engine_serves_the_gguf_packed_with_the_dense_greedy_tokens(dense_run, default_run):
    assert [tokens for tokens, _ in default_run] == [tokens for tokens, _ in dense_run]
    # int16 activations: the logprobs are the dense ones to within a few thousandths per token
    for (_, got), (_, want) in zip(default_run, dense_run, strict=True):
        assert abs(got - want) < 24 * 0.005, (got, want)


@pytest.mark.slow
@needs_kernels
def test_int8_activations_are_threaded_to_every_packed_matrix(default_run):
    llm = LLM(quant_activations="int8", num_kv_blocks=128)
    packed = quantized_weights(llm.llm_engine.worker.model)
    assert packed and {w.activation_levels for w in packed} == {1}
    got = _greedy(llm)
    assert len(got) == len(default_run) and all(len(tokens) == 24 for tokens, _ in got)
    # the coarser activations reach the kernels: other logprobs than int16's
    assert any(abs(a - b) > 1e-3 for (_, a), (_, b) in zip(got, default_run, strict=True))


@needs_kernels
def test_bfloat16_where_the_cpu_would_emulate_it_serves_the_gguf_packed(monkeypatch, caplog):
    """dtype="bfloat16" on a CPU without native bf16 matmuls (the probe replaced, as on an AVX2
    machine): the GGUF loads packed, with no 20x-slowdown warning, and serves the tokens an
    engine asked for packed bf16 explicitly serves; forced dense, the warning is back."""
    import logging
    import warnings

    from pagedllm.native import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "native_matmul", lambda dtype: dtype == torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="pagedllm"):
        warnings.simplefilter("error", RuntimeWarning)
        llm = LLM(dtype="bfloat16", num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.config.quantization == "gguf" and engine.worker.dtype == torch.bfloat16
    assert len(quantized_weights(engine.worker.model)) == 4 * 30 + 1
    assert "packed weights' matmuls run on the native integer kernels" in caplog.text
    got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    del llm, engine
    explicit = LLM(dtype="bfloat16", quantization="gguf", num_kv_blocks=64)
    assert got == [list(o.outputs[0].token_ids) for o in explicit.generate(PROMPTS[:3], params, use_tqdm=False)]
    del explicit
    with pytest.warns(RuntimeWarning, match="no native bfloat16 matmul.*packed weights"):
        LLM(dtype="bfloat16", quantization="none", num_kv_blocks=64)


def test_an_unknown_activation_mode_is_a_config_error():
    from pagedllm.config import EngineConfig
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match="quant_activations"):
        EngineConfig(quant_activations="int4")
    with pytest.raises(ConfigError, match="quant_activations"):
        from pagedllm.attention.torch_backend import TorchAttentionBackend
        from pagedllm.models.loader import load_model

        load_model(None, dtype=torch.float32, device=torch.device("cpu"), attn_backend=TorchAttentionBackend(),
                   quantization="gguf", quant_activations="fp8")
