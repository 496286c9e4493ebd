"""The structured-output fields of an OpenAI body -> a Constraint and a logit_bias, or
InvalidParameter naming the field the client used.

```
 field                                             constraint
 response_format {"type": "text"}                  none
 response_format {"type": "json_object"}           json_object (any JSON object)
 response_format {"type": "json_schema",           json_schema (name and strict accepted; strict
   "json_schema": {"name", "schema", "strict"}}      false is constrained all the same)
 structured_outputs {"json": schema}               json_schema      (vLLM)
 structured_outputs {"regex" | "choice" |          regex | choice | grammar | json_object
   "grammar" | "json_object"}
 guided_json | guided_regex | guided_choice |      the same (vLLM's removed names, served as aliases)
   guided_grammar
 logit_bias {"token id": bias}                     bias in [-100, 100], added to the logit
```

At most one constraint per request. Each is compiled without the vocabulary here (check_constraint),
so a schema that cannot compile is a 400 before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.contracts.constraint_grammar import check_constraint
from pagedserve.contracts.sampling_params import InvalidParameter

_STRUCTURED_KEYS = {"json": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX,
                    "choice": ConstraintKind.CHOICE, "grammar": ConstraintKind.GRAMMAR,
                    "json_object": ConstraintKind.JSON_OBJECT}
# structured_outputs options that change nothing when left at these values
_STRUCTURED_NO_OPS = {"disable_fallback": (False, None), "disable_any_whitespace": (False, None),
                      "disable_additional_properties": (False, None), "whitespace_pattern": (None,),
                      "structural_tag": (None,), "backend": (None, "auto", "guidance")}
_GUIDED = {"guided_json": ConstraintKind.JSON_SCHEMA, "guided_regex": ConstraintKind.REGEX,
           "guided_choice": ConstraintKind.CHOICE, "guided_grammar": ConstraintKind.GRAMMAR}


def parse_constraint(body) -> Constraint | None:
    """The one constraint the body asks for (compiled once to check it), or None."""
    found: list[tuple[str, Constraint]] = []
    if body.response_format is not None:
        constraint = _response_format(body.response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _constraint(name, kind, value)))
    if len(found) > 1:
        raise InvalidParameter(found[1][0], f"only one constraint per request ({found[0][0]} is set already)")
    if not found:
        return None
    name, constraint = found[0]
    try:
        check_constraint(constraint)
    except InvalidParameter as exc:
        raise InvalidParameter(name, str(exc)) from None
    return constraint


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON) -> {id: bias}; ranges are checked
    with the other sampling parameters."""
    out: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidParameter("logit_bias", f"key {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidParameter("logit_bias", f"the bias of token {key} must be a number")
        out[token_id] = float(bias)
    return out


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidParameter("response_format", 'must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind != "json_schema":
        raise InvalidParameter("response_format", f'type {kind!r} is not supported ("text", "json_object" '
                                                  'or "json_schema")')
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidParameter("response_format.json_schema", 'is required: {"name", "schema", "strict"}')
    schema = spec.get("schema")
    if schema is None:
        schema = {}  # OpenAI: a missing schema allows any JSON value
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameter("response_format.json_schema.schema", "must be a JSON Schema object")
    return Constraint(ConstraintKind.JSON_SCHEMA, value=json.dumps(schema))


def _structured_outputs(value: Any) -> list[tuple[str, Constraint]]:
    if not isinstance(value, dict):
        raise InvalidParameter("structured_outputs", "must be an object")
    found = []
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if key in _STRUCTURED_KEYS:
            if item is None or key == "json_object" and item is False:
                continue
            found.append((name, _constraint(name, _STRUCTURED_KEYS[key], item)))
        elif key in _STRUCTURED_NO_OPS:
            if item not in _STRUCTURED_NO_OPS[key]:
                raise InvalidParameter(name, "is not supported")
        else:
            raise InvalidParameter(name, "is not a structured_outputs field (json, regex, choice, grammar, "
                                         "json_object)")
    return found


def _constraint(name: str, kind: ConstraintKind, value: Any) -> Constraint:
    if kind is ConstraintKind.JSON_OBJECT:
        if value is not True:
            raise InvalidParameter(name, "must be true")
        return Constraint(kind)
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise InvalidParameter(name, "must be an array of strings")
        return Constraint(kind, choices=tuple(value))
    if kind is ConstraintKind.JSON_SCHEMA:
        if isinstance(value, (dict, bool)):
            return Constraint(kind, value=json.dumps(value))
        if isinstance(value, str):
            return Constraint(kind, value=value)
        raise InvalidParameter(name, "must be a JSON Schema (an object, or its JSON text)")
    if not isinstance(value, str):
        raise InvalidParameter(name, "must be a string")
    return Constraint(kind, value=value)
