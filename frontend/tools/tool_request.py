"""The tools of a chat request, its tool_choice, and the constraint that forces a call.

```
 tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
 tool_choice    none       tools not rendered, output not parsed: never a call
                auto       (the default with tools) rendered, parsed; needs --enable-auto-tool-choice
                required   rendered, parsed, and forced: the output is one or more calls
                {"type": "function", "function": {"name": N}}   forced: one or more calls of N
 parallel_tool_calls false  a forced output holds exactly one call
```

A forced choice becomes a grammar constraint (llguidance Lark with an inline %json schema per
call) that writes calls in the --tool-call-parser's format, so the parser always finds them; a
call's JSON is written with json.dumps' separators and no other whitespace; its arguments
follow the tool's `parameters` schema (with additionalProperties false at the
top when the schema leaves it open, so the model cannot ramble in extra keys; the output still
validates against the schema as given).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.contracts.constraint_grammar import check_constraint
from pagedserve.contracts.sampling_params import InvalidParameter

MAX_TOOLS = 128  # OpenAI's limit
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
# A forced call's JSON is written as the templates show calls (json.dumps' separators, no other
# whitespace): a small model cannot pad it with newlines and indentation until max_tokens.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                     "coerce_one_of": True}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict | None = None  # JSON Schema of the arguments object
    strict: bool = False

    def template_value(self) -> dict:
        """The tool as chat templates take it (transformers' JSON-schema shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object",
                                                                                        "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The frontend's flags: --tool-call-parser and --enable-auto-tool-choice."""

    parser: str | None = None
    enable_auto: bool = False


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...]
    choice: str  # none | auto | required | function
    function_name: str | None = None  # the named function of choice "function"
    parallel: bool = True

    @property
    def is_active(self) -> bool:
        """Tools rendered and the output parsed."""
        return self.choice != "none"

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict]:
        return [tool.template_value() for tool in self.tools]


def parse_tools(tools: Any, field_name: str = "tools") -> tuple[ToolSpec, ...]:
    if not isinstance(tools, list):
        raise InvalidParameter(field_name, "must be an array of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter(field_name, f"at most {MAX_TOOLS} tools")
    specs, names = [], set()
    for index, tool in enumerate(tools):
        where = f"{field_name}[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidParameter(f"{where}.type", 'must be "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidParameter(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidParameter(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise InvalidParameter(f"{where}.function.name", f"{name!r} is defined twice")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidParameter(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidParameter(f"{where}.function.parameters", "must be a JSON Schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParameter(f"{where}.function.strict", "must be a boolean")
        specs.append(ToolSpec(name, description or "", parameters, bool(strict)))
    return tuple(specs)


def parse_tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any,
                       settings: ToolSettings) -> ToolRequest | None:
    """The request's tools and choice checked against the server's flags; None without tools."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidParameter("parallel_tool_calls", "must be a boolean")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "needs tools")
        return None
    specs = parse_tools(tools)
    function_name = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidParameter("tool_choice", 'must be "none", "auto", "required" or '
                                                  '{"type": "function", "function": {"name": …}}')
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        choice, function_name = "function", tool_choice["function"]["name"]
        if function_name not in {spec.name for spec in specs}:
            raise InvalidParameter("tool_choice.function.name", f"{function_name!r} is not one of the tools")
    else:
        raise InvalidParameter("tool_choice", 'must be "none", "auto", "required" or '
                                              '{"type": "function", "function": {"name": …}}')
    if choice != "none" and settings.parser is None:
        raise InvalidParameter("tool_choice", f'"{tool_choice if isinstance(tool_choice, str) else choice}" '
                               "needs a server started with --tool-call-parser NAME")
    if choice == "auto" and not settings.enable_auto:
        raise InvalidParameter("tool_choice", '"auto" needs a server started with --enable-auto-tool-choice '
                               '(or send tool_choice "required", "none" or a named function)')
    return ToolRequest(specs, choice, function_name, parallel=parallel_tool_calls is not False)


def _arguments_schema(tool: ToolSpec) -> dict:
    schema = dict(tool.parameters) if tool.parameters is not None else {"type": "object", "properties": {}}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def call_schema(request: ToolRequest, arguments_key: str = "arguments") -> dict:
    """One call of the allowed tools: {"name": const, arguments_key: the tool's parameters}."""
    tools = [tool for tool in request.tools if request.function_name in (None, tool.name)]
    alternatives = [{"type": "object", "properties": {"name": {"const": tool.name},
                                                      arguments_key: _arguments_schema(tool)},
                     "required": ["name", arguments_key], "additionalProperties": False} for tool in tools]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def forced_constraint(request: ToolRequest, parser: str) -> Constraint:
    """A grammar whose every output is calls in `parser`'s format."""
    many = request.parallel
    if parser == "smollm2":
        body = '"<tool_call>[\\n" call (",\\n" call)* "\\n]</tool_call>"' if many else \
            '"<tool_call>[\\n" call "\\n]</tool_call>"'
        schema = call_schema(request)
    elif parser == "hermes":
        body = 'block ("\\n" block)*' if many else "block"
        body += '\nblock: "<tool_call>\\n" call "\\n</tool_call>"'
        schema = call_schema(request)
    elif parser == "llama3_json":
        body = 'call ("; " call)*' if many else "call"
        schema = call_schema(request, "parameters")
    else:
        raise InvalidParameter("tool_choice", f"the tool-call parser {parser!r} cannot force calls")
    schema = {"x-guidance": CALL_JSON_OPTIONS, **schema}
    constraint = Constraint(ConstraintKind.GRAMMAR, value=f"start: {body}\ncall: %json {json.dumps(schema)}")
    try:
        check_constraint(constraint)  # compiled without the vocabulary: a schema that cannot is a 400 here
    except InvalidParameter as exc:
        raise InvalidParameter("tools", f"the parameters of the tools cannot be enforced: "
                                        f"{str(exc).split(': ', 1)[-1]}") from None
    return constraint


def history_tool_calls(calls: list[dict], field_name: str) -> list[dict]:
    """An assistant message's OpenAI tool_calls as templates take them: arguments as an object
    (transformers' convention; OpenAI sends its JSON text)."""
    out = []
    for index, call in enumerate(calls):
        where = f"{field_name}[{index}]"
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidParameter(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise InvalidParameter(f"{where}.function.name", "must be a non-empty string")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise InvalidParameter(f"{where}.function.arguments", "must be a JSON object's text") from None
        if not isinstance(arguments, dict):
            raise InvalidParameter(f"{where}.function.arguments", "must be a JSON object's text")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidParameter(f"{where}.id", "must be a string")
        out.append({"id": call_id or f"call_{index}", "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out
