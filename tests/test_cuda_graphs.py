"""The static-buffer decode path that CUDA graphs replay, checked eagerly on the CPU.

A graph replays exactly what ``DecodeGraphs`` stages: inputs copied into the
first rows of static buffers, the remaining rows of the bucket padded (slot
-1, context 0). Here the same path runs without capture and must give the
logits of an ordinary forward pass, for every batch size that pads.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import skip_if_interpreter_too_old

triton = pytest.importorskip("triton", reason="the graph path uses the Triton decode kernel")
skip_if_interpreter_too_old(triton)

from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kv.kv_cache import KVCache  # noqa: E402
from pagedllm.models.config import ModelConfig  # noqa: E402
from pagedllm.models.llama import LlamaForCausalLM  # noqa: E402
from pagedllm.runner.cuda_graphs import DecodeGraphs, batch_buckets  # noqa: E402
from pagedllm.runner.inputs import build_model_inputs  # noqa: E402

BS = 8
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_model() -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True,
    })
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, TritonAttentionBackend())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(DEVICE).eval()


def test_buckets_cover_every_batch_size():
    assert batch_buckets(256)[-1] == 256 and batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_static_padded_decode_equals_eager_forward(num_seqs):
    model = tiny_model()
    mc = model.config
    cache = KVCache(num_layers=mc.num_layers, num_blocks=40, block_size=BS, num_kv_heads=mc.num_kv_heads,
                    head_dim=mc.head_dim, dtype=torch.float32, device=DEVICE)
    rng = random.Random(num_seqs)
    free = list(range(40))
    rng.shuffle(free)
    # prefill each sequence eagerly so the cache holds real context
    chunks = []
    for _ in range(num_seqs):
        length = rng.randrange(3, 30)
        table = [free.pop() for _ in range((length + 1 + BS - 1) // BS)]
        tokens = [rng.randrange(96) for _ in range(length + 1)]
        prefill = SimpleNamespace(token_ids=tokens[:-1], start_pos=0, block_table=table,
                                  needs_logits=True, all_logits=False)
        inputs = build_model_inputs([prefill], BS, DEVICE)
        with torch.inference_mode():
            model(inputs.input_ids, inputs.positions, cache.layers, inputs.metadata, inputs.logits_indices)
        chunks.append(SimpleNamespace(token_ids=tokens[-1:], start_pos=length, block_table=table,
                                      needs_logits=True, all_logits=False))
    decode = build_model_inputs(chunks, BS, DEVICE)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    with torch.inference_mode():
        want = model(decode.input_ids, decode.positions, cache.layers, decode.metadata, decode.logits_indices)
    after_eager = [(k.clone(), v.clone()) for k, v in cache.layers]
    for (k, v), (k0, v0) in zip(cache.layers, before):  # back to the pre-decode cache
        k.copy_(k0)
        v.copy_(v0)
    graphs = DecodeGraphs(model, cache.layers, block_size=BS, max_num_seqs=8, max_model_len=64,
                          device=DEVICE, use_graphs=DEVICE.type == "cuda")
    graphs.capture_all()
    bucket = graphs.bucket_for(num_seqs)
    assert graphs.can_run(decode) and bucket >= num_seqs
    assert (bucket in graphs.captured_sizes) == (DEVICE.type == "cuda")
    got = graphs.run(decode)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the real rows wrote their K/V and the padding rows wrote nothing
    for (k, v), (ke, ve) in zip(cache.layers, after_eager):
        torch.testing.assert_close(k, ke, equal_nan=True, atol=0, rtol=0)
        torch.testing.assert_close(v, ve, equal_nan=True, atol=0, rtol=0)


def test_prefill_steps_are_not_eligible():
    model = tiny_model()
    graphs = DecodeGraphs(model, [], block_size=BS, max_num_seqs=4, max_model_len=64,
                          device=DEVICE, use_graphs=False)
    prefill = SimpleNamespace(token_ids=[1, 2, 3], start_pos=0, block_table=[0], needs_logits=True,
                              all_logits=False)
    assert not graphs.can_run(build_model_inputs([prefill], BS, DEVICE))
