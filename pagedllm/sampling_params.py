"""Request parameters with vLLM's field names and defaults.

Invalid values raise :class:`pagedllm.errors.RequestError` (a ``ValueError``)
whose ``param`` names the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pagedllm.errors import RequestError
from pagedllm.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_LOGIT_BIAS,
    RequestLimits,
    check_at_most,
    check_bool,
    check_float32,
    check_sampling_lists,
    check_token_ids,
    parse_token_id_key,
)
from pagedllm.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# at most this many ids in logprob_token_ids (vLLM 0.32's bound), and at most RequestLimits.max_logprobs
MAX_LOGPROB_TOKEN_IDS = 128


def _fail(param: str, message: str) -> NoReturn:
    raise RequestError(f"{param}: {message}", param=param)


def _is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is not a sensible count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_finite(owner: object, names: tuple[str, ...]) -> None:
    """Every named field is a finite real number (NaN slips through range checks) that
    float32, the sampler's type, holds without rounding it to 0 or inf."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(name, f"must be a finite number, got {value!r}")
        check_float32(value, name)


class RequestOutputKind(enum.IntEnum):
    """What a request's step outputs hold (vLLM's enum of the same name): everything so far at
    each step (CUMULATIVE), only what is new since its last output (DELTA: text, token ids and
    logprobs; prompt logprobs in the first output only), or one output when it finishes
    (FINAL_ONLY). ``LLMEngine.step`` and ``AsyncLLMEngine.generate`` honour it; ``LLM.generate``
    returns finished outputs whatever it says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def check_output_kind(value: object) -> RequestOutputKind:
    """``value`` as a :class:`RequestOutputKind` (a member or its integer), else a RequestError."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in tuple(RequestOutputKind):
        _fail("output_kind", f"must be RequestOutputKind.CUMULATIVE, DELTA or FINAL_ONLY (0, 1 or 2), got {value!r}")
    return RequestOutputKind(value)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # sample only from these token ids (every other token's logit is -inf)
    allowed_token_ids: list[int] | None = None
    # words never generated: each is banned as the model would write it at the start of the text
    # and after a space (its tokens, with and without a leading space); see bad_words_token_ids
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # keep only the last k prompt tokens (-1: the model's context length); None keeps all
    truncate_prompt_tokens: int | None = None
    # vLLM's arguments for custom sampling code: kept with the request, read by nothing built in
    extra_args: dict[str, Any] | None = None
    # True: the prompt is computed in full, no block taken from the prefix cache (its blocks are
    # still cached for later requests); None: only where prompt_logprobs needs every position
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # step outputs at most every this many new tokens (the finished one always)
    stream_interval: int = 1
    # logprobs of exactly these token ids at every output position (with the drawn token's), each with its
    # rank in the vocabulary: scoring label tokens without logprobs over the whole vocabulary; a
    # non-empty list, at most MAX_LOGPROB_TOKEN_IDS; logprobs, when also set, must equal its length
    logprob_token_ids: list[int] | None = None

    @property
    def num_logprobs(self) -> int | None:
        """Logprob entries asked per output token besides the drawn one (vLLM's): ``logprobs``, else
        the number of ``logprob_token_ids``; None when neither asks for any."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    def __post_init__(self) -> None:
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        check_extra_args(self.extra_args)
        self.output_kind = check_output_kind(self.output_kind)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            _fail("stop", f"must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            _fail("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                kind = "token ids" if name == "allowed_token_ids" else "strings"
                _fail(name, f"must be a list of {kind}, got {value!r}")
            setattr(self, name, None if value is None else list(value))
        # bad_words as token id sequences, set from the model's tokenizer when a request is added
        self.bad_words_token_ids: list[list[int]] | None = None
        _check_finite(self, _FLOAT_FIELDS)
        check_bool(self, _BOOL_FIELDS)
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "best_of", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if _is_int(value) and not INT64_MIN <= value <= INT64_MAX:
                _fail(name, f"must fit in 64 bits, got {value}")
        if not _is_int(self.n) or self.n < 1:
            _fail("n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            _fail("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, f"must be an integer >= 0, got {value!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            _fail("stop", "every stop string must be a non-empty string")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "every stop token id must be an integer >= 0")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", "must not be empty (it lists the only tokens that may be sampled)")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                _fail("allowed_token_ids", "every token id must be an integer >= 0")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            _fail("bad_words", "every bad word must be a string with some non-space text")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            _fail("seed", f"must be an integer in [-2**63, 2**63 - 1] (64 bits), got {self.seed!r}")
        if not self.detokenize and self.stop:
            _fail("stop", "stop strings need detokenize=True")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if not _is_int(self.stream_interval) or not 1 <= self.stream_interval <= INT64_MAX:
            _fail("stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")
        self._check_logprob_token_ids()
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            _fail("skip_reading_prefix_cache", f"must be true, false or null, got {self.skip_reading_prefix_cache!r}")

    def _check_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)):
            _fail("logprob_token_ids", f"must be a list of token ids, got {ids!r}")
        self.logprob_token_ids = ids = list(ids)
        if not ids:
            _fail("logprob_token_ids", "must not be empty (leave it unset for no logprobs)")
        if any(not _is_int(t) or t < 0 for t in ids):
            _fail("logprob_token_ids", "every token id must be an integer >= 0")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            _fail("logprob_token_ids", f"at most {MAX_LOGPROB_TOKEN_IDS} token ids, got {len(ids)}")
        if self.logprobs is not None and self.logprobs != len(ids):
            _fail("logprob_token_ids", f"with logprobs also set, logprobs must equal its length ({len(ids)}), "
                  f"got logprobs={self.logprobs}")

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        """The counts within ``limits`` and every token id within the vocabulary."""
        if self.n > limits.max_n:
            _fail("n", f"must be <= {limits.max_n} (the server's limit on samples per prompt), got {self.n}")
        if self.best_of is not None and self.best_of > limits.max_n:
            _fail("best_of", f"must be <= {limits.max_n} (the server's limit on samples per prompt), "
                  f"got {self.best_of}")
        check_at_most("stop", len(self.stop), limits.max_stop, "stop strings")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > limits.max_stop_chars:
            _fail("stop", f"each stop string may have at most {limits.max_stop_chars} characters, got {longest}")
        check_at_most("stop_token_ids", len(self.stop_token_ids), limits.max_stop_token_ids, "stop token ids")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if self.logit_bias:
            check_at_most("logit_bias", len(self.logit_bias), limits.max_logit_bias, "logit_bias entries")
            check_token_ids(self.logit_bias, vocab_size, "logit_bias")
        check_sampling_lists(self.allowed_token_ids, self.bad_words, limits, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limits.max_logprobs:
                _fail(name, f"must be <= {limits.max_logprobs}, got {value}")
        if self.logprob_token_ids is not None:
            check_at_most("logprob_token_ids", len(self.logprob_token_ids), limits.max_logprobs, "token ids")
            check_token_ids(self.logprob_token_ids, vocab_size, "logprob_token_ids")

    def resolve_bad_words(self, encode) -> None:
        """Set bad_words_token_ids from ``encode`` (text -> token ids, no special tokens).

        Each word is banned both where it starts the text and after a space: its tokens without
        and with a leading space (the word's own leading spaces dropped), the second only where it
        differs. The sampler bans a sequence's last token whenever the tokens generated just
        before it are the rest of the sequence, so a one-token word is never generated."""
        sequences: list[list[int]] = []
        for word in self.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(text))
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences or None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of when given, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def effective_top_k(self) -> int:
        """top_k with both disabled spellings normalised to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k


_BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)

_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)


def check_truncate_prompt_tokens(value: object) -> None:
    """vLLM's range for truncate_prompt_tokens apart from the model's context length:
    None, -1 or an integer >= 1 (that fits in 64 bits)."""
    if value is None:
        return
    if not _is_int(value):
        _fail("truncate_prompt_tokens", f"must be an integer, got {value!r}")
    if value == 0 or value < -1:
        _fail("truncate_prompt_tokens", "must be -1 (the model's context length) or an integer >= 1 "
              f"(the number of prompt tokens to keep), got {value}")
    if value > INT64_MAX:
        _fail("truncate_prompt_tokens", f"must fit in 64 bits, got {value}")


def prompt_tokens_kept(truncate_prompt_tokens: object, max_model_len: int) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens`` keeps (the last ones), or None to keep
    all; RequestError for a value outside its range or above ``max_model_len``.

    vLLM's meaning: k >= 1 keeps the last k tokens, -1 the last ``max_model_len``. The server and
    the engine (``LLM.generate`` / ``LLM.chat``) both resolve the field here."""
    check_truncate_prompt_tokens(truncate_prompt_tokens)
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens > max_model_len:
        _fail("truncate_prompt_tokens",
              f"must be <= {max_model_len} (this model's context length), got {truncate_prompt_tokens}")
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _normalise_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys (JSON sends strings) and finite float values."""
    if not logit_bias:
        return None
    if not isinstance(logit_bias, dict):
        _fail("logit_bias", f"must map token ids to numbers, got {logit_bias!r}")
    normalised: dict[int, float] = {}
    for key, value in logit_bias.items():
        token = parse_token_id_key(key, "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail("logit_bias", f"entry {key!r}: the bias must be a number, got {value!r}")
        bias = float(value)
        if token < 0 or not math.isfinite(bias) or abs(bias) > MAX_ABS_LOGIT_BIAS:
            _fail(
                "logit_bias",
                f"entry {key!r}: {value!r} needs a token id >= 0 and a bias in [-100, 100]",
            )
        normalised[token] = bias
    return normalised


def check_extra_args(value: object) -> None:
    """None, or a dict of string keys whose values are JSON-like (None, bools, numbers, strings,
    lists and dicts of them), integers within 64 bits, as vLLM's engine can carry them."""
    if value is None:
        return
    if not isinstance(value, dict):
        _fail("extra_args", f"must be a dict, got {type(value).__name__}")
    pending: list[object] = [value]
    seen = 0
    while pending:
        item = pending.pop()
        seen += 1
        if seen > 100_000:
            _fail("extra_args", "holds more than 100000 values")
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                _fail("extra_args", "keys must be strings")
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif _is_int(item) and not INT64_MIN <= item < 2**64:
            _fail("extra_args", f"integers must be between -2**63 and 2**64 - 1, got {item}")
        elif item is not None and not isinstance(item, (bool, int, float, str)):
            _fail("extra_args", f"values must be JSON-like, got {type(item).__name__}")


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    """StructuredOutputsParams as given, or built from a dict of its fields."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as exc:
            _fail("structured_outputs", f"unknown field ({exc})")
    _fail("structured_outputs", f"must be a StructuredOutputsParams, got {type(value).__name__}")


@dataclass
class BeamSearchParams:
    """Beam search with HF transformers' semantics (score = sum logprob / len ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True  # of the beams' text

    def __post_init__(self) -> None:
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        if not _is_int(self.beam_width) or self.beam_width < 1:
            _fail("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check_finite(self, ("temperature", "length_penalty"))
        check_bool(self, ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"))
        if self.temperature < 0.0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            _fail("early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        """The beam width within ``limits`` and every stop token id within the vocabulary."""
        if self.beam_width > limits.max_beam_width:
            _fail("beam_width", f"must be <= {limits.max_beam_width} (the server's limit on beams), "
                  f"got {self.beam_width}")
        check_at_most("stop_token_ids", len(self.stop_token_ids), limits.max_stop_token_ids, "stop token ids")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
