"""The native layer stack (pagedllm.quant.stack) against the model's own modules.

It calls the same kernels in the same order, so the outputs must be equal bit
for bit: token ids and logprobs of greedy and sampled requests, prefill chunks
mixed with decode steps, forks (n > 1), float32 and 8-bit KV caches, and
q/k/v/o biases. Where a step is one the stack does not take, the modules run.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.native import cpu_ops, quant_ops
from pagedllm.quant.stack import ENV

VOCAB = 512

needs_kernels = pytest.mark.skipif(
    not (cpu_ops.available() and quant_ops.available()), reason="native kernels do not build here"
)


def _tiny_dir(directory, **overrides):
    return save_tiny_llama(directory, random_biases=True, vocab_size=VOCAB, hidden_size=256, intermediate_size=320,
                           num_hidden_layers=3, **overrides)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_dir(tmp_path_factory.mktemp("tiny-stack"))


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory):
    return _tiny_dir(tmp_path_factory.mktemp("tiny-stack-bias"), attention_bias=True)


def _llm(directory, monkeypatch, stack: bool, **options) -> LLM:
    monkeypatch.setenv(ENV, "1" if stack else "0")
    options.setdefault("quantization", "int4")
    options.setdefault("quantization_group_size", 64)
    options.setdefault("dtype", "float32")
    llm = LLM(str(directory), device="cpu", block_size=8, max_num_batched_tokens=64, **options)
    assert (llm.llm_engine.worker.model.layer_stack is not None) is stack
    return llm


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (5 + 23 * i,), generator=gen).tolist()} for i in range(5)]


def _results(llm: LLM, params: SamplingParams) -> list[tuple]:
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    return [
        (o.request_id, tuple(c.token_ids), tuple(tuple(sorted(p.items())) for p in c.logprobs or []))
        for out in outputs for o in [out] for c in out.outputs
    ]


def _counting_calls(llm: LLM) -> list[int]:
    """Counts the stack's runs (index 0) on the model of ``llm``."""
    stack = llm.llm_engine.worker.model.layer_stack
    count = [0]
    run = stack.run

    def counted(*args, **kwargs):
        delta = run(*args, **kwargs)
        count[0] += delta is not None
        return delta

    stack.run = counted
    return count


@needs_kernels
@pytest.mark.parametrize("options", [
    {},
    {"kv_cache_dtype": "int8"},
    {"quantization": "int8", "quantization_group_size": 32},
], ids=["int4-f32kv", "int4-int8kv", "int8-weights"])
def test_stack_equals_the_modules_bit_for_bit(tiny_dir, monkeypatch, options):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
    stacked = _llm(tiny_dir, monkeypatch, True, **options)
    runs = _counting_calls(stacked)
    got = [_results(stacked, p) for p in (greedy, sampled)]
    assert runs[0] > 20  # prefill chunks (64 tokens a step) and decode steps all took the stack
    modules = _llm(tiny_dir, monkeypatch, False, **options)
    want = [_results(modules, p) for p in (greedy, sampled)]
    assert got == want


@needs_kernels
def test_stack_applies_biases(biased_dir, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    stacked = _llm(biased_dir, monkeypatch, True)
    layer = stacked.llm_engine.worker.model.layers[0]
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.qkv_proj.bias.abs().sum() > 0
    got = _results(stacked, params)
    assert got == _results(_llm(biased_dir, monkeypatch, False), params)


needs_dense_bf16 = pytest.mark.skipif(
    not (cpu_ops.available() and quant_ops.available() and quant_ops.dense_bf16_available()),
    reason="no AMX-BF16 or AVX512-BF16 on this CPU: dense bfloat16 matmuls are oneDNN's",
)


@needs_dense_bf16
@pytest.mark.parametrize("biased,kv_cache_dtype", [
    (False, "auto"), (True, "auto"), (False, "int8"), (True, "int8"), (False, "fp8_e4m3"), (False, "fp8_e5m2"),
])
def test_bfloat16_stack_equals_the_modules_bit_for_bit(tiny_dir, biased_dir, monkeypatch, biased, kv_cache_dtype):
    # dense bfloat16 weights on the AMX-BF16 tiles or VDPBF16PS: the stack calls the modules' very kernels, over
    # bfloat16 caches and 8-bit ones (int8's rotation in float32, as the modules do it)
    directory = biased_dir if biased else tiny_dir
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
    results = []
    want_cache = {"auto": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                  "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    for stack in (True, False):
        llm = _llm(directory, monkeypatch, stack, dtype="bfloat16", quantization="none",
                   kv_cache_dtype=kv_cache_dtype)
        if stack:
            runs = _counting_calls(llm)
        results.append([_results(llm, p) for p in (greedy, sampled)])
        assert llm.llm_engine.worker.kv_cache.layers[0][0].dtype == want_cache
    assert runs[0] > 20
    assert results[0] == results[1]


needs_packed_bf16_stack = pytest.mark.skipif(
    not (cpu_ops.available() and quant_ops.available()) or quant_ops.amx_bf16_available(),
    reason="with AMX-BF16 packed bfloat16 matmuls of 64 rows take the tiles, and the stack declines them",
)


@needs_packed_bf16_stack
@pytest.mark.parametrize("biased,kv_cache_dtype,quantization", [
    (False, "auto", "int4"), (True, "auto", "int4"), (False, "int8", "int4"), (False, "auto", "int8"),
])
def test_bfloat16_over_packed_weights_stack_equals_the_modules_bit_for_bit(tiny_dir, biased_dir, monkeypatch,
                                                                          biased, kv_cache_dtype, quantization):
    # packed codes under bfloat16 activations (an AVX2 CPU's bfloat16 GGUF): each matmul widens its
    # input to float32 and rounds its output to bfloat16 before the bias, in the stack as in the modules
    directory = biased_dir if biased else tiny_dir
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
    group = 64 if quantization == "int4" else 32
    results = []
    for stack in (True, False):
        llm = _llm(directory, monkeypatch, stack, dtype="bfloat16", quantization=quantization,
                   quantization_group_size=group, kv_cache_dtype=kv_cache_dtype)
        if stack:
            runs = _counting_calls(llm)
        results.append([_results(llm, p) for p in (greedy, sampled)])
    assert runs[0] > 20  # prefill chunks and decode steps took the stack
    assert results[0] == results[1]


@needs_kernels
def test_prefault_reserves_the_largest_steps_activations(tiny_dir, monkeypatch):
    # kv_cache_prefault makes the stack's activations for the step budget (64 tokens here)
    # resident at start-up, so no step maps fresh pages; the outputs are the same bits
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    lazy = _llm(tiny_dir, monkeypatch, True)
    assert lazy.llm_engine.worker.model.layer_stack._scratch.numel() == 0  # grown by the first step
    llm = _llm(tiny_dir, monkeypatch, True, kv_cache_prefault=True)
    stack = llm.llm_engine.worker.model.layer_stack
    needed = stack._scratch_floats(ctypes.addressof(stack._stack), 64)
    assert needed > stack._scratch_floats(ctypes.addressof(stack._stack), 63)
    assert stack._scratch.numel() >= needed
    address = stack._scratch.data_ptr()
    assert _results(llm, params) == _results(lazy, params)
    assert stack._scratch.data_ptr() == address  # no step needed a larger one


@needs_kernels
def test_stack_is_not_built_where_a_layer_is_not_native(tiny_dir, monkeypatch):
    # dense weights: the matmuls are oneDNN's, not quant_ops'
    assert _llm(tiny_dir, monkeypatch, False).llm_engine.worker.model.layer_stack is None
    monkeypatch.setenv(ENV, "1")
    dense = LLM(str(tiny_dir), device="cpu", dtype="float32", block_size=8)
    assert dense.llm_engine.worker.model.layer_stack is None
    # packed weights under bfloat16: the stack where the modules widen every matmul to float32
    # (no AMX-BF16); with AMX-BF16 they take that kernel from 64 rows on, which the stack does not
    bf16 = LLM(str(tiny_dir), device="cpu", dtype="bfloat16", block_size=8, quantization="int4",
               quantization_group_size=64)
    assert (bf16.llm_engine.worker.model.layer_stack is None) is quant_ops.amx_bf16_available()


@needs_kernels
def test_stack_refuses_positions_past_the_rotary_table(tiny_dir, monkeypatch):
    llm = _llm(tiny_dir, monkeypatch, True)
    model = llm.llm_engine.worker.model
    stack = model.layer_stack
    table = model.rotary.tables(torch.device("cpu"))[0]
    residual = torch.zeros(1, 256)
    kv = llm.llm_engine.worker.kv_cache.layers
    from pagedllm.attention.base import AttentionMetadata

    md = AttentionMetadata(
        slot_mapping=torch.tensor([0]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        max_query_len=1, max_seq_len=1, seq_lens_host=[1], query_lens_host=[1],
    )
    with pytest.raises(ValueError, match="past the model's"):
        stack.run(residual, torch.tensor([table.shape[0]]), kv, md)
