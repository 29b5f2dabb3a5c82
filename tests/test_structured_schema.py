"""JSON schemas against what the grammar enforces: each document below is checked with
jsonschema and fed through the compiled grammar of the default model's tokenizer, so a
schema keyword the grammar would drop shows up as a document the grammar lets through
although the schema forbids it."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from pagedllm.errors import RequestError
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.grammar import GrammarCompiler, GrammarState
from pagedllm.structured.schema import prepare_schema


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from pagedllm.models.paths import default_model_path
    from pagedllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    return GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, list(tokenizer.eos_token_ids))


def _grammar_accepts(compiler: GrammarCompiler, params: StructuredOutputsParams, document: str) -> bool:
    """Whether the grammar lets ``document`` be the whole output (every byte, then a stop token)."""
    state = GrammarState.start(compiler.compile(params))
    stop = compiler._stop_token_ids[0]
    return state.matcher.accept_string(document) and state.accept(stop)


# (schema, a document it accepts, a document it rejects): the grammar must agree on both.
REWRITTEN = [
    # enum / const beside type: the compiler reads only the values.
    ({"type": "string", "enum": ["a", 1, "b"]}, '"a"', "1"),
    ({"type": "integer", "const": 3}, "3", "4"),
    # a required property that properties does not declare
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": {"type": "boolean"}}, '{"a": 1, "b": true}', '{"a": 1}'),
    ({"type": "object", "required": ["z"]}, '{"z": [1]}', "{}"),
    ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "required": ["n_1"],
      "additionalProperties": False}, '{"n_1": 5}', "{}"),
    # allOf with one subschema, annotated
    ({"allOf": [{"$ref": "#/$defs/small"}], "description": "d", "$defs": {"small": {"type": "integer", "maximum": 3}}},
     "2", "7"),
    (True, '{"any": ["thing"]}', "nope"),
    # format is an annotation: beside a pattern or a length it is dropped, and they are enforced
    ({"type": "string", "format": "email", "pattern": "^a[a-z]*$"}, '"abc"', '"x@y.com"'),
    ({"type": "string", "maxLength": 4, "format": "email"}, '"ab"', '"ab@cd.com"'),
    # propertyNames where no additional property is allowed: checked on the declared names, then dropped
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"maxLength": 2},
      "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
]


@pytest.mark.parametrize(("schema", "good", "bad"), REWRITTEN)
def test_rewritten_schemas_are_enforced_exactly(compiler, schema, good, bad):
    params = StructuredOutputsParams(json=schema)
    assert _grammar_accepts(compiler, params, good)
    jsonschema.validate(json.loads(good), schema)
    assert not _grammar_accepts(compiler, params, bad)
    if bad != "nope":
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(bad))


@pytest.mark.parametrize(
    ("schema", "bad", "words"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
        ({"not": {"type": "integer"}}, "1", "'not'"),
        ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1", "'if'"),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}',
         "'dependentRequired'"),
        ({"type": "number", "multipleOf": 0.5}, "1.3", "'multipleOf'"),
        ({"anyOf": [{"type": "integer"}], "maximum": 2}, "5", "'anyOf' together with 'maximum'"),
        ({"$ref": "#/$defs/i", "maximum": 2, "$defs": {"i": {"type": "integer"}}}, "5", "'$ref' together"),
        ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, "7", "'allOf' with 2 subschemas"),
        ({"enum": [1, 2, 30], "maximum": 5}, "30", "'enum' together with 'maximum'"),
        ({"type": "object", "properties": {"x": {"not": {}}}}, '{"x": 1}', "at #/properties/x"),
        ({"type": "string", "minLength": 2, "pattern": "^a+$"}, '"a"', "'pattern' together with 'minLength'"),
        ({"type": "object", "properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
         '{"ab": "x"}', "matches 'patternProperties' '^a'"),
        ({"type": "object", "patternProperties": {"^[a-c]+$": {"type": "integer"}},
          "propertyNames": {"pattern": "^[a-z]{1,4}$"}}, '{"abcabc": 1}',
         "'propertyNames' together with 'patternProperties'"),
        ({"type": "object", "properties": {"abcdef": {"type": "integer"}}, "propertyNames": {"maxLength": 3}},
         '{"abcdef": 1}', "'abcdef' in 'properties' does not meet 'propertyNames'"),
        ({"type": "object", "propertyNames": {"anyOf": [{"const": "x"}, {"maxLength": 1}]},
          "additionalProperties": {"type": "integer"}}, '{"abc": 1}', "'anyOf' is not supported in 'propertyNames'"),
    ],
)
def test_keywords_the_grammar_would_drop_are_request_errors(compiler, schema, bad, words):
    # The compiler alone lets the invalid document through: the check is what keeps it out.
    raw = GrammarState.start(type(compiler.compile(StructuredOutputsParams(regex="x")))(
        None, compiler._compiler().compile_json_schema(json.dumps(schema), strict_mode=True)))
    assert raw.matcher.accept_string(bad) and raw.accept(compiler._stop_token_ids[0])
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(bad))
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(json=schema)
    assert info.value.param == "structured_outputs.json" and words in str(info.value)


def test_pydantic_schemas_pass_unchanged_where_nothing_is_dropped():
    from enum import Enum
    from typing import Literal

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Inner(BaseModel):
        x: int = Field(ge=0)

    class Outer(BaseModel):
        inner: Inner
        maybe: Inner | None = None
        kind: Literal["a", "b"]
        colors: list[Color]
        counts: dict[str, int]

    schema = Outer.model_json_schema()
    prepared = prepare_schema(schema, "p")
    assert prepared["properties"]["inner"] == schema["properties"]["inner"]
    assert prepared["properties"]["maybe"] == schema["properties"]["maybe"]
    assert prepared["$defs"]["Color"]["enum"] == ["red", "blue"]


@pytest.mark.parametrize(
    ("constraint", "param", "words"),
    [
        ({"json": False}, "structured_outputs.json", "accepts no value"),
        ({"json": {}, "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace", "true or false"),
        ({"json": {"$ref": "https://example.com/s.json"}}, "structured_outputs.json", "within the schema"),
        ({"json": {"type": "object", "required": ["a"], "additionalProperties": False}}, "structured_outputs.json",
         "'a' is not allowed"),
    ],
)
def test_malformed_structured_outputs_name_the_field(constraint, param, words):
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(**constraint)
    assert info.value.param == param and words in str(info.value)


@pytest.mark.parametrize(("kind", "value"), [("regex", r"[^\s\S]"), ("grammar", 'root ::= [^\\x00-\\U0010FFFF]')])
def test_a_constraint_that_matches_nothing_is_a_request_error(compiler, kind, value):
    with pytest.raises(RequestError) as info:
        compiler.compile(StructuredOutputsParams(**{kind: value}))
    assert info.value.param == f"structured_outputs.{kind}" and "matches no output" in str(info.value)


def _enforced_exactly(compiler: GrammarCompiler, schema, good: list[str], bad: list[str]) -> None:
    """The grammar of ``schema`` accepts every ``good`` document (each valid by jsonschema too) and
    refuses every ``bad`` one."""
    params = StructuredOutputsParams(json=schema)
    for document in good:
        assert _grammar_accepts(compiler, params, document), document
        jsonschema.validate(json.loads(document), schema)
    for document in bad:
        assert not _grammar_accepts(compiler, params, document), document


# Strings with minLength / maxLength compile to a counted character rule of their own: each
# character must be one a JSON string may hold (no raw control character), and an escape is one.
@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "string", "minLength": 2}, ['"ab"', '"a\\nb"', '"\\u0041\\"q"', '"é€"'],
         ['"a\x01b"', '"a\tb"', '"\x00\x00"', '"a"', '"\\n"']),
        ({"type": "string", "maxLength": 3}, ['"abc"', '"a\\\\b"', '""', '"\\t\\t\\t"'],
         ['"a\x1fb"', '"abcd"', '"\\t\\t\\t\\t"']),
        ({"type": "object", "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 2}},
          "required": ["k"], "additionalProperties": False},
         ['{"k": "x"}', '{"k": "\\"y"}'], ['{"k": "\x07"}', '{"k": ""}', '{"k": "xyz"}']),
    ],
)
def test_length_bounded_strings_hold_json_characters(compiler, schema, good, bad):
    _enforced_exactly(compiler, schema, good, bad)


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "integer", "minimum": 0, "maximum": 20, "multipleOf": 3}, ["0", "6", "18"], ["7", "21", "-3"]),
        ({"type": "integer", "exclusiveMinimum": -7, "exclusiveMaximum": 10.5, "multipleOf": 5},
         ["-5", "0", "10"], ["-10", "15", "3"]),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1.5, "maximum": 9, "multipleOf": 2,
                                                 "description": "even"}}, "required": ["n"]},
         ['{"n": 2}', '{"n": 8}'], ['{"n": 0}', '{"n": 5}', '{"n": 10}']),
    ],
)
def test_an_integer_range_with_multiple_of_is_its_multiples(compiler, schema, good, bad):
    _enforced_exactly(compiler, schema, good, bad)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "integer", "minimum": 0, "multipleOf": 2}, "both a lower and an upper bound"),
        ({"type": "integer", "exclusiveMaximum": 9, "multipleOf": 2}, "both a lower and an upper bound"),
        ({"type": "integer", "minimum": 0, "maximum": 10**6, "multipleOf": 7}, "allows 142858 values"),
        ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "no multiple of 5 lies in [1, 4]"),
    ],
)
def test_multiple_of_beside_a_range_it_cannot_list_is_a_request_error(schema, words):
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(json=schema)
    assert info.value.param == "structured_outputs.json" and words in str(info.value)


def _random_schema(r, depth=0):
    """A schema of the keywords the grammar enforces, nested up to three levels."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    kinds += ["object", "object", "array", "anyOf", "types", "names"] if depth < 3 else []
    kinds += ["recursive"] if depth == 0 else []  # its $ref points at the root's $defs
    kind, node = r.choice(kinds), {}
    if kind == "string":
        node["type"] = "string"
        if r.random() < 0.3:
            node["pattern"] = r.choice(["^[a-z]{1,3}$", "^\\d{2}-\\d{2}$", "^(yes|no)$", "^a.*z$"])
        else:
            if r.random() < 0.6:
                node["minLength"] = r.randint(0, 3)
            if r.random() < 0.6:
                node["maxLength"] = node.get("minLength", 0) + r.randint(0, 5)
    elif kind in ("integer", "number"):
        node["type"] = kind
        low = r.randint(-40, 40)
        if r.random() < 0.6:
            node[r.choice(["minimum", "exclusiveMinimum"])] = low
        if r.random() < 0.6:
            node[r.choice(["maximum", "exclusiveMaximum"])] = low + r.randint(4, 90)
        if kind == "integer" and r.random() < 0.3 and len(node) in (1, 3):  # none or both bounds
            node["multipleOf"] = r.choice([2, 3, 5])
    elif kind in ("boolean", "null"):
        node["type"] = kind
    elif kind == "enum":
        node["enum"] = r.sample(["a", "b c", 1, 2.5, None, True, {"x": 1}, [1, 2], "é"], r.randint(1, 4))
    elif kind == "const":
        node["const"] = r.choice(["k", 0, None, False, {"a": [1]}, 'quote"d'])
    elif kind == "object":
        node["type"] = "object"
        properties = {f"p{i}{r.choice(['', '_x', ' sp', 'ü'])}": _random_schema(r, depth + 1)
                      for i in range(r.randint(0, 4))}
        if properties:
            node["properties"] = properties
            node["required"] = r.sample(list(properties), r.randint(0, len(properties)))
        node["additionalProperties"] = r.choice([False, False, True, {"type": "integer"}])
    elif kind == "array":
        node["type"] = "array"
        if r.random() < 0.25:
            node["prefixItems"] = [_random_schema(r, depth + 1) for _ in range(r.randint(1, 3))]
            node["items"] = False
        else:
            node["items"] = _random_schema(r, depth + 1)
            node["minItems"] = r.randint(0, 2)
            node["maxItems"] = node["minItems"] + r.randint(0, 3)
    elif kind == "anyOf":
        node["anyOf"] = [_random_schema(r, depth + 1) for _ in range(r.randint(1, 3))]
    elif kind == "names":
        node["type"] = "object"
        if r.random() < 0.5:
            node["patternProperties"] = {"^[a-c]+$": _random_schema(r, depth + 1)}
        else:
            node["propertyNames"] = r.choice([{"pattern": "^[a-z]{1,4}$"}, {"maxLength": 2}, {"enum": ["x", "yy"]}])
        node["additionalProperties"] = r.choice([False, {"type": "integer"}])
        if r.random() < 0.5:
            node["maxProperties"] = r.randint(1, 3)
    elif kind == "recursive":
        node["$defs"] = {"node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
            "required": ["v", "next"], "additionalProperties": False}}
        node["oneOf"] = [{"$ref": "#/$defs/node"}, {"type": "string", "maxLength": 2, "format": "date"}]
    else:
        node["type"] = r.sample(["string", "integer", "null", "boolean", "number"], r.randint(1, 3))
    return node


def _random_output(compiler, grammar, r, vocab: list[bytes], whole, max_tokens: int = 300) -> str | None:
    """Tokens drawn at random among those the grammar allows (``whole``: the tokens that are whole
    UTF-8 characters; short tokens preferred, so that the walk ends), until it allows a stop token
    and the coin says stop; the decoded text, or None if the walk ran out of tokens first."""
    import numpy as np

    state, out = GrammarState.start(grammar), b""
    stops = np.zeros(len(vocab), dtype=bool)
    stops[compiler._stop_token_ids] = True
    for step in range(max_tokens):
        allowed = np.unpackbits(np.frombuffer(state.next_row(), dtype=np.uint8), bitorder="little")[: len(vocab)]
        allowed = allowed.astype(bool)
        stop = np.flatnonzero(allowed & stops)
        chars = np.flatnonzero(allowed & whole & ~stops)
        if len(stop) and (not len(chars) or r.random() < 0.5 or step > 150):
            assert state.accept(int(stop[0]))
            return out.decode()
        assert len(chars), f"the grammar allows no token after {out!r}"
        sample = [int(chars[r.randrange(len(chars))]) for _ in range(24)]
        token = min(sample, key=lambda t: len(vocab[t])) if r.random() < 0.7 else sample[0]
        assert state.accept(token)
        out += vocab[token]
    return None


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_random_schemas_random_walks_give_valid_documents(compiler):
    """Whatever path decoding takes through a schema's grammar, a finished output is a JSON document
    the schema accepts (jsonschema, with the formats it knows unchecked as the spec's default).
    SCHEMA_SEED in the environment draws another set of schemas."""
    import random

    import xgrammar as xgr

    vocab = xgr.TokenizerInfo.from_huggingface(compiler._hf_tokenizer, vocab_size=compiler.vocab_size,
                                               stop_token_ids=compiler._stop_token_ids).decoded_vocab
    import numpy as np

    whole = np.array([_whole_utf8(v) for v in vocab] + [False] * (compiler.vocab_size - len(vocab)))
    r = random.Random(int(os.environ.get("SCHEMA_SEED", "2026")))
    finished = 0
    for _ in range(30):
        schema = _random_schema(r)
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        for _ in range(3):
            text = _random_output(compiler, grammar, r, vocab, whole)
            if text is None:
                continue
            finished += 1
            jsonschema.validate(json.loads(text), schema)  # raises with the document and the keyword
    assert finished >= 60  # most walks end: the check ran on many documents


BACKTRACKS = "(a|aa)+$"  # exponential in Python's re on a run of a's that ends otherwise
LONG_NAME = "a" * 60 + "!"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {LONG_NAME: {}}, "propertyNames": {"pattern": BACKTRACKS}},
    {"type": "object", "properties": {LONG_NAME: {"type": "integer"}},
     "patternProperties": {BACKTRACKS: {"type": "string"}}},
    {"type": "object", "required": [LONG_NAME], "patternProperties": {BACKTRACKS: {}}},
])
def test_a_pattern_that_backtracks_without_bound_is_refused_in_time(schema):
    """A client's pattern meets a client's property name with a time limit: the check refuses what
    would otherwise hold the server's interpreter for hours."""
    import time

    began = time.monotonic()
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(json=schema)
    assert time.monotonic() - began < 5
    assert "takes too long to match" in str(info.value) and info.value.param == "structured_outputs.json"


def test_property_names_keywords_are_checked_on_declared_names():
    ok = {"type": "object", "properties": {"ab": {}}, "propertyNames": {"type": "string", "maxLength": 2}}
    StructuredOutputsParams(json=ok)
    ok = {"type": "object", "properties": {"ab": {}}, "propertyNames": {"enum": ["ab", "c"]}}
    StructuredOutputsParams(json=ok)
    for names in ({"const": "x"}, {"minLength": 3}, {"type": "integer"}, {"pattern": "^z"}, False):
        with pytest.raises(RequestError, match="does not meet 'propertyNames'"):
            StructuredOutputsParams(json={"type": "object", "properties": {"ab": {}}, "propertyNames": names})
