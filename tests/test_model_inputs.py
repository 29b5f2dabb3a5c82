"""build_model_inputs: a decode step's lean path builds exactly the tensors of the general one."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.runner import inputs
from pagedllm.worker.input_batch import BatchChunk


def _decode_chunks(rng: random.Random, count: int, block_size: int) -> list[BatchChunk]:
    chunks = []
    for i in range(count):
        position = rng.randrange(0, 5 * block_size)
        blocks = position // block_size + 1 + rng.randrange(0, 3)  # tables may run past the position
        table = rng.sample(range(1, 1000), blocks)
        logits = rng.random()
        chunks.append(BatchChunk(
            seq_id=i, token_ids=[rng.randrange(50_000)], start_pos=position, block_table=table,
            needs_logits=logits < 0.8, all_logits=logits > 0.9, token_on_device=False,
        ))
    return chunks


def _same(a: inputs.ModelInputs, b: inputs.ModelInputs) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        x, y = getattr(a.metadata, name), getattr(b.metadata, name)
        assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), name
    assert a.row_counts == b.row_counts
    for name in ("max_query_len", "max_seq_len", "seq_lens_host", "query_lens_host"):
        assert getattr(a.metadata, name) == getattr(b.metadata, name), name


@pytest.mark.parametrize("count", [1, 2, 7, 64])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_steps_take_the_lean_path_and_match_the_general_one(count, block_size, monkeypatch):
    rng = random.Random(count * 100 + block_size)
    chunks = _decode_chunks(rng, count, block_size)
    general = inputs._chunk_inputs(chunks, block_size, torch.device("cpu"))
    lean_calls = []
    lean = inputs._decode_inputs
    monkeypatch.setattr(inputs, "_decode_inputs", lambda *a: lean_calls.append(a) or lean(*a))
    built = inputs.build_model_inputs(chunks, block_size, torch.device("cpu"))
    assert len(lean_calls) == 1
    _same(built, general)
    assert built.metadata.block_tables.dtype == torch.int32 and built.input_ids.dtype == torch.int64
    c = chunks[0]
    assert int(built.metadata.slot_mapping[0]) == (
        c.block_table[c.start_pos // block_size] * block_size + c.start_pos % block_size
    )


def test_a_step_with_a_longer_chunk_takes_the_general_path(monkeypatch):
    rng = random.Random(5)
    chunks = _decode_chunks(rng, 3, 16)
    chunks.append(BatchChunk(9, [1, 2, 3], 30, [4, 5, 6], True, False, False))
    monkeypatch.setattr(inputs, "_decode_inputs", lambda *a: pytest.fail("not a decode step"))
    built = inputs.build_model_inputs(chunks, 16, torch.device("cpu"))
    assert built.input_ids.shape[0] == 6 and built.metadata.max_query_len == 3
    assert built.positions.tolist()[-3:] == [30, 31, 32]
    assert built.metadata.slot_mapping.tolist()[-3:] == [5 * 16 + 14, 5 * 16 + 15, 6 * 16]


def test_a_position_past_the_block_table_is_an_error_on_both_paths():
    chunk = BatchChunk(0, [7], 40, [3, 4], True, False, False)  # position 40 needs a third block of 16
    with pytest.raises(IndexError):
        inputs.build_model_inputs([chunk], 16, torch.device("cpu"))
    with pytest.raises(IndexError):
        inputs._chunk_inputs([chunk], 16, torch.device("cpu"))


def test_decode_tiles_equal_the_general_loops_ties_in_order():
    from pagedllm.native import cpu_ops

    rng = random.Random(3)
    for count in (1, 2, 5, 64):
        seq_lens = [rng.choice([7, 9, 9, 40, 300]) for _ in range(count)]  # ties keep sequence order
        query_lens = [1] * count
        lean = cpu_ops.make_tiles(seq_lens, query_lens, 16)
        general = cpu_ops.make_tiles(seq_lens, query_lens, 16, breaks=(0,))  # a break that cuts nothing
        assert lean.dtype == torch.int32 and lean.shape == (count, 4)
        assert torch.equal(lean, general)
        expected = sorted(((i, i, n, 1) for i, n in enumerate(seq_lens)), key=lambda t: -t[2])
        assert lean.tolist() == [list(t) for t in expected]


def test_every_row_is_true_only_when_each_token_row_gives_logits():
    rng = random.Random(8)
    chunks = _decode_chunks(rng, 6, 16)
    for c in chunks:
        c.needs_logits, c.all_logits = True, False
    assert inputs.build_model_inputs(chunks, 16, torch.device("cpu")).every_row
    chunks[3].needs_logits = False
    built = inputs.build_model_inputs(chunks, 16, torch.device("cpu"))
    assert not built.every_row and built.logits_indices.tolist() == [0, 1, 2, 4, 5]
    prefill = [BatchChunk(0, [1, 2, 3], 0, [4], True, False, False), BatchChunk(1, [5, 6], 0, [7], False, True, False)]
    built = inputs.build_model_inputs(prefill, 16, torch.device("cpu"))
    assert not built.every_row and built.logits_indices.tolist() == [2, 3, 4]
    prefill[0].all_logits = True
    assert inputs.build_model_inputs(prefill, 16, torch.device("cpu")).every_row
