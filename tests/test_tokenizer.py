import json
import random
import shutil
import time

import pytest

from pagedllm.errors import ModelLoadError, RequestError
from pagedllm.models.paths import default_model_path
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Crème brûlée, naïve café, señor, Ångström, œuvre.",
    "日本語のテキストと中文文本，还有한국어도 있습니다。",
    "Emoji: 👋🌍🎉 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵!",
    "Mixed: ∑x² ≤ ∞ — “quotes” … 🤖 done\n\twith  spaces",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("pagedllm_cache")


@pytest.fixture(scope="module")
def tok(cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(cache_root))
        return Tokenizer.load(default_model_path())


def stream(tok, ids, chunk_sizes=None, **kwargs):
    """Feeds ids to a detokenizer; returns it and the deltas taken after every step."""
    detok = IncrementalDetokenizer(tok, tok.encode("Write:"), **kwargs)
    deltas, i = [], 0
    while i < len(ids):
        size = chunk_sizes() if chunk_sizes else 1
        stop = detok.add_tokens(ids[i : i + size])
        deltas.append(detok.take_delta())
        i += size
        if stop is not None:
            break
    return detok, deltas


# ------------------------------------------------------------ Tokenizer


def test_basic_attributes(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2 and tok.eos_token_ids == (2,)
    assert tok.convert_ids_to_tokens(tok.encode(" hello", add_special_tokens=False)) == ["Ġhello"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_id_to_piece_is_decoded_text(tok):
    (token,) = tok.encode(" hello", add_special_tokens=False)
    assert tok.id_to_piece(token) == " hello"
    assert tok.id_to_piece(2) == "<|im_end|>"


def test_decode_one_is_decode_of_one_id_for_each_skip_setting(tok):
    (token,) = tok.encode(" hello", add_special_tokens=False)
    for token_id in (token, 2, 2, token):  # twice each: the memoised answer is the same
        for skip in (True, False):
            assert tok.decode_one(token_id, skip) == tok.decode([token_id], skip)
    assert (tok.decode_one(2, True), tok.decode_one(2, False)) == ("", "<|im_end|>")


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    prompt = tok.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without == prompt.removesuffix("<|im_start|>assistant\n")


def test_chat_template_joins_text_parts(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
    )
    assert "<|im_start|>user\na\nb<|im_end|>" in prompt


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_malformed_messages_raise_request_error(tok, messages):
    with pytest.raises(RequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_missing_chat_template_raises_request_error(tok, monkeypatch):
    monkeypatch.setattr(tok.hf, "chat_template", None)
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


# ------------------------------------------------------------ loading and cache


def test_second_gguf_load_is_served_from_cache(tok, cache_root, monkeypatch):
    import transformers

    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache_root))
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        calls.append((str(path), kwargs))
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    start = time.perf_counter()
    again = Tokenizer.load(default_model_path())
    elapsed = time.perf_counter() - start
    assert again.source == tok.source
    assert again.source.parent == cache_root / "tokenizers"
    assert calls == [(str(tok.source), {})]  # no GGUF conversion
    assert elapsed < 2.0
    assert again.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert again.apply_chat_template([{"role": "user", "content": "x"}]) == tok.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )
    assert not [p for p in (cache_root / "tokenizers").iterdir() if p.name.startswith(".tmp")]


def test_a_copy_of_the_gguf_shares_the_cached_tokenizer(tok, cache_root, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache_root))
    copy = tmp_path / default_model_path().name
    shutil.copyfile(default_model_path(), copy)  # a second install: another path and mtime
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(str(path)) or real(path, **kw)
    )
    assert Tokenizer.load(copy).source == tok.source
    assert calls == [str(tok.source)]  # read from the cache, not converted again


def test_hf_directory_with_generation_config(tok, tmp_path):
    tok.hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.load(tmp_path)
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.source == tmp_path
    assert loaded.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_load_errors_say_what_is_missing(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.load(tmp_path)
    with pytest.raises(ModelLoadError, match="not a .gguf file or a directory"):
        Tokenizer.load(tmp_path / "missing.gguf")


# ------------------------------------------------------------ IncrementalDetokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    final = detok.flush()
    assert final == tok.decode(ids) == text
    assert "".join(deltas) + detok.take_delta() == final


def test_multibyte_characters_are_split_across_tokens(tok):
    # guards the tests above: single tokens of these texts really are partial characters
    ids = tok.encode(TEXTS[3], add_special_tokens=False)
    assert any("\ufffd" in tok.id_to_piece(i) for i in ids)


def test_random_chunks_match_full_decode(tok):
    rng = random.Random(0)
    text = " ".join(TEXTS)
    ids = tok.encode(text, add_special_tokens=False)
    for _ in range(5):
        detok, deltas = stream(tok, ids, chunk_sizes=lambda: rng.randint(1, 4))
        assert detok.flush() == text
        assert "".join(deltas) + detok.take_delta() == text


def test_special_tokens_in_output(tok):
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    skipped, _ = stream(tok, ids)
    kept, _ = stream(tok, ids, skip_special_tokens=False)
    assert skipped.flush() == "Hi"
    assert kept.flush() == "Hi<|im_end|>"


def test_decodes_a_bounded_window_per_step(tok, monkeypatch):
    ids = tok.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    sizes = []
    real = tok.decode

    def spy(token_ids, skip_special_tokens=True):
        sizes.append(len(token_ids))
        return real(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    detok, _ = stream(tok, ids)
    assert len(ids) > 300
    assert max(sizes) <= 12  # the longest character here spans a handful of tokens
    monkeypatch.undo()
    assert detok.flush() == tok.decode(ids)


def test_stop_string_spanning_tokens_truncates(tok):
    text = "The answer is forty-two. END OF ANSWER and more text"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "END OF ANSWER"
    assert all(stop not in tok.id_to_piece(i) for i in ids)  # really spans tokens
    detok, deltas = stream(tok, ids, stop=[stop])
    assert detok.stop_reason == stop and detok.finished
    assert detok.text == "The answer is forty-two. "
    assert detok.flush() == "The answer is forty-two. "
    assert "".join(deltas) + detok.take_delta() == "The answer is forty-two. "
    assert detok.add_tokens(ids[:3]) == stop  # later tokens change nothing
    assert detok.flush() == "The answer is forty-two. "


def test_include_stop_str_in_output(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok, deltas = stream(tok, ids, stop=["o th"], include_stop_str_in_output=True)
    assert detok.flush() == "one two th"
    assert "".join(deltas) + detok.take_delta() == "one two th"


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", "beta"])
    assert detok.add_tokens(ids) == "beta"
    assert detok.flush() == "alpha "


def test_multibyte_stop_string(tok):
    ids = tok.encode("你好世界再见", add_special_tokens=False)
    detok, _ = stream(tok, ids, stop=["世界"])
    assert detok.stop_reason == "世界"
    assert detok.flush() == "你好"


def test_possible_stop_prefix_is_held_back_until_flush(tok):
    ids = tok.encode("Result: 42 ##", add_special_tokens=False)
    detok, deltas = stream(tok, ids, stop=["###"])
    assert detok.stop_reason is None
    assert detok.text == "Result: 42 "  # "##" could still become "###"
    assert "".join(deltas) == "Result: 42 "
    assert detok.flush() == "Result: 42 ##"
    assert detok.take_delta() == "##"
    assert detok.take_delta() == ""


def test_no_stop_strings_hold_nothing_back(tok):
    ids = tok.encode("abc #", add_special_tokens=False)
    detok, _ = stream(tok, ids)
    assert detok.text == "abc #"


def test_decode_pair_is_decode_of_the_two_ids(tok):
    rng = random.Random(0)
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.id_to_piece(i)]
    added = sorted(tok.hf.added_tokens_decoder)  # the special tokens: skipped or not
    assert partial and added
    pool = ids + partial + added + [rng.randrange(tok.vocab_size) for _ in range(300)]
    pairs = list(zip(ids, ids[1:])) + [(rng.choice(pool), rng.choice(pool)) for _ in range(3000)]
    for first, second in pairs:
        for skip in (True, False):
            assert tok.decode_pair(first, second, skip) == tok.decode([first, second], skip), (first, second)
