"""The engine with an 8-bit KV cache, on a tiny random Llama (head_dim 64).

Preemption must not change greedy output (swap moves the codes and scales
bit for bit; recompute quantizes the recomputed K/V again), the block manager's
invariants hold afterwards, and the same kv_cache_memory holds ~1.9x the
blocks of bfloat16 and ~3.9x those of float32.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_llama

from pagedllm import LLM, SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-kv8"), vocab_size=VOCAB, hidden_size=256,
                           intermediate_size=256)


def _llm(directory, **options) -> LLM:
    options.setdefault("dtype", "float32")
    return LLM(str(directory), device="cpu", block_size=8, **options)


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (12 + 9 * i,), generator=gen).tolist()} for i in range(6)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats.num_used_blocks == 0, stats
    llm.llm_engine.block_manager.check_invariants()


# Recompute re-quantizes K/V computed by a prefill instead of by decode steps; in
# bfloat16 that arithmetic differs enough to tip near ties, so bf16 runs swap only.
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,mode",
    [("float32", "int8", "swap"), ("float32", "int8", "recompute"), ("bfloat16", "fp8_e4m3", "swap"),
     ("bfloat16", "fp8_e5m2", "swap")],
)
def test_greedy_with_8bit_kv_survives_preemption(tiny_dir, dtype, kv_cache_dtype, mode):
    roomy = _llm(tiny_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256)
    assert roomy.llm_engine.worker.kv_cache.quantized  # codes and scales, not float tensors
    expected = [o.outputs[0].token_ids for o in roomy.generate(_prompts(), GREEDY, use_tqdm=False)]
    _assert_all_free(roomy)
    extra = {"swap_space_bytes": 8 * 2**20} if mode == "swap" else {}
    tight = _llm(tiny_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=24, preemption_mode=mode,
                 **extra)
    outs = tight.generate(_prompts(), GREEDY, use_tqdm=False)
    assert tight.kv_cache_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_all_free(tight)


def test_same_kv_cache_memory_holds_about_twice_the_blocks(tiny_dir):
    memory = 4 * 2**20
    blocks = {
        (dtype, kv): _llm(tiny_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory).kv_cache_stats().num_blocks
        for dtype, kv in [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "fp8")]
    }
    assert blocks[("float32", "int8")] == blocks[("bfloat16", "fp8")]  # the model dtype no longer matters
    assert 1.93 <= blocks[("bfloat16", "fp8")] / blocks[("bfloat16", "auto")] <= 1.94  # 128 / 66 bytes a head
    assert 3.86 <= blocks[("float32", "int8")] / blocks[("float32", "auto")] <= 3.88  # 256 / 66


def test_accuracy_tool_runs_the_engines_and_reports_each_format(tiny_dir):
    from pagedllm.kv.accuracy import CONTROL, compare, compare_text

    results = compare(str(tiny_dir), num_prompts=3, max_tokens=6, formats=["int8", "fp8_e5m2"],
                      kv_cache_memory=8 * 2**20, dtype="float32")
    assert [r.kv_cache_dtype for r in results] == [CONTROL, "int8", "fp8_e5m2"]
    for r in results:
        assert r.num_prompts == 3 and r.num_equal + len(r.divergences) == 3
        assert all(0 <= d.position < 6 and d.reference_gap >= 0 for d in r.divergences)
    assert results[0].num_equal == 3  # fp32: one prompt at a time changes nothing
    text = " ".join(f"t{3 + (7 * i) % 500}" for i in range(200))
    (int8,) = compare_text(str(tiny_dir), text, ["int8"])
    assert int8.num_positions >= 200 and int8.top1_agreement >= 0.95 and 0 <= int8.mean_kl < 1e-3


def _conversation_turns(llm: LLM, turns=(0, 1)) -> list[list[int]]:
    """Six prompts with their own 4-block prefix, one request at a time per turn: with 20
    blocks of 8 slots, later conversations evict the earlier ones' prefixes."""
    outputs = []
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for turn in turns:
        for c in range(6):
            prefix = torch.randint(3, VOCAB, (32,), generator=torch.Generator().manual_seed(c)).tolist()
            (out,) = llm.generate([{"prompt_token_ids": prefix + [3 + turn, 4 + c]}], params, use_tqdm=False)
            outputs.append(list(out.outputs[0].token_ids))
    llm.llm_engine.block_manager.check_invariants()
    return outputs


def test_tiers_carry_8bit_blocks_and_their_scales(tiny_dir, tmp_path):
    """Evicted 8-bit blocks go to the host and disk tiers and come back bit for bit:
    outputs equal the tiers-off run of the same format, from the tiers and after a restart.
    fp8 because CPU float8 tensors lack the indexing ops the tiers use (they move bytes)."""
    kv_cache_dtype = "fp8_e4m3"
    off = _conversation_turns(_llm(tiny_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20))
    host = _llm(tiny_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20, kv_host_cache_memory=2**20)
    assert _conversation_turns(host) == off
    assert host.kv_cache_stats().tier("host").num_hit_tokens > 0
    disk = _llm(tiny_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20, kv_cache_dir=str(tmp_path))
    assert _conversation_turns(disk) == off
    assert disk.kv_cache_stats().tier("disk").num_hit_tokens > 0
    disk.llm_engine.shutdown()
    restarted = _llm(tiny_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20, kv_cache_dir=str(tmp_path))
    assert _conversation_turns(restarted, turns=(1,)) == off[6:]
    assert restarted.kv_cache_stats().tier("disk").num_hit_tokens > 0
    restarted.llm_engine.shutdown()
