"""JSON schemas against what the grammar enforces: each document below is checked with
jsonschema and fed through the compiled grammar of the default model's tokenizer, so a
schema keyword the grammar would drop shows up as a document the grammar lets through
although the schema forbids it."""

from __future__ import annotations

import json

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
