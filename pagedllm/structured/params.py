"""What a request constrains its output to, with vLLM's field names.

Exactly one constraint is set. ``spec()`` turns it into a ``GrammarSpec``:
the grammar kind and its canonical text, which is also the key the compiled
grammar is cached under (two requests with the same schema share one).
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.structured.schema import prepare_schema

_FIELD = "structured_outputs"


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar to compile: ``kind`` is json_schema, regex, ebnf or json_object; ``text`` its source."""

    kind: str
    text: str
    any_whitespace: bool = True


@dataclass
class StructuredOutputsParams:
    """One of: a JSON schema (dict, boolean or JSON text), a regex, a list of choices, an EBNF grammar,
    or ``json_object=True`` (any JSON object).

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between
    tokens), which keeps small models from wandering off into blank space.

    With ``SamplingParams.min_tokens``: the stop is banned until min_tokens
    outputs only while the grammar allows something else; when the output is
    a complete match that may only end, the grammar's end wins (the sampler
    lifts the ban for that row) and the sequence stops shorter, "stop".
    """

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if _is_set(name, getattr(self, name))]
        if len(given) != 1:
            raise RequestError(
                f"{_FIELD}: give exactly one of json, regex, choice, grammar or json_object"
                f" (got {', '.join(given) if given else 'none'})",
                param=_FIELD,
            )
        self._check_types(given[0])

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if _is_set(name, getattr(self, name)))

    def _check_types(self, kind: str) -> None:
        value = getattr(self, kind)
        param = f"{_FIELD}.{kind}"
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError(f"{_FIELD}.disable_any_whitespace: must be true or false",
                               param=f"{_FIELD}.disable_any_whitespace")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = jsonlib.loads(value)
                except ValueError as exc:
                    raise RequestError(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
            elif not isinstance(value, (dict, bool)):
                raise RequestError(f"{param}: must be a JSON schema (an object or its JSON text)", param=param)
            # What the compiler enforces exactly; what it cannot is an error here, not a looser answer.
            self._schema = prepare_schema(value, param)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise RequestError(f"{param}: must be a non-empty string", param=param)
        if kind == "choice" and (
            not isinstance(value, (list, tuple)) or not value
            or any(not isinstance(c, str) or not c for c in value)
        ):
            raise RequestError(f"{param}: must be a non-empty list of non-empty strings", param=param)
        if kind == "json_object" and value is not True:
            raise RequestError(f"{param}: must be true when given", param=param)

    def spec(self) -> GrammarSpec:
        kind = self.kind
        ws = not self.disable_any_whitespace
        if kind == "json":
            # Property order is kept: it is the order the output writes them in.
            return GrammarSpec("json_schema", jsonlib.dumps(self._schema), ws)
        if kind == "regex":
            return GrammarSpec("regex", self.regex, ws)
        if kind == "choice":
            # EBNF string literals take JSON's escapes; one alternative per choice.
            return GrammarSpec("ebnf", "root ::= " + " | ".join(jsonlib.dumps(c) for c in self.choice), ws)
        if kind == "grammar":
            return GrammarSpec("ebnf", self.grammar, ws)
        return GrammarSpec("json_object", "", ws)

    @property
    def param(self) -> str:
        """The field a compile error is reported against."""
        return f"{_FIELD}.{self.kind}"


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _is_set(kind: str, value: Any) -> bool:
    """Whether a constraint field is given (json_object=False is not; json=False is the schema false)."""
    return value is not None if kind == "json" else value is not None and value is not False
