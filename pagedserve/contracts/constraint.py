"""A structured-output constraint on a request's completions (no torch, no protobuf).

One of five kinds, as the public APIs name them (gRPC `SamplingParams.constraint`, HTTP
`response_format` / `structured_outputs`):

    json_schema   `value` is a JSON Schema (text); the output is one JSON value it accepts
    json_object   any JSON object (`value` empty)
    regex         `value` is a regular expression the whole output matches
    choice        `choices`: the output is exactly one of these strings
    grammar       `value` is a Lark grammar (llguidance's dialect; GBNF is converted by the
                  frontend when it recognises it)

The scheduler compiles it into a token matcher (pagedserve.scheduler.structured_output); here
it is only data, with the size limits every process applies before compiling anything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 forces it


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    value: str = ""  # schema, regex or grammar text; empty for json_object and choice
    choices: tuple[str, ...] = field(default_factory=tuple)

    @property
    def field_name(self) -> str:
        """The request field that carries it, for error messages."""
        return self.kind.value

    @property
    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.kind.value, self.value, self.choices)

    def check_size(self) -> str | None:
        """Why this constraint is too large to compile, or None."""
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            return f"at most {MAX_CONSTRAINT_CHARS} characters"
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                return "needs at least one choice"
            if len(self.choices) > MAX_CHOICES:
                return f"at most {MAX_CHOICES} choices"
            if any(len(choice) > MAX_CHOICE_CHARS for choice in self.choices):
                return f"a choice has at most {MAX_CHOICE_CHARS} characters"
        elif self.kind is not ConstraintKind.JSON_OBJECT and not self.value.strip():
            return "must not be empty"
        return None
