"""Property-based fuzzing of the HTTP API against a real ``pagedllm serve`` process.

Hypothesis generates request bodies: arbitrary JSON (wrong types, huge and tiny
numbers, deep nesting, odd Unicode and lone surrogates), objects with the real
field names and random values, and valid requests with one field spoiled. For
every case: no 5xx (in the status or in a streamed error event), an answer
within the time limit, OpenAI's error object on every 4xx, and /health green
afterwards. At the end no request runs or waits and no KV block is held.

The default run sends a bounded number of cases to a tiny random-weight Llama
(fast to start and to run); the ``slow`` run sends many more to the default model.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixture import ServerProcess
from tiny_models import save_tiny_llama

NUM_CASES = int(os.environ.get("PAGEDLLM_FUZZ_CASES", "80"))
NUM_SLOW_CASES = int(os.environ.get("PAGEDLLM_FUZZ_SLOW_CASES", "1500"))
VOCAB = 256
CASE_TIMEOUT_S = 60.0

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_llama(directory) -> None:
    """A 2-layer random Llama with a word-level tokenizer of VOCAB words and a chat template."""
    save_tiny_llama(directory, vocab_size=VOCAB, chat_template=CHAT_TEMPLATE)


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

# Every code point, surrogates included (json.dumps escapes them as \udxxx).
ODD_TEXT = st.text(st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["", "\ud800", "\udfff", "a\ud83d", "\x00", "\u202e", "💥" * 8, "t1 t2 t3", "ｔ", "\ufeff"]
)
NUMBERS = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, VOCAB, VOCAB - 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 1e-310, 1e308, -1e308, 0.5, 100.0, 100.5, -100.5])
)
SCALARS = st.none() | st.booleans() | NUMBERS | ODD_TEXT
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(ODD_TEXT, children, max_size=4),
    max_leaves=12,
)


@st.composite
def deep(draw):
    depth = draw(st.integers(min_value=1, max_value=300))
    value = draw(SCALARS)
    for _ in range(depth):
        value = [value] if draw(st.booleans()) else {"k": value}
    return value


FIELD_VALUES = JSON | deep()
COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "top_k", "min_p", "repetition_penalty",
    "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "use_beam_search", "length_penalty", "cache_salt", "echo", "logprobs", "suffix",
]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "logprobs", "suffix")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
]

GOOD_PROMPT = st.sampled_from(["t5 t6 t7", "hello world", "t9"]) | st.lists(
    st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=24
)
GOOD_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": st.sampled_from(["t5 t6", "hi", ""])}),
    min_size=1, max_size=3,
)


def good_completion() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"prompt": GOOD_PROMPT | st.lists(GOOD_PROMPT, min_size=1, max_size=3),
         "max_tokens": st.integers(min_value=1, max_value=12)},
        optional={
            "n": st.integers(min_value=1, max_value=4), "temperature": st.floats(0, 2), "stream": st.booleans(),
            "seed": st.integers(min_value=0, max_value=2**63 - 1), "logprobs": st.integers(0, 5),
            "stop": st.lists(st.sampled_from(["t3", "t4"]), max_size=2), "echo": st.booleans(),
            "use_beam_search": st.booleans(), "ignore_eos": st.booleans(),
            "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
        },
    )


def good_chat() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"messages": GOOD_MESSAGES, "max_tokens": st.integers(min_value=1, max_value=12)},
        optional={"n": st.integers(1, 3), "stream": st.booleans(), "logprobs": st.booleans(),
                  "top_logprobs": st.integers(0, 3), "temperature": st.floats(0, 2)},
    )


@st.composite
def spoiled(draw, good: st.SearchStrategy[dict], fields: list[str]) -> dict:
    """A valid body with one field replaced by anything."""
    body = dict(draw(good))
    body[draw(st.sampled_from(fields))] = draw(FIELD_VALUES)
    return body


@st.composite
def known_fields(draw, fields: list[str]) -> dict:
    names = draw(st.lists(st.sampled_from(fields), max_size=6, unique=True))
    return {name: draw(FIELD_VALUES) for name in names}


ROUTES = {
    "/v1/completions": (good_completion(), COMPLETION_FIELDS),
    "/v1/chat/completions": (good_chat(), CHAT_FIELDS),
    "/tokenize": (st.fixed_dictionaries({"prompt": GOOD_PROMPT.filter(lambda p: isinstance(p, str))}),
                  ["prompt", "messages", "add_special_tokens", "model"]),
    "/detokenize": (st.fixed_dictionaries({"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=8)}),
                    ["tokens", "model"]),
}


@st.composite
def cases(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(list(ROUTES)))
    good, fields = ROUTES[path]
    body = draw(
        st.one_of(
            good,
            spoiled(good, fields),
            known_fields(fields),
            JSON,
            deep(),
        )
    )
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 19)) == 0:  # now and then not JSON at all
        raw = draw(st.sampled_from([raw[: len(raw) // 2], b"\xff\xfe" + raw, b"NaN", b"{" * 2000, raw + b"}"]))
    return path, raw


# ---------------------------------------------------------------------------
# The check for one case
# ---------------------------------------------------------------------------


def check_case(server: ServerProcess, client: httpx.Client, path: str, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    with client.stream("POST", f"{server.base_url}{path}", content=raw, headers=headers,
                       timeout=CASE_TIMEOUT_S) as response:
        body = response.read()
    status = response.status_code
    assert status < 500, f"{status} for {raw[:300]!r}: {body[:500]!r}"
    if status >= 400:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"], body
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[5:].strip() for line in body.decode().splitlines() if line.startswith("data:")]
        assert events and events[-1] == "[DONE]", body[-300:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk or chunk["error"]["type"] != "server_error", event
    else:
        json.loads(body)
    assert client.get(f"{server.base_url}/health", timeout=10).status_code == 200


def assert_clean_end(server: ServerProcess) -> None:
    m = server.wait_idle(timeout=60)
    assert m["pagedllm:num_requests_running"] == 0
    assert m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0  # no leaked block
    assert server.proc.poll() is None
    assert "Traceback" not in server.log(), server.log()


def fuzz(server: ServerProcess, num_cases: int) -> None:
    client = httpx.Client()

    @settings(max_examples=num_cases, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def one(case):
        check_case(server, client, *case)

    try:
        one()
    finally:
        client.close()
    assert_clean_end(server)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory)
    server = ServerProcess(
        "--model", str(directory), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256",
        "--block-size", "8", "--max-num-seqs", "32", "--max-body-bytes", "65536",
    )
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_fuzzed_requests_never_5xx_hang_or_leak(tiny_server):
    fuzz(tiny_server, NUM_CASES)


@pytest.mark.slow
def test_fuzzed_requests_on_the_default_model():
    server = ServerProcess("--num-kv-blocks", "512", "--max-num-seqs", "32").wait_ready()
    try:
        fuzz(server, NUM_SLOW_CASES)
    finally:
        code = server.stop()
    assert code == 0, server.log()
