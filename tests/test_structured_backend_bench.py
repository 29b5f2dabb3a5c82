"""The grammar-backend bench: both libraries read the same valid document the same way,
the figures it reports come from real work, and a missing library is skipped, not fatal."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pagedllm.bench.structured import twenty_field_schema
from pagedllm.structured import backend_bench
from pagedllm.structured.backend_bench import load_backend, run, valid_document


def test_the_walked_document_is_valid_for_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = twenty_field_schema("nonce")
    document = valid_document(schema)
    jsonschema.validate(document, schema)
    assert len(document) == 20


@pytest.fixture(scope="module")
def results():
    return run(None, num_rows=2, threads=1)


def test_xgrammar_is_measured_on_the_whole_document(results):
    entry = results["xgrammar"]
    assert results["document_tokens"] > 20
    assert entry["one_row"]["num_steps"] == results["document_tokens"] + 1  # every token, then the end
    assert entry["compile_first_ms"] > 0 and entry["grammar_memory_bytes"] > 0
    assert entry["rows_2_batched"]["fill_ms_per_step_mean"] > 0
    table = backend_bench.format_results(results)
    assert "compile 20-field schema, first, ms" in table and "xgrammar" in table


def test_llguidance_is_measured_or_skipped_with_its_reason(results):
    entry = results["llguidance"]
    if importlib.util.find_spec("llguidance") is None:
        assert "not installed" in entry["skipped"]
        assert "skipped" in backend_bench.format_results(results)
    else:
        assert entry["one_row"]["num_steps"] == results["document_tokens"] + 1
        assert entry["grammar_memory_bytes"] is None  # the library does not report it
    json.dumps(results)  # plain data, as --json writes it


def test_a_backend_that_masks_a_document_token_fails_loudly(monkeypatch):
    backend, _ = load_backend("xgrammar")
    walk_tokens = []

    def fill_nothing(matcher, bitmask, row):
        bitmask[row] = 0
        walk_tokens.append(row)

    monkeypatch.setattr(backend, "fill", fill_nothing, raising=False)
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    walk = backend_bench.Walk(tokenizer.encode('{"field_00": 1', add_special_tokens=False), len(tokenizer.hf),
                              tokenizer.eos_token_ids[0])
    backend.setup(tokenizer.hf, walk.vocab_size, walk.eos_token_id, 1)
    compiled = backend.compile(json.dumps(twenty_field_schema("x")))
    with pytest.raises(AssertionError, match="masked"):
        backend_bench.walk_one_row(backend, compiled, walk)
    assert walk_tokens == [0]
