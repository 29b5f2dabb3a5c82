"""Tokenizer loading, chat templates and incremental detokenization.

``Tokenizer`` wraps a transformers fast tokenizer. A GGUF file's tokenizer is
converted once by transformers and saved under the pagedllm cache, because the
conversion takes seconds and loading the saved copy takes a fraction of that.

``IncrementalDetokenizer`` turns generated token ids into text one step at a
time. It decodes only a short window of recent ids per step (O(new tokens)),
never shows half of a multi-byte UTF-8 character and finds stop strings that
span token boundaries.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagedllm.chat import check_documents, normalise_messages
from pagedllm.errors import ModelLoadError, RequestError
from pagedllm.models.paths import cache_dir, content_digest

logger = logging.getLogger(__name__)

# What a byte-level decoder yields for bytes that are not (yet) valid UTF-8.
_REPLACEMENT_CHAR = "\ufffd"
# Prompt ids decoded ahead of the first output token, so that it is decoded in
# context (e.g. tokenizers that drop a leading space at the start of the text).
_NUM_CONTEXT_IDS = 5


class Tokenizer:
    """A loaded tokenizer plus the ids the engine needs (EOS set, vocabulary size)."""

    def __init__(self, hf, *, source: Path, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf  # transformers PreTrainedTokenizerFast (TokenizersBackend in transformers 5)
        self.source = source  # directory the tokenizer files were read from
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        self._backend = hf.backend_tokenizer  # the Rust tokenizer: decoding without Python overhead
        self._single_texts: dict[tuple[int, bool], str] = {}  # (id, skip_special_tokens) -> text
        # A byte-level decoder turns each token into its bytes and decodes their
        # concatenation, so two texts that are whole characters decode joined.
        self._byte_level = type(self._backend.decoder).__name__ == "ByteLevel"
        self._added_ids = frozenset(hf.added_tokens_decoder)  # special or user-added: never joined
        self._joinable_texts: dict[int, str | None] = {}  # id -> text when joining it is exact, else None

    @classmethod
    def load(cls, model_path: Path) -> Tokenizer:
        """From an HF model directory or a ``.gguf`` file (converted once, then cached)."""
        model_path = Path(model_path)
        if model_path.is_file() and model_path.suffix == ".gguf":
            source = _cached_gguf_tokenizer_dir(model_path)
            return cls(_from_pretrained(source), source=source)
        if model_path.is_dir():
            if not any((model_path / name).is_file() for name in _TOKENIZER_FILES):
                raise ModelLoadError(
                    f"{model_path} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
                )
            return cls(
                _from_pretrained(model_path),
                source=model_path,
                extra_eos_token_ids=_generation_config_eos_ids(model_path),
            )
        raise ModelLoadError(
            f"cannot load a tokenizer from {model_path}: not a .gguf file or a directory"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, exactly what IncrementalDetokenizer produces for them."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id], skip_special_tokens)``, memoised: the text of one id never changes."""
        key = (token_id, skip_special_tokens)
        text = self._single_texts.get(key)
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=skip_special_tokens)
            self._single_texts[key] = text
        return text

    def decode_pair(self, first: int, second: int, skip_special_tokens: bool = True) -> str:
        """``decode([first, second], skip_special_tokens)``, the usual detokenizer step.

        Under a byte-level decoder it is the two ids' texts joined, when both are
        whole characters (no U+FFFD) of ordinary vocabulary (not added tokens, the
        only ones skip_special_tokens can drop): no call into the tokenizer then.
        """
        if self._byte_level:
            texts = self._joinable_texts
            try:
                first_text, second_text = texts[first], texts[second]
            except KeyError:
                first_text, second_text = self._joinable_text(first), self._joinable_text(second)
            if first_text is not None and second_text is not None:
                return first_text + second_text
        return self._backend.decode([first, second], skip_special_tokens=skip_special_tokens)

    def _joinable_text(self, token_id: int) -> str | None:
        """The text of ``token_id`` when decode_pair may join it to a neighbour's, else None (memoised)."""
        if token_id not in self._joinable_texts:
            text = None
            if token_id not in self._added_ids:
                text = self.decode_one(token_id, skip_special_tokens=False)
                if _REPLACEMENT_CHAR in text:
                    text = None
            self._joinable_texts[token_id] = text
        return self._joinable_texts[token_id]

    def id_to_piece(self, token_id: int) -> str:
        """Decoded text of one token (``" hello"``, not ``"Ġhello"``), for logprob dicts.

        A token holding part of a multi-byte character decodes to U+FFFD, as in vLLM.
        """
        return self.decode_one(token_id, skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: int | Sequence[int]) -> str | list[str]:
        """The vocabulary's raw token strings (``"Ġhello"``), as in transformers."""
        return self.hf.convert_ids_to_tokens(token_ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Renders OpenAI-style messages into a prompt string with ``chat_template``
        (Jinja text) when given, else the model's chat template.

        ``tools`` (OpenAI's list) reach a template that renders them; for one
        that does not, they are described in the system message (Hermes style).
        ``documents`` (retrieval results: dicts of strings such as ``title`` and
        ``text``, checked by :func:`pagedllm.chat.check_documents`) reach the
        template as ``documents``, as in transformers.
        """
        template = chat_template or self.hf.chat_template
        if not template:
            raise RequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        normalised = normalise_messages(messages)
        if tools:
            normalised, kwargs = _with_tools(template, normalised, tools, kwargs)
        if documents:
            kwargs = {**kwargs, "documents": check_documents(documents)}
        try:
            return self.hf.apply_chat_template(
                normalised, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **kwargs,
            )
        except Exception as exc:  # jinja2 raises its own errors for template-level failures
            raise RequestError(f"chat template failed: {exc}", param="messages") from exc


def _with_tools(template: str, messages: list[dict], tools: list[dict], kwargs: dict) -> tuple[list[dict], dict]:
    from pagedllm.structured.tools import parse_tools, render_tools_into_messages

    if "tools" in template:
        return messages, {**kwargs, "tools": tools}
    return render_tools_into_messages(messages, parse_tools(tools)), kwargs


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _from_pretrained(path: Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from exc


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), [] when absent."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _cached_gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """Directory holding the GGUF file's tokenizer in HF format, created on first use.

    The key is the file's content, so every copy of one model shares a
    directory. It is written under a temporary name and renamed, so a reader
    never sees half of it.
    """
    root = cache_dir() / "tokenizers"
    target = root / f"{gguf_path.stem}-{content_digest(gguf_path)[:16]}"
    if (target / "tokenizer_config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    hf = _from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        hf.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        # Another process renamed its copy first, or the cache is read-only.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"cannot write the tokenizer cache under {root}") from None
    logger.info("cached the tokenizer of %s in %s", gguf_path.name, target)
    return target


class IncrementalDetokenizer:
    """Turns a stream of token ids into text; never emits a broken UTF-8 character;
    finds stop strings that span tokens.

    Decoding keeps two offsets into ``_ids`` (a few prompt ids, then the output):
    ``[prefix, read)`` is text already emitted, kept as context, and ``[read, end)``
    is not yet emitted. Each step decodes ``[prefix, end)`` and emits what it adds
    to the decoding of ``[prefix, read)`` unless that ends in an incomplete
    character, in which case the ids wait for the next token.

    Text shown (``text``, ``take_delta``) holds back the longest tail that could
    still become a stop string, so streamed text never has to be taken back.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Fast (Rust) tokenizers decode special tokens without extra spaces either way,
        # as in transformers and vLLM; kept so the parameter is accepted.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_IDS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._output_text = ""
        self._num_safe_chars = 0  # length of the prefix of the output text shown now
        self._num_delivered_chars = 0  # length already returned by take_delta
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False

    @property
    def text(self) -> str:
        """All output text that is safe to show now."""
        return self._output_text[: self._num_safe_chars]

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Appends generated tokens; returns the stop string that matched, else None.

        After a match the text is final (truncated at the stop string, or just after
        it with include_stop_str_in_output) and later tokens are ignored.
        """
        if self.finished:
            return self.stop_reason
        start = len(self._output_text)
        for token_id in token_ids:
            self._ids.append(token_id)
            self._decode_pending(final=False)
        return self._after_new_text(start)

    def flush(self) -> str:
        """At finish: the complete text, releasing what was held back."""
        if not self.finished:
            start = len(self._output_text)
            self._decode_pending(final=True)
            self._after_new_text(start)
            self.finished = True
            self._num_safe_chars = len(self._output_text)
        return self._output_text

    def take_delta(self) -> str:
        """New safe text since the previous call (for streaming)."""
        delta = self._output_text[self._num_delivered_chars : self._num_safe_chars]
        self._num_delivered_chars = self._num_safe_chars
        return delta

    def _decode_pending(self, *, final: bool) -> None:
        """Emits the text of ids past the read offset once it ends in a whole character."""
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return
        tokenizer = self._tokenizer
        skip = self._skip_special_tokens
        if read - prefix == 1 and len(ids) - read == 1:
            # The usual step: the context is the single id emitted last step, and one id is new.
            prefix_text = tokenizer.decode_one(ids[prefix], skip)
            full_text = tokenizer.decode_pair(ids[prefix], ids[read], skip)
        else:
            prefix_text = tokenizer.decode(ids[prefix:read], skip)
            full_text = tokenizer.decode(ids[prefix:], skip)
        if not final and (
            len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)
        ):
            return  # nothing visible yet, or an incomplete character at the end
        self._output_text += full_text[len(prefix_text) :]
        self._prefix_offset = read
        self._read_offset = len(ids)

    def _after_new_text(self, start: int) -> str | None:
        """Looks for a stop string in text added from ``start``; updates what is safe to show."""
        if not self._stop:  # nothing to find and nothing to hold back
            self._num_safe_chars = len(self._output_text)
            return None
        match = self._find_stop(start)
        if match is not None:
            position, stop = match
            end = position + len(stop) if self._include_stop else position
            self._output_text = self._output_text[:end]
            self._num_safe_chars = end
            self.stop_reason = stop
            self.finished = True
            return stop
        self._num_safe_chars = len(self._output_text) - self._held_back_len()
        return None

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in text added from ``start``."""
        best: tuple[int, str] | None = None
        text = self._output_text
        for stop in self._stop:
            position = text.find(stop, max(0, start - len(stop) + 1))
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _held_back_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._output_text
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
