"""A constraint's llguidance grammar, and the check every process can make without a vocabulary.

    json_schema  -> llguidance's JSON compiler (coerce_one_of: oneOf is treated as anyOf)
    json_object  -> the schema {"type": "object"}
    regex        -> a regex grammar (the whole output matches)
    choice       -> a Lark grammar `start: "a" | "b" | ...`
    grammar      -> Lark as llguidance reads it (GBNF is converted by the frontend)

check_constraint() compiles the grammar without a vocabulary under the parser limits, so the
frontend refuses a schema that cannot compile (naming the field) before it reaches a scheduler;
the scheduler compiles it again against the model's tokens (scheduler/structured_output/).
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.contracts.sampling_params import InvalidParameter

# Tighter than llguidance's defaults where a schema could make compiling or one mask step expensive.
PARSER_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000)

# Any JSON object (json_object, OpenAI's "JSON mode").
JSON_OBJECT_SCHEMA = {"type": "object"}
JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": True}


class GrammarError(InvalidParameter):
    """A constraint that does not compile; `field_name` names the request field."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked against a vocabulary)."""
    kind = constraint.kind
    try:
        if kind is ConstraintKind.JSON_SCHEMA:
            schema = json.loads(constraint.value)
            if schema is False:
                raise GrammarError(kind.value, "the schema false accepts nothing")
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError(kind.value, "a JSON schema is an object (or true)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.value)
        if kind is ConstraintKind.CHOICE:
            alternatives = " | ".join(json.dumps(choice) for choice in constraint.choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(constraint.value))
    except json.JSONDecodeError as exc:
        raise GrammarError(kind.value, f"not valid JSON: {exc}") from exc
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # the GBNF converter's errors too
        raise GrammarError(kind.value, str(exc)) from exc


def check_constraint(constraint: Constraint) -> None:
    """Raises InvalidParameter (GrammarError) when the constraint is too large or does not compile."""
    problem = constraint.check_size()
    if problem is not None:
        raise GrammarError(constraint.field_name, problem)
    grammar = grammar_text(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    if is_error:
        raise GrammarError(constraint.field_name, messages[0] if messages else "does not compile")
