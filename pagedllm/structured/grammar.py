"""Grammar compilation and per-sequence matcher state, on xgrammar.

xgrammar is imported on first use, so ``import pagedllm`` and unconstrained
requests never pay for it. One ``GrammarCompiler`` serves one tokenizer: it
builds xgrammar's tokenizer info once (the vocabulary's decoded bytes, the
EOS ids as the grammar's stop tokens) and keeps compiled grammars in an LRU
cache keyed by ``GrammarSpec`` (kind + canonical text).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.structured.params import GrammarSpec, StructuredOutputsParams

DEFAULT_MAX_CACHED_GRAMMARS = 256
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled against one tokenizer; immutable and shared by every sequence using it."""

    spec: GrammarSpec
    handle: Any  # xgrammar.CompiledGrammar


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles off the engine loop)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_cached: int = DEFAULT_MAX_CACHED_GRAMMARS) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed len(tokenizer))
        self._stop_token_ids = list(stop_token_ids)
        self._max_cached = max_cached
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()  # LRU: oldest first
        self._lock = threading.Lock()
        self._xgr_compiler = None
        self._limits = None  # compile_guard.CompileLimits, or None: compile unguarded
        self._guard = None  # the CompileGuard of _limits, made with the first grammar
        self._xgr_info = None
        self._refused: OrderedDict[GrammarSpec, str] = OrderedDict()  # too costly: refused again at once
        self.num_compiled = 0
        self.num_cache_hits = 0

    def _compiler(self):
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._xgr_info = info
            # xgrammar's own cache is off: ours is bounded and keyed by the canonical text.
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._xgr_compiler

    def set_compile_limits(self, limits) -> None:
        """Compile every new grammar within ``limits`` (a compile_guard.CompileLimits; None: no
        limits): a trial compile in a child process first, killed past them (the server's guard
        against schemas that take minutes to compile). The child starts with the first grammar."""
        with self._lock:
            if self._guard is not None:
                self._guard.close()
            self._guard = None
            self._limits = limits
            self._refused.clear()  # judged under the old limits

    def close(self) -> None:
        """Stops the compile guard's process, if any."""
        with self._lock:
            if self._guard is not None:
                self._guard.close()

    def compile(self, params: StructuredOutputsParams, param: str | None = None) -> CompiledGrammar:
        """The compiled grammar for ``params``; RequestError naming ``param`` when it does not compile."""
        spec = params.spec()
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return cached
            compiler = self._compiler()
        where = param or params.param
        self._check_cost(spec, where)
        try:
            handle = compile_spec(compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
            raise RequestError(f"{where}: cannot compile the {spec.kind.replace('_', ' ')}: {_reason(exc)}",
                               param=where) from None
        if not _allows_a_first_token(handle):
            # Decoding could not take a single step (a regex such as [^\s\S], an empty grammar).
            raise RequestError(f"{where}: the {spec.kind.replace('_', ' ')} matches no output at all", param=where)
        compiled = CompiledGrammar(spec, handle)
        with self._lock:
            self._cache[spec] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _check_cost(self, spec: GrammarSpec, where: str) -> None:
        """RequestError naming ``where`` when ``spec``'s trial compile goes past the limits (or did
        before: such a grammar is refused at once); nothing without limits."""
        from pagedllm.structured.compile_guard import CompileGuard, GrammarTooCostly

        with self._lock:
            if self._limits is None:
                return
            reason = self._refused.get(spec)
            if self._guard is None:
                self._guard = CompileGuard(self._xgr_info.serialize_json(), self._limits)
            guard = self._guard
        if reason is None:
            try:
                guard.check(spec.kind, spec.text, spec.any_whitespace)
                return
            except GrammarTooCostly as exc:
                reason = str(exc)
            with self._lock:
                self._refused[spec] = reason
                while len(self._refused) > self._max_cached:
                    self._refused.popitem(last=False)
        raise RequestError(f"{where}: the {spec.kind.replace('_', ' ')} is too costly to compile: {reason}; "
                           "simplify it (long repetition counts in patterns are the usual cause)", param=where)

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def _allows_a_first_token(handle) -> bool:
    """Whether a fresh matcher of the compiled grammar allows any token (a stop token included)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, handle.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(handle).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


# A string with minLength / maxLength is compiled to a counted rule of this character class: any
# character but a quote, a backslash, CR and LF. It lets the other control characters through raw
# (U+0000-U+001F, which JSON allows only escaped: the output would not parse) and no escape at all.
_LENGTH_CHARACTER = '[^\\"\\\\\\r\\n]'
# One character of a JSON string's text: anything but a control character, a quote or a backslash,
# or one escape sequence (a decoded character, as minLength and maxLength count them).
_JSON_CHARACTER = '[^\\0-\\x1f\\"\\\\] | "\\\\" basic_escape'
_LENGTH_RULE = re.compile(r"^(\S+_characters ::= \(\()" + re.escape(_LENGTH_CHARACTER) + r"(\)\))$", re.MULTILINE)


def json_schema_grammar(spec_text: str, any_whitespace: bool) -> str:
    """The grammar (EBNF text) a JSON schema compiles to, with every length-counted string
    character a JSON string character (see ``_LENGTH_CHARACTER``)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(spec_text, any_whitespace=any_whitespace, strict_mode=True))
    return _LENGTH_RULE.sub(lambda m: m.group(1) + _JSON_CHARACTER + m.group(2), text)


def compile_spec(compiler, spec: GrammarSpec):
    if spec.kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(spec.text, spec.any_whitespace))
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    raise AssertionError(f"unknown grammar kind {spec.kind}")


class GrammarState:
    """Where one sequence stands in its grammar: the tokens it has accepted so far.

    Invariant: the matcher has accepted exactly the sequence's generated
    tokens, in order (the engine calls ``accept`` once per appended token).
    The allowed next tokens are filled once per position (``next_row``) and
    kept until the next ``accept``: the engine reads them to see whether the
    sequence can go on, and the step's mask reuses them.
    """

    __slots__ = ("grammar", "matcher", "_row")

    def __init__(self, grammar: CompiledGrammar, matcher, row: bytes | None = None) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self._row = row  # the allowed next tokens as one bitmask row (bytes), or None until filled

    @classmethod
    def start(cls, grammar: CompiledGrammar) -> GrammarState:
        import xgrammar as xgr

        return cls(grammar, xgr.GrammarMatcher(grammar.handle))

    def fork(self) -> GrammarState:
        """An independent copy at the same point (for a forked sequence or beam)."""
        return GrammarState(self.grammar, self.matcher.fork(), self._row)

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (and no change) when the grammar forbids it."""
        accepted = self.matcher.accept_token(token_id)
        if accepted:
            self._row = None
        return accepted

    def next_row(self) -> bytes:
        """The allowed next tokens as one bitmask row (int32 words as bytes, see
        pagedllm.structured.bitmask); filled on first use at each position."""
        if self._row is None:
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(1, self.grammar.handle.tokenizer_info.vocab_size)
            self.fill_bitmask(bitmask, 0)
            self._row = bitmask.numpy().tobytes()
        return self._row

    @property
    def is_dead_end(self) -> bool:
        """The grammar allows no next token, not even a stop, yet was not ended by one: the output
        so far is a prefix no continuation completes (a defect of the grammar, such as the regex
        ``a[^\\s\\S]`` after ``a``). Decoding cannot take another step."""
        return not self.is_terminated and self.next_row().count(0) == len(self._row)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (int32 words, bit j of word w = token 32w+j)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (a test and debugging aid: fills a one-row mask)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.grammar.handle.tokenizer_info.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)
