"""Every user-facing failure of pagedllm is one of these.

They subclass the builtin a caller would naturally catch (``ValueError`` for
bad input) so that code written against vLLM's behaviour keeps working.
"""

from __future__ import annotations


class PagedLLMError(Exception):
    """Base class of all pagedllm errors."""


class ConfigError(PagedLLMError, ValueError):
    """An engine or model option is invalid; the message says which and why."""


class ModelLoadError(PagedLLMError):
    """Weights, config or tokenizer could not be found or read."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The checkpoint's architecture is not one pagedllm implements."""


class RequestError(PagedLLMError, ValueError):
    """A request cannot be served as given (bad parameter, prompt too long, ...).

    ``param`` names the offending field when there is one, so the server can
    put it in the OpenAI error object.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BlockManagerError(PagedLLMError):
    """The KV memory manager was misused (double free, unknown sequence, ...).

    Running out of blocks is *not* an error: ``can_allocate`` / ``can_append_slots``
    answer that question.
    """


class EngineDeadError(PagedLLMError):
    """The engine loop stopped after an unrecoverable error."""
