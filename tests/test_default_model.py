"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) decodes exactly like HF transformers."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.loader import load_model

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
BLOCK_SIZE = 16
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):\n   "]
CHAT_PROMPTS = ["What is 2+2?", "Write a haiku about the sea."]


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Decode-sized matmuls of a 135M model gain little from intra-op threads, and
    on a shared CPU the threads' spin-waiting can slow them down a hundredfold."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer(hf_reference):
    """HF's tokenizer of the default model's GGUF (conftest's session-wide reference)."""
    return hf_reference.tokenizer


@pytest.fixture(scope="module")
def hf_model(hf_reference):
    """HF transformers' fp32 model of the default model's GGUF, in eval mode: the session-wide
    reference that test_engine.py and test_sharing.py also compare against (loaded once)."""
    assert not hf_reference.model.training and hf_reference.model.dtype == torch.float32
    return hf_reference.model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    plain = [tokenizer(p).input_ids for p in PLAIN_PROMPTS]
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS
    ]
    return plain + [tokenizer(c, add_special_tokens=False).input_ids for c in chat]


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
        )
    return out[0, len(prompt) :].tolist()


def _metadata(tables, seq_lens, query_lens, slots) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    table_tensor = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table_tensor[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=table_tensor,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_host=list(seq_lens),
        query_lens_host=list(query_lens),
    )


def _paged_greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts decoded together: one batched prefill, then batched decode steps,
    over shuffled block tables."""
    cfg = loaded.config
    per_seq = -(-(max(map(len, prompts)) + MAX_NEW_TOKENS) // BLOCK_SIZE)
    num_blocks = per_seq * len(prompts) + 1
    cache = KVCache(
        num_layers=cfg.num_layers,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(per_seq)] for _ in prompts]
    seqs = [list(p) for p in prompts]
    new_tokens = [list(p) for p in prompts]  # what each sequence feeds this step
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(MAX_NEW_TOKENS):
        ids, positions, slots = [], [], []
        for seq, feed, table in zip(seqs, new_tokens, tables, strict=True):
            for pos in range(len(seq) - len(feed), len(seq)):
                positions.append(pos)
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids.extend(feed)
        query_lens = [len(f) for f in new_tokens]
        md = _metadata(tables, [len(s) for s in seqs], query_lens, slots)
        last_rows = torch.tensor(query_lens).cumsum(0) - 1
        with torch.no_grad():
            logits = loaded.model(
                torch.tensor(ids), torch.tensor(positions), cache.layers, md, last_rows
            )
        for i, token in enumerate(logits.argmax(-1).tolist()):
            outputs[i].append(token)
            seqs[i].append(token)
        new_tokens = [[s[-1]] for s in seqs]
    return outputs


def test_greedy_decoding_matches_hf(hf_model, tokenizer, prompts):
    loaded = load_model(
        None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attn_backend=TorchAttentionBackend(),
    )
    assert loaded.config.num_layers == 30 and loaded.config.num_kv_heads == 3
    ours = _paged_greedy(loaded, prompts)
    assert "Paris" in tokenizer.decode(ours[0])
    eos = set(loaded.config.eos_token_ids)
    for prompt, mine in zip(prompts, ours, strict=True):
        reference = _hf_greedy(hf_model, prompt)
        # HF stops at EOS; past that point our loop keeps going, so compare its prefix
        assert mine[: len(reference)] == reference
        if len(reference) < MAX_NEW_TOKENS:
            assert reference[-1] in eos
