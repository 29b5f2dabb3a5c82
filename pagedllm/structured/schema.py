"""JSON schemas checked against what the grammar compiler (xgrammar) can enforce.

xgrammar compiles many schemas it does not fully enforce: some keywords are
dropped without a word (``uniqueItems``, ``not``, ``if``/``then``/``else``,
``dependentRequired``, ...), and a schema with ``$ref``, ``allOf``, ``anyOf``,
``oneOf``, ``enum`` or ``const`` is compiled from that keyword alone, its
other validation keywords ignored. Output decoded under such a grammar can
break the schema the client sent. ``prepare_schema`` rewrites the cases that
have an exact equivalent and rejects the rest with a RequestError that names
the keyword and where it is, so no answer is silently less constrained than
its schema.

Rewritten:

- ``enum`` / ``const`` with ``type``: the values of another type are dropped.
- ``required`` names an undeclared property: it is declared, with the schema
  ``patternProperties`` / ``additionalProperties`` give it (the compiler runs
  in strict mode, where an undeclared property is never written).
- ``allOf`` with one subschema and nothing else to check: that subschema.
- an integer's ``multipleOf`` beside a range (the compiler keeps only the range):
  the ``enum`` of the multiples in the range, when both ends are given and it
  holds at most ``MAX_MULTIPLES`` values (an error otherwise).

Every schema is first checked against the JSON Schema metaschema
(``check_json_schema``): ``{"type": "foo"}`` or ``"properties": 5`` is an
error naming where it is, whether or not a grammar enforces the schema.

Rejected: ``uniqueItems``, ``not``, ``if``/``then``/``else``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, ``contains``/``minContains``/``maxContains``,
``allOf`` with several subschemas,
``multipleOf`` on non-integers, ``$ref`` outside the schema, and validation
keywords beside ``$ref``/``allOf``/``anyOf``/``oneOf``/``enum``/``const``, and
``minProperties`` above the number of properties an object may have (the
compiler writes no property that ``properties`` does not declare unless
``additionalProperties`` or ``patternProperties`` allows it).
Also rejected: ``pattern`` beside ``minLength``/``maxLength`` (only the pattern
would be checked); ``propertyNames`` beside ``patternProperties``, with keywords
other than one string schema's, or that a name in ``properties`` breaks; a name
in ``properties`` that a ``patternProperties`` pattern matches with another
schema. Dropped, as nothing is lost: ``format`` (an annotation in 2020-12)
beside ``pattern`` or a length; ``propertyNames`` where no additional property
is allowed, once the declared names meet it.
``oneOf`` is enforced as ``anyOf``: a document matching several branches
passes (disjoint branches, such as a discriminated union, are exact).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any

from pagedllm.errors import RequestError

# Keywords the compiler drops (their presence would leave the output unchecked).
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "$dynamicRef", "$recursiveRef", "contains", "minContains", "maxContains")
# Keywords that constrain a value (everything else is an annotation: title, description, default, ...).
_VALIDATION = frozenset({
    "type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains", "minContains", "maxContains",
    "unevaluatedItems", "uniqueItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format",
    *_UNENFORCED,
})
# Keywords compiled alone: any other validation keyword beside them is ignored by the compiler.
_EXCLUSIVE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SCHEMA = ("additionalProperties", "propertyNames", "unevaluatedProperties", "items", "additionalItems",
           "contains", "unevaluatedItems")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")

# What a propertyNames schema may use: the compiler applies these to the names it writes.
_NAME_KEYWORDS = ("type", "pattern", "minLength", "maxLength", "format", "enum", "const")
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_MULTIPLES = 1024  # an integer range with multipleOf becomes an enum of at most this many values


# A client's patterns are matched against its property names within a time budget for the whole
# schema: Python's re backtracks without limit (``(a|aa)+$`` on 60 characters runs for hours,
# holding the interpreter), and many slow matches would add up.
PATTERN_BUDGET_S = 0.25


def _is_integral(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


_JSON_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def check_json_schema(schema: Any, where: str, param: str | None = None) -> None:
    """RequestError(``param``, default ``where``) unless ``schema`` is a valid JSON Schema: valid
    against its ``$schema`` draft's metaschema, 2020-12 when it names none. The message starts with
    ``where`` and says at which keyword the schema breaks the metaschema."""
    from jsonschema.exceptions import best_match

    error = best_match(_metaschema_validator(schema.get("$schema") if isinstance(schema, dict) else None)
                       .iter_errors(schema))
    if error is None:
        return
    at = "#" + "".join(f"/{_escape(str(part))}" for part in error.absolute_path)
    raise RequestError(f"{where}: not a valid JSON Schema: at {at}: {error.message}", param=param or where)


@functools.lru_cache(maxsize=8)
def _metaschema_validator(draft: Any):
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    with warnings.catch_warnings():  # an unknown "$schema" is checked as 2020-12
        warnings.simplefilter("ignore")
        cls = validator_for({"$schema": draft} if isinstance(draft, str) else {}, default=Draft202012Validator)
    return cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)


def prepare_schema(schema: Any, param: str) -> Any:
    """``schema`` (a JSON value) as the compiler should see it; RequestError(param) for what it cannot enforce.

    ``true`` is the empty schema; ``false`` (no value at all) is an error.
    """
    if isinstance(schema, (dict, bool)):
        check_json_schema(schema, param)
    if schema is True:
        return {}
    if schema is False:
        raise RequestError(f"{param}: the schema false accepts no value", param=param)
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema is an object, got {type(schema).__name__}", param=param)
    return _Walker(param).schema(schema, "#")


class _Walker:
    def __init__(self, param: str) -> None:
        self.param = param
        self.pattern_budget = PATTERN_BUDGET_S  # seconds of pattern matching this schema may still take

    def error(self, where: str, message: str) -> RequestError:
        return RequestError(f"{self.param}: at {where}: {message}", param=self.param)

    def matches(self, pattern: str, name: str, where: str) -> bool | None:
        """Whether ``pattern`` matches somewhere in ``name`` (JSON Schema's search); None when it does
        not compile (the compiler reports it). RequestError when the schema's matches together take
        longer than PATTERN_BUDGET_S."""
        import regex  # here: `import pagedllm` does not load it

        began = time.monotonic()
        try:
            return regex.search(pattern, name, timeout=max(self.pattern_budget, 1e-3)) is not None
        except regex.error:
            return None
        except TimeoutError:
            raise self.error(where, f"pattern {pattern!r} takes too long to match {name!r} (it backtracks "
                                    "without bound, or the schema's patterns and names are too many); simplify "
                                    "it") from None
        finally:
            self.pattern_budget -= time.monotonic() - began

    def schema(self, node: Any, where: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise self.error(where, f"a schema is an object or a boolean, got {type(node).__name__}")
        node = dict(node)
        for keyword in _UNENFORCED:
            if keyword in node:
                raise self.error(where, f"'{keyword}' is not supported (it cannot be enforced while decoding)")
        if node.get("uniqueItems") is True:
            raise self.error(where, "'uniqueItems' is not supported (it cannot be enforced while decoding)")
        node.pop("uniqueItems", None)  # false: no constraint
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise self.error(where, f"'$ref' {ref!r}: only references within the schema ('#/...') are supported")
        if "multipleOf" in node and node.get("type") != "integer":
            raise self.error(where, "'multipleOf' is only supported with \"type\": \"integer\"")
        node = self._single_all_of(node, where)
        node = self._bounded_multiples(node, where)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise self.error(where, f"'allOf' with {len(node['allOf'])} subschemas is not supported (the compiler "
                                    "ignores it); merge them into one schema")
        node = self._typed_values(node, where)
        self._check_exclusive(node, where)
        node = self._string_assertions(node, where)
        self._check_pattern_overlap(node, where)
        node = self._declare_required(node, where)
        node = self._property_names(node, where)
        self._check_min_properties(node, where)
        for key in _SCHEMA:
            if key in node:
                node[key] = self.schema(node[key], f"{where}/{key}")
        for key in _SCHEMA_LIST:
            if isinstance(node.get(key), list):
                node[key] = [self.schema(sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key])]
        for key in _SCHEMA_MAP:
            if isinstance(node.get(key), dict):
                node[key] = {name: self.schema(sub, f"{where}/{key}/{_escape(name)}") for name, sub in node[key].items()}
        return node

    def _single_all_of(self, node: dict, where: str) -> dict:
        """``allOf: [S]`` with no other validation keyword is S (annotations kept)."""
        all_of = node.get("allOf")
        if not isinstance(all_of, list) or len(all_of) != 1 or not isinstance(all_of[0], dict):
            return node
        if any(key in _VALIDATION for key in node if key != "allOf"):
            return node  # reported by _check_exclusive
        merged = {key: value for key, value in node.items() if key != "allOf"}
        merged.update(all_of[0])
        return merged

    def _bounded_multiples(self, node: dict, where: str) -> dict:
        """An integer's ``multipleOf`` beside a range: the compiler keeps the range and drops the
        ``multipleOf``, so a range with both ends becomes the ``enum`` of its multiples (up to
        MAX_MULTIPLES of them); anything else is an error."""
        bounds = [key for key in _RANGE if key in node]
        if "multipleOf" not in node or not bounds or "enum" in node or "const" in node:
            return node
        step = node["multipleOf"]
        if not _is_integral(step):
            raise self.error(where, f"'multipleOf' {step!r} beside {bounds[0]!r}: only a whole step is supported")
        step = int(step)
        lows, highs = [], []
        if "minimum" in node:
            lows.append(math.ceil(node["minimum"]))
        if "exclusiveMinimum" in node:
            lows.append(math.floor(node["exclusiveMinimum"]) + 1)
        if "maximum" in node:
            highs.append(math.floor(node["maximum"]))
        if "exclusiveMaximum" in node:
            highs.append(math.ceil(node["exclusiveMaximum"]) - 1)
        low, high = max(lows, default=None), min(highs, default=None)
        if low is None or high is None:
            raise self.error(where, f"'multipleOf' beside {'/'.join(repr(b) for b in bounds)} is supported only "
                                    "with both a lower and an upper bound")
        first = -(-low // step) * step
        count = max(0, (high - first) // step + 1)
        if count == 0:
            raise self.error(where, f"no multiple of {step} lies in [{low}, {high}]")
        if count > MAX_MULTIPLES:
            raise self.error(where, f"'multipleOf' {step} in [{low}, {high}] allows {count} values; beside a range "
                                    f"it is supported up to {MAX_MULTIPLES} of them")
        rewritten = {key: value for key, value in node.items() if key not in ("type", "multipleOf", *_RANGE)}
        rewritten["enum"] = list(range(first, high + 1, step))
        return rewritten

    def _typed_values(self, node: dict, where: str) -> dict:
        """``enum`` / ``const`` beside ``type``: only the values of that type remain."""
        if "type" not in node or not ("enum" in node or "const" in node):
            return node
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        checks = [_JSON_TYPES.get(t) for t in types]
        if any(check is None for check in checks):
            return node  # an unknown type: the compiler reports it
        node = dict(node)
        del node["type"]
        if "const" in node:
            if not any(check(node["const"]) for check in checks):
                raise self.error(where, f"'const' {node['const']!r} is not of type {'/'.join(types)}")
            return node
        if isinstance(node["enum"], list):
            values = [v for v in node["enum"] if any(check(v) for check in checks)]
            if not values:
                raise self.error(where, f"no 'enum' value is of type {'/'.join(types)}")
            node["enum"] = values
        return node

    def _check_exclusive(self, node: dict, where: str) -> None:
        present = [key for key in _EXCLUSIVE if key in node]
        if not present:
            return
        others = [key for key in node if key in _VALIDATION and key != present[0]]
        if others:
            raise self.error(
                where,
                f"'{present[0]}' together with {', '.join(repr(k) for k in others)} is not supported "
                f"(the compiler would check only '{present[0]}'); move the other keywords into its subschemas",
            )

    def _string_assertions(self, node: dict, where: str) -> dict:
        """The compiler enforces one of ``pattern``, ``format`` and the length bounds of a string:
        ``pattern`` over the others, ``format`` over the lengths. ``format`` is an annotation
        (JSON Schema 2020-12 asserts it only under the format-assertion vocabulary), so beside a
        ``pattern`` or a length it is dropped and they are enforced; a ``pattern`` beside a length
        is an error."""
        lengths = [key for key in ("minLength", "maxLength") if key in node]
        if "pattern" in node and lengths:
            raise self.error(where, f"'pattern' together with {' and '.join(repr(k) for k in lengths)} is not "
                                    "supported (the compiler would check only 'pattern'); write the length into "
                                    "the pattern (for example ^[a-z]{2,8}$)")
        if "format" in node and ("pattern" in node or lengths):
            return {key: value for key, value in node.items() if key != "format"}
        return node

    def _check_pattern_overlap(self, node: dict, where: str) -> None:
        """A property in ``properties`` whose name a ``patternProperties`` pattern matches must meet both
        schemas; the compiler checks only the first."""
        properties, patterns = node.get("properties"), node.get("patternProperties")
        if not isinstance(properties, dict) or not isinstance(patterns, dict):
            return
        for name, sub in properties.items():
            for pattern, pattern_sub in patterns.items():
                matched = self.matches(pattern, name, where)  # None: the compiler reports the pattern
                if matched and pattern_sub != sub and pattern_sub is not True and pattern_sub != {}:
                    raise self.error(where, f"property {name!r} is declared in 'properties' and matches "
                                            f"'patternProperties' {pattern!r}: the compiler would check only the "
                                            "first; merge the two schemas into the one in 'properties'")

    def _property_names(self, node: dict, where: str) -> dict:
        """``propertyNames``: enforced on the names the compiler makes up (additional properties), with
        the keywords of one string schema; not on names ``properties`` declares, nor beside
        ``patternProperties``. Where no additional property is allowed, the compiler would make some
        up all the same: there the names are checked here and the keyword dropped."""
        names = node.get("propertyNames")
        if names is None or names is True:
            return node
        if isinstance(node.get("patternProperties"), dict) and node["patternProperties"]:
            raise self.error(where, "'propertyNames' together with 'patternProperties' is not supported (the "
                                    "compiler would not check the names); fold the names into the patterns")
        if isinstance(names, dict):
            unsupported = [key for key in names if key in _VALIDATION and key not in _NAME_KEYWORDS]
            if unsupported:
                raise self.error(f"{where}/propertyNames", f"{', '.join(repr(k) for k in unsupported)} is not "
                                                           "supported in 'propertyNames' (the compiler would not "
                                                           f"check it); use {', '.join(_NAME_KEYWORDS)}")
        for name in node.get("properties") or {}:
            if not self._name_meets(names, name, f"{where}/propertyNames"):
                raise self.error(where, f"property {name!r} in 'properties' does not meet 'propertyNames' (the "
                                        "compiler would write it anyway); rename it or drop it")
        if node.get("additionalProperties") is False or node.get("unevaluatedProperties") is False:
            return {key: value for key, value in node.items() if key != "propertyNames"}
        return node

    def _name_meets(self, names: Any, name: str, where: str) -> bool:
        """Whether property name ``name`` meets the propertyNames schema ``names`` (one string schema's
        keywords; ``format`` is an annotation)."""
        if names is False:
            return False
        if not isinstance(names, dict):
            return True
        types = names.get("type", "string")
        if "string" not in (types if isinstance(types, list) else [types]):
            return False
        if "enum" in names and name not in names["enum"]:
            return False
        if "const" in names and name != names["const"]:
            return False
        if isinstance(names.get("minLength"), int) and len(name) < names["minLength"]:
            return False
        if isinstance(names.get("maxLength"), int) and len(name) > names["maxLength"]:
            return False
        return not isinstance(names.get("pattern"), str) or self.matches(names["pattern"], name, where) is not False

    def _check_min_properties(self, node: dict, where: str) -> None:
        """``minProperties`` above what the object may hold: the compiler refuses it, without saying where."""
        minimum = node.get("minProperties")
        if not isinstance(minimum, int) or isinstance(minimum, bool) or node.get("patternProperties"):
            return
        if node.get("additionalProperties", node.get("unevaluatedProperties", False)) is not False:
            return
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if minimum > len(properties):
            names = ", ".join(repr(name) for name in properties) or "none"
            raise self.error(
                where,
                f"'minProperties' {minimum} cannot be met: the object may hold only the {len(properties)} "
                f"properties declared in 'properties' ({names}); declare more, or allow others with "
                "'additionalProperties'",
            )

    def _declare_required(self, node: dict, where: str) -> dict:
        required = node.get("required")
        if not isinstance(required, list):
            return node
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if not missing:
            return node
        properties = dict(properties)
        for name in missing:
            properties[name] = self._undeclared_schema(node, name, where)
        return {**node, "properties": properties}

    def _undeclared_schema(self, node: dict, name: str, where: str) -> Any:
        """The schema an undeclared property ``name`` gets from patternProperties / additionalProperties."""
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            matching = []
            for pattern, sub in patterns.items():
                matched = self.matches(pattern, name, where)
                if matched is None:
                    return {}  # the compiler reports the pattern
                if matched:
                    matching.append(sub)
            if len(matching) == 1:
                return matching[0]
            if matching:
                raise self.error(where, f"required property {name!r} matches several patternProperties")
        extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
        if extra is False:
            raise self.error(where, f"required property {name!r} is not allowed (additionalProperties is false)")
        return {} if extra is True else extra


def _escape(name: str) -> str:
    """A name as a JSON pointer token."""
    return name.replace("~", "~0").replace("/", "~1")
