"""The default model served from its packed GGUF weights gives the same greedy tokens in every
scheduling condition as each prompt alone.

The quantized matmuls quantize their activations to int8 per 32 values, so a
difference of one float rounding between two schedules could move a code by
a step and, at a near tie, change a token. Every kernel path computes a row
the same way whatever the rows around it (tests/test_quant_kernels.py), so
batching, chunked prefill, recompute after preemption, swapping, prefix-cache
hits and overlapped decode steps must all give the tokens of the prompt run
alone. The oracle is the same engine, one prompt at a time.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.native import quant_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the quantized kernels"),
]

PROMPTS = [
    "The capital of France is",
    "Here is a short list of fruits:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans to walk on the Moon were",
]
SHARED = "You are a careful assistant. Answer in one short sentence and do not repeat the question. Question: "
PREFIXED = [SHARED + q for q in ("What is the boiling point of water?", "Who wrote Hamlet?", "What colour is the sky?")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(**options) -> LLM:
    options.setdefault("kv_cache_memory", 192 * 2**20)
    return LLM(quantization="gguf", dtype="float32", **options)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_alone(**options) -> dict[str, list[int]]:
    llm = make_llm(enable_prefix_caching=False, **options)
    return {p: tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS + PREFIXED}


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    return run_alone()


@pytest.fixture(scope="module")
def alone_small_blocks() -> dict[str, list[int]]:
    # the block size is the KV layout, not a schedule: attention reads keys a block at a
    # time, so the oracle of a run with 8-slot blocks has 8-slot blocks too
    return run_alone(block_size=8)


def want(alone, prompts) -> list[list[int]]:
    return [alone[p] for p in prompts]


def assert_clean(llm: LLM) -> None:
    assert llm.kv_cache_stats().num_used_blocks == 0
    llm.llm_engine.block_manager.check_invariants()


def test_one_batch(alone):
    llm = make_llm()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want(alone, PROMPTS)
    assert_clean(llm)


def test_chunked_prefill(alone):
    llm = make_llm(max_num_batched_tokens=8)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want(alone, PROMPTS)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(alone_small_blocks, mode):
    # enough blocks for any one prompt, far too few for all of them to decode together
    llm = make_llm(num_kv_blocks=10, block_size=8, preemption_mode=mode,
                   swap_space_bytes=64 * 2**20 if mode == "swap" else 0)
    prompts = PROMPTS + PREFIXED
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want(alone_small_blocks, prompts)
    assert llm.kv_cache_stats().num_preemptions > 0
    assert_clean(llm)


def test_prefix_cache_hits(alone):
    llm = make_llm(enable_prefix_caching=True)
    first = llm.generate(PREFIXED[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(PREFIXED[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in rest)
    assert tokens(first + rest) == want(alone, PREFIXED)
    assert_clean(llm)


def test_overlapped_decode_steps(alone):
    llm = make_llm(async_scheduling=True)
    before = llm.llm_engine.num_overlapped_steps
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want(alone, PROMPTS)
    assert llm.llm_engine.num_overlapped_steps - before > 10
    assert_clean(llm)
