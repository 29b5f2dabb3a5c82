"""``python -m pagedllm.structured.backend_bench``: xgrammar and llguidance side by side.

On the default model's tokenizer, for the 20-field schema of ``bench
structured``, each library is timed on what constrained decoding asks of it:

- tokenizer setup (once per engine);
- compiling the schema: first use, then again (xgrammar's compiled-grammar
  cache; llguidance has no compiled object to keep, so its "again" is a new
  matcher for the same grammar and, the way pagedllm would reuse one, a
  ``deep_copy`` of a pristine matcher);
- the per-step bitmask fill while walking the tokens of one valid document
  (every document token must be allowed where it stands, and the end must
  accept: a check that both grammars mean the same schema), one row at a time;
- the same walk for a batch of ``--rows`` matchers in lockstep: one Python
  call per row, and the library's batched fill (xgrammar's
  ``BatchGrammarMatcher``, llguidance's ``LLExecutor``), with ``--threads``;
- the compiled grammar's memory where the library reports it.

llguidance is optional (``pip install llguidance``, or the ``llguidance``
extra); without it its column is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

LIBRARIES = ("xgrammar", "llguidance")


def valid_document(schema: dict) -> dict:
    """A document of ``twenty_field_schema``: one plausible value per field kind, every field set."""
    values = {"integer": 4096, "string": "a short note", "boolean": True, "number": 3.25}
    document = {}
    for name, kind in schema["properties"].items():
        document[name] = kind["enum"][1] if "enum" in kind else values[kind["type"]]
    return document


@dataclass
class Walk:
    """The token ids of a valid document (a canonical tokenization) and the vocabulary width."""

    token_ids: list[int]
    vocab_size: int
    eos_token_id: int


class Backend:
    """One library behind the operations the bench times; ``matcher`` objects are the library's own."""

    name: str
    version: str

    def setup(self, hf_tokenizer, vocab_size: int, eos_token_id: int, threads: int) -> None: ...
    def compile(self, schema_text: str): ...
    def memory_bytes(self, compiled) -> int | None: ...
    def new_matcher(self, compiled): ...
    def copy_matcher(self, matcher): ...
    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher, token_id: int) -> bool: ...
    def is_accepting(self, matcher) -> bool: ...


class XGrammarBackend(Backend):
    name = "xgrammar"

    def setup(self, hf_tokenizer, vocab_size, eos_token_id, threads):
        import xgrammar as xgr

        self.xgr, self.version = xgr, importlib.metadata.version("xgrammar")
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_token_id])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema_text):
        # As pagedllm compiles a json schema: free whitespace, no properties beyond the schema's.
        return self.compiler.compile_json_schema(schema_text, any_whitespace=True, strict_mode=True)

    def memory_bytes(self, compiled):
        return int(compiled.memory_size_bytes)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def copy_matcher(self, matcher):
        return matcher.fork()

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id):
        return matcher.accept_token(token_id)

    def is_accepting(self, matcher):
        return matcher.is_terminated()


class LLGuidanceBackend(Backend):
    name = "llguidance"

    def setup(self, hf_tokenizer, vocab_size, eos_token_id, threads):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.version = importlib.metadata.version("llguidance")
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema_text):
        # The grammar text, then a matcher: llguidance builds its parser when the matcher is made.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text, defaults={"whitespace_flexible": True})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"llguidance rejected the schema: {matcher.get_error()}")
        return grammar

    def memory_bytes(self, compiled):
        return None  # not reported by the library

    def new_matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def copy_matcher(self, matcher):
        return matcher.deep_copy()

    def fill(self, matcher, bitmask, row):
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id):
        return matcher.consume_token(token_id) and not matcher.is_error()

    def is_accepting(self, matcher):
        return matcher.is_stopped() or matcher.is_accepting()


def load_backend(name: str) -> tuple[Backend | None, str | None]:
    """(backend, None), or (None, why it is skipped) when the library is not installed."""
    module = {"xgrammar": "xgrammar", "llguidance": "llguidance"}[name]
    try:
        __import__(module)
    except ImportError as exc:
        return None, f"{name} is not installed ({exc}); pip install {module} to measure it"
    return (XGrammarBackend() if name == "xgrammar" else LLGuidanceBackend()), None


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def walk_one_row(backend: Backend, compiled, walk: Walk) -> dict:
    """Fill, check, accept along the document, then its end; per-step fill times in ms."""
    matcher = backend.new_matcher(compiled)
    bitmask = torch.zeros((1, (walk.vocab_size + 31) // 32), dtype=torch.int32)
    fills, accepts = [], []
    for position, token_id in enumerate([*walk.token_ids, walk.eos_token_id]):
        _, seconds = _timed(lambda: backend.fill(matcher, bitmask, 0))
        fills.append(_ms(seconds))
        if not _allowed(bitmask, 0, token_id):
            raise AssertionError(f"{backend.name}: token {token_id} at position {position} of a valid document is masked")
        ok, seconds = _timed(lambda t=token_id: backend.accept(matcher, t))
        accepts.append(_ms(seconds))
        if not ok:
            raise AssertionError(f"{backend.name}: token {token_id} at position {position} was not accepted")
    if not backend.is_accepting(matcher):
        raise AssertionError(f"{backend.name}: the document and its end did not complete the grammar")
    return {
        "num_steps": len(fills),
        "fill_ms_mean": statistics.fmean(fills),
        "fill_ms_median": statistics.median(fills),
        "fill_ms_max": max(fills),
        "fill_ms_total": sum(fills),
        "accept_ms_mean": statistics.fmean(accepts),
    }


def walk_batch(backend: Backend, compiled, walk: Walk, num_rows: int, batched: bool) -> dict:
    """``num_rows`` matchers in lockstep along the document; ms per step for the whole batch's fill."""
    matchers = [backend.new_matcher(compiled) for _ in range(num_rows)]
    bitmask = torch.zeros((num_rows, (walk.vocab_size + 31) // 32), dtype=torch.int32)
    steps = []
    for token_id in walk.token_ids:
        if batched:
            _, seconds = _timed(lambda: backend.fill_batch(matchers, bitmask))
        else:
            _, seconds = _timed(lambda: [backend.fill(m, bitmask, i) for i, m in enumerate(matchers)])
        steps.append(_ms(seconds))
        if not all(_allowed(bitmask, i, token_id) for i in range(num_rows)):
            raise AssertionError(f"{backend.name}: a batched row masks token {token_id} of the document")
        for matcher in matchers:
            backend.accept(matcher, token_id)
    return {"fill_ms_per_step_mean": statistics.fmean(steps), "fill_ms_per_step_max": max(steps)}


def compile_times(backend: Backend, schema: dict) -> tuple[object, dict]:
    """The compiled grammar of ``schema`` and the ms to compile it first and again."""
    text = json.dumps(schema)
    compiled, first = _timed(lambda: backend.compile(text))
    _, again = _timed(lambda: backend.compile(text))
    pristine = backend.new_matcher(compiled)
    _, new_matcher = _timed(lambda: backend.new_matcher(compiled))
    _, copied = _timed(lambda: backend.copy_matcher(pristine))
    return compiled, {
        "compile_first_ms": _ms(first),
        "compile_again_ms": _ms(again),
        "new_matcher_ms": _ms(new_matcher),
        "copy_matcher_ms": _ms(copied),
    }


def measure(backend: Backend, hf_tokenizer, walk: Walk, schema: dict, num_rows: int, threads: int) -> dict:
    _, setup_s = _timed(lambda: backend.setup(hf_tokenizer, walk.vocab_size, walk.eos_token_id, threads))
    compiled, compile_ms = compile_times(backend, schema)
    return {
        "version": backend.version,
        "tokenizer_setup_ms": _ms(setup_s),
        **compile_ms,
        "grammar_memory_bytes": backend.memory_bytes(compiled),
        "one_row": walk_one_row(backend, compiled, walk),
        f"rows_{num_rows}_per_row_calls": walk_batch(backend, compiled, walk, num_rows, batched=False),
        f"rows_{num_rows}_batched": walk_batch(backend, compiled, walk, num_rows, batched=True),
    }


def run(model: str | None, num_rows: int, threads: int, libraries: tuple[str, ...] = LIBRARIES) -> dict:
    """Results per library (or its skip reason); raises AssertionError if a library misreads the document."""
    from pagedllm.bench.structured import twenty_field_schema
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model or default_model_path())
    schema = twenty_field_schema(uuid.uuid4().hex)  # a nonce: no cache anywhere has seen it
    document = json.dumps(valid_document(schema))
    walk = Walk(tokenizer.encode(document, add_special_tokens=False), len(tokenizer.hf), tokenizer.eos_token_ids[0])
    results: dict = {"document_tokens": len(walk.token_ids), "rows": num_rows, "threads": threads}
    for name in libraries:
        backend, skipped = load_backend(name)
        if backend is None:
            print(f"skipping {name}: {skipped}", file=sys.stderr)
            results[name] = {"skipped": skipped}
            continue
        results[name] = measure(backend, tokenizer.hf, walk, schema, num_rows, threads)
    return results


def format_results(results: dict) -> str:
    from pagedllm.bench.report import format_table

    measured = [n for n in LIBRARIES if n in results and "skipped" not in results[n]]
    rows_key = f"rows_{results['rows']}"
    lines = [
        ("tokenizer setup, ms", "tokenizer_setup_ms"),
        ("compile 20-field schema, first, ms", "compile_first_ms"),
        ("compile again, ms", "compile_again_ms"),
        ("new matcher, ms", "new_matcher_ms"),
        ("copy a matcher (fork), ms", "copy_matcher_ms"),
        ("compiled grammar memory, KiB", "grammar_memory_bytes"),
        ("fill, 1 row, mean ms/step", ("one_row", "fill_ms_mean")),
        ("fill, 1 row, median ms/step", ("one_row", "fill_ms_median")),
        ("fill, 1 row, max ms/step", ("one_row", "fill_ms_max")),
        ("accept, 1 row, mean ms/token", ("one_row", "accept_ms_mean")),
        (f"fill, {results['rows']} rows, one call per row, ms/step", (f"{rows_key}_per_row_calls", "fill_ms_per_step_mean")),
        (f"fill, {results['rows']} rows, batched call, ms/step", (f"{rows_key}_batched", "fill_ms_per_step_mean")),
    ]

    def value(name: str, key):
        entry = results[name]
        got = entry[key[0]][key[1]] if isinstance(key, tuple) else entry[key]
        return got / 1024 if key == "grammar_memory_bytes" and got is not None else got

    table = format_table(["measure", *measured], [[label, *(value(n, key) for n in measured)] for label, key in lines])
    skipped = [f"{n}: skipped ({results[n]['skipped']})" for n in LIBRARIES if "skipped" in results.get(n, {})]
    header = (f"{results['document_tokens']}-token document of the 20-field schema, "
              f"{results['threads']} threads; versions: " + ", ".join(f"{n} {results[n]['version']}" for n in measured))
    return "\n".join([header, table, *skipped])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.structured.backend_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory or GGUF whose tokenizer to use (default: the default model)")
    parser.add_argument("--rows", type=int, default=64, help="matchers filled per step in the batch walk")
    parser.add_argument("--threads", type=int, default=2, help="threads each library may use for compiling and batched fills")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.threads < 1:
        parser.error("--rows and --threads must be at least 1")
    results = run(args.model, args.rows, args.threads)
    print(format_results(results))
    if args.json:
        from pagedllm.bench import report

        report.write_json(args.json, {**results, "env": report.environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
