"""Conformance of the JSON-schema matcher without a model: over the schemas of
tests/data/structured_output (written for these tests: objects, arrays, tuples, enums, consts,
ranges, patterns, formats, anyOf/oneOf/allOf, $ref and recursion, additional and pattern
properties, unicode), on a vocabulary of the 256 single bytes plus EOS, the compact JSON of every
valid instance is accepted to the end (EOS then allowed) and at least 99 % of the invalid
instances are refused somewhere; keywords the matcher cannot enforce are refused by name when
the schema is compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.scheduler.structured_output.compiler import GrammarCompiler, GrammarError
from pagedserve.scheduler.structured_output.vocabulary import SPECIAL_PREFIX, vocabulary_from_tokens

DATA = Path(__file__).resolve().parent.parent / "data" / "structured_output"
EOS = 256
TOKENS = [bytes([byte]) for byte in range(256)] + [SPECIAL_PREFIX + b"<eos>"]
SCHEMAS = json.loads((DATA / "schemas.json").read_text())


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(lambda: vocabulary_from_tokens(TOKENS, [EOS], [EOS], len(TOKENS)))


def _accepts(grammars: GrammarCompiler, schema, instance) -> bool:
    matcher = grammars.new_matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    data = list(json.dumps(instance, separators=(",", ":"), ensure_ascii=False).encode())
    return matcher.consume_tokens(data) and matcher.is_accepting() and matcher.consume_token(EOS)


def test_valid_instances_are_accepted_and_invalid_ones_refused(grammars):
    num_invalid = num_refused = 0
    wrongly_accepted = []
    for entry in SCHEMAS:
        for instance in entry["valid"]:
            assert _accepts(grammars, entry["schema"], instance), (entry["name"], instance)
        for instance in entry["invalid"]:
            num_invalid += 1
            if _accepts(grammars, entry["schema"], instance):
                wrongly_accepted.append((entry["name"], instance))
            else:
                num_refused += 1
    assert len(SCHEMAS) >= 30 and num_invalid >= 75
    assert num_refused >= 0.99 * num_invalid, wrongly_accepted


@pytest.mark.parametrize("schema", json.loads((DATA / "unsupported.json").read_text()))
def test_unsupported_keywords_are_refused_by_name(grammars, schema):
    with pytest.raises(GrammarError) as raised:
        grammars.template(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    assert raised.value.field_name == "json_schema"
    keyword = next(key for key in ("not", "dependentSchemas", "if", "contains", "uniqueItems", "propertyNames")
                   if f"\"{key}\"" in json.dumps(schema))
    assert keyword in str(raised.value), str(raised.value)
