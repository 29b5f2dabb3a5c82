"""What one request may cost: the limits checked before any work is done for it.

Two small frozen dataclasses hold every bound, so that a deployment changes
them in one place (``pagedllm serve`` has a flag for each):

* :class:`RequestLimits` bounds the parameters of one request. The engine
  checks them in ``add_request``, for the offline API and the server alike.
* :class:`ServerLimits` bounds what one HTTP client may hold: body size,
  prompts per request, JSON nesting, open connections, and the time a stream
  may sit unread or a request may run.

Every check raises :class:`RequestError` whose message names the field and
the limit, so a client knows what to change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

from pagedllm.errors import ConfigError, RequestError

# Integer fields travel to torch as int64 (seeds included).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# OpenAI's range for a logit bias.
MAX_ABS_LOGIT_BIAS = 100.0
# Sampling parameters reach the sampler as float32: a value outside float32's normal
# range would round to 0 or inf there (top_p 1e-300 would keep no token at all).
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38
# The roles a chat message may have (OpenAI's; function is its deprecated spelling of tool).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_DECIMAL = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on the parameters of one request (counts, not bytes).

    ``max_n`` caps ``n`` and ``best_of`` (the sequences sampled for one
    prompt); ``max_beam_width`` the beams of a beam search; ``max_stop`` the
    stop strings and ``max_stop_chars`` the length of each (and of each bad word);
    ``max_stop_token_ids`` and ``max_logit_bias`` the entries of those lists
    (``max_logit_bias`` also the bad words); ``max_logprobs`` the top-logprobs per
    position (OpenAI's 20). allowed_token_ids is bounded by the vocabulary.
    """

    max_n: int = 128
    max_beam_width: int = 32
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        _all_positive(self)


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one HTTP client may hold; sizes in bytes, times in seconds.

    ``max_body_bytes``: larger bodies are refused with 413 before they are read
    in full. ``max_prompts``: prompts in one ``/v1/completions`` request.
    ``max_json_depth``: nesting of arrays and objects in a body.
    ``max_connections``: open HTTP connections; past it new ones get 503.
    ``stream_stall_timeout_s``: a stream whose client has not taken the last
    event for this long is aborted and its KV blocks freed.
    ``request_timeout_s``: the most a request may run, streamed or not
    (``None``: no limit). ``keep_alive_timeout_s``: an idle connection is closed
    after this long. ``body_read_timeout_s``: the most a client may take to send
    its request body. ``grammar_compile_timeout_s`` / ``grammar_compile_memory_bytes``:
    the most time and memory compiling one new grammar (a JSON schema, regex or
    EBNF of a request) may take; past them the request gets HTTP 400.
    """

    max_body_bytes: int = 4 * 2**20
    max_prompts: int = 64
    max_json_depth: int = 32
    max_connections: int = 1024
    stream_stall_timeout_s: float = 60.0
    request_timeout_s: float | None = None
    keep_alive_timeout_s: float = 5.0
    body_read_timeout_s: float = 30.0
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        _all_positive(self)


def _all_positive(limits: object) -> None:
    for f in fields(limits):  # type: ignore[arg-type]
        value = getattr(limits, f.name)
        if value is None and "None" in str(f.type):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{f.name} must be a positive number, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be finite, got {value!r}")


def _fail(param: str, message: str) -> None:
    raise RequestError(f"{param}: {message}", param=param)


def check_at_most(param: str, count: int, limit: int, what: str) -> None:
    """``count`` items of ``what`` are allowed up to ``limit``; the message names both."""
    if count > limit:
        _fail(param, f"at most {limit} {what} are allowed per request, got {count}")


def is_int(value: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(token_ids: Iterable[object], vocab_size: int, param: str) -> None:
    """Every id is an int in [0, vocab_size); the message shows the first bad one."""
    for position, token in enumerate(token_ids):
        if not is_int(token) or not 0 <= token < vocab_size:  # type: ignore[operator]
            _fail(
                param,
                f"token ids must be integers in [0, {vocab_size}) (this model's vocabulary); "
                f"got {token!r} at position {position}",
            )


def check_sampling_lists(allowed_token_ids: list | None, bad_words: list | None, limits: RequestLimits,
                         vocab_size: int) -> None:
    """allowed_token_ids within the vocabulary (and no longer than it), and at most
    ``max_logit_bias`` bad words of at most ``max_stop_chars`` characters each."""
    if allowed_token_ids:
        check_at_most("allowed_token_ids", len(allowed_token_ids), vocab_size, "allowed token ids (the vocabulary's size)")
        check_token_ids(allowed_token_ids, vocab_size, "allowed_token_ids")
    if bad_words:
        check_at_most("bad_words", len(bad_words), limits.max_logit_bias, "bad words")
        longest = max(len(w) for w in bad_words)
        if longest > limits.max_stop_chars:
            _fail("bad_words", f"each bad word may have at most {limits.max_stop_chars} characters, got {longest}")


def check_text(text: str, param: str) -> None:
    """Text must be encodable as UTF-8 (JSON can carry lone surrogates, which are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _fail(param, f"the text is not valid Unicode ({exc.reason} at character {exc.start})")


def check_float32(value: float, param: str) -> None:
    """``value`` is 0 or within float32's normal range, so the sampler sees the number asked for."""
    if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
        _fail(param, f"must be 0 or between {FLOAT32_TINY:.3g} and {FLOAT32_MAX:.3g} in magnitude "
                     f"(a 32-bit float), got {value!r}")


def parse_token_id_key(key: object, param: str) -> int:
    """A token id given as a mapping key: an int, or its decimal digits as a string (JSON keys).

    Strict: ``" 1"``, ``"1_0"``, ``"+1"`` and non-ASCII digits, which ``int()`` accepts, are refused.
    """
    if is_int(key):
        return key  # type: ignore[return-value]
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    _fail(param, f"keys must be token ids (integers, or their decimal digits as strings), got {key!r}")
    raise AssertionError  # unreachable


def check_bool(owner: object, names: Iterable[str]) -> None:
    """Every named field is a bool (``"no"`` or ``None`` would be truthy or break deeper down)."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            _fail(name, f"must be true or false, got {value!r}")
