"""The bounds on compiling one grammar (pagedllm/structured/compile_guard.py): a grammar whose
trial compile runs past the time or memory limit is a RequestError naming the field, the
compile is stopped (its process killed), and grammars within the limits compile as before."""

from __future__ import annotations

import time

import pytest

from pagedllm.errors import RequestError
from pagedllm.models.paths import default_model_path
from pagedllm.structured import StructuredOutputsParams, compile_guard
from pagedllm.structured.compile_guard import CompileLimits
from pagedllm.structured.grammar import GrammarCompiler, GrammarState
from pagedllm.tokenizer import Tokenizer

# xgrammar turns a schema pattern's repeat count into that many grammar rules: 4,000 took
# 1.2 s and 50,000 ran past a minute here (the same text as a top-level regex is instant).
COSTLY = {"type": "string", "pattern": "^[a-z]{50000}$"}
SMALL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(default_model_path())


def _compiler(tokenizer, limits):
    compiler = GrammarCompiler(tokenizer.hf, len(tokenizer.hf), list(tokenizer.eos_token_ids))
    compiler.set_compile_limits(limits)
    return compiler


def test_a_grammar_past_the_time_limit_is_refused_and_its_compile_stopped(tokenizer):
    compiler = _compiler(tokenizer, CompileLimits(timeout_s=3.0, memory_bytes=2 << 30))
    try:
        compiler.compile(StructuredOutputsParams(json=SMALL))  # starts the guard's process
        guard = compiler._guard
        start = time.monotonic()
        with pytest.raises(RequestError) as info:
            compiler.compile(StructuredOutputsParams(json=COSTLY), "response_format")
        took = time.monotonic() - start
        assert info.value.param == "response_format"
        assert "too costly to compile" in str(info.value) and "longer than 3 s" in str(info.value)
        assert 3.0 <= took < 20, took
        assert guard.num_killed == 1 and guard._process is None  # the runaway compile is gone
        # The same grammar again is refused at once, not compiled for another 3 s.
        start = time.monotonic()
        with pytest.raises(RequestError, match="too costly"):
            compiler.compile(StructuredOutputsParams(json=COSTLY))
        assert time.monotonic() - start < 1.0
        # Grammars within the limits still compile (a new process), to the unguarded grammar.
        params = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "maxItems": 3})
        guarded = GrammarState.start(compiler.compile(params))
        plain = GrammarState.start(_compiler(tokenizer, None).compile(params))
        assert guarded.next_row() == plain.next_row()
        assert compiler.num_compiled == 2
        # New limits judge afresh: the refusal made under the old ones is forgotten.
        compiler.set_compile_limits(CompileLimits(timeout_s=5.0, memory_bytes=2 << 30))
        assert not compiler._refused and compiler._guard is None
    finally:
        compiler.close()


def test_a_grammar_past_the_memory_limit_is_refused(tokenizer):
    compiler = _compiler(tokenizer, CompileLimits(timeout_s=60.0, memory_bytes=1 << 20))
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    try:
        with pytest.raises(RequestError) as info:
            compiler.compile(StructuredOutputsParams(json=many), "response_format")
        assert info.value.param == "response_format"
        assert f"more than {1 << 20} bytes of memory" in str(info.value)
    finally:
        compiler.close()


def test_an_idle_helper_is_stopped_and_the_next_grammar_starts_another(tokenizer, monkeypatch):
    monkeypatch.setattr(compile_guard, "IDLE_STOP_S", 1.0)
    compiler = _compiler(tokenizer, CompileLimits(timeout_s=30.0, memory_bytes=2 << 30))
    try:
        compiler.compile(StructuredOutputsParams(json=SMALL))
        guard = compiler._guard
        first = guard._process
        assert first is not None and first.poll() is None
        deadline = time.monotonic() + 30
        while guard._process is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert guard._process is None and first.poll() is not None  # stopped, its memory freed
        assert guard.num_killed == 0  # an idle stop is no runaway compile
        compiler.compile(StructuredOutputsParams(json={"type": "integer"}))
        assert guard._process is not None and guard._process.pid != first.pid
    finally:
        compiler.close()


def test_without_limits_nothing_is_started(tokenizer):
    compiler = _compiler(tokenizer, None)
    compiler.compile(StructuredOutputsParams(json=SMALL))
    assert compiler._guard is None
