"""Tool-call parsers: generated text -> (content, tool calls), by `--tool-call-parser NAME`.

```
 hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   one call per tag
 smollm2      <tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>  a JSON list per tag
 llama3_json  {"name": "f", "parameters": {...}}; {...}   the whole output (optionally after
                                                          <|python_tag|>), calls separated by ';'
```

`parse(text, final)` is used both for the whole answer (final=True) and for the text streamed so
far (final=False). Both return the content and calls *resolved* so far, in output order: a tag
block becomes calls once it is closed and its JSON is valid; a closed block whose JSON is not a
call is kept as content; an unclosed block, or the end of the text that could still start a tag,
is left unresolved until more text comes, and is content when the text ends. So the content and
calls of a prefix are always prefixes of the final ones, which is what lets streamed deltas add
up to the non-streamed answer. Malformed output never raises: it is content.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class UnknownToolParser(ValueError):
    """--tool-call-parser names no parser."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments_json: str  # a JSON object's text
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ParsedOutput:
    content: str  # resolved content (output order, tag blocks that were calls taken out)
    calls: list[ToolCall]
    resolved_chars: int  # how much of the text has been decided


def call_of(item) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object or its JSON text} -> a ToolCall, else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    name = ""

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        """The text generated so far -> content and calls (final: the generation ended)."""


class TaggedParser(ToolParser):
    """Calls in <tool_call>…</tool_call> blocks anywhere in the text."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    @abstractmethod
    def block_calls(self, body: str) -> list[ToolCall] | None:
        """The calls of one block's body, or None when it is not valid calls."""

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                held = 0 if final else _held_suffix(text[pos:], self.start_tag)
                content.append(text[pos:len(text) - held])
                return ParsedOutput("".join(content), calls, len(text) - held)
            content.append(text[pos:start])
            end = text.find(self.end_tag, start + len(self.start_tag))
            if end < 0:
                if final:
                    content.append(text[start:])
                    return ParsedOutput("".join(content), calls, len(text))
                return ParsedOutput("".join(content), calls, start)
            block = self.block_calls(text[start + len(self.start_tag):end])
            if block is None:
                content.append(text[start:end + len(self.end_tag)])
            else:
                calls.extend(block)
            pos = end + len(self.end_tag)


class HermesParser(TaggedParser):
    name = "hermes"

    def block_calls(self, body: str) -> list[ToolCall] | None:
        call = call_of(_loads(body.strip()))
        return None if call is None else [call]


class SmolLM2Parser(TaggedParser):
    """SmolLM2-Instruct's format: a JSON list of calls per block ('[]': no call)."""

    name = "smollm2"

    def block_calls(self, body: str) -> list[ToolCall] | None:
        value = _loads(body.strip())
        items = value if isinstance(value, list) else [value]
        calls = [call_of(item) for item in items]
        return None if any(call is None for call in calls) else calls


class Llama3JsonParser(ToolParser):
    """The whole output is JSON calls (after an optional <|python_tag|>), separated by ';'."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        stripped = text.lstrip()
        looks_like_calls = stripped.startswith(self.python_tag) or stripped.startswith("{")
        if not final and (looks_like_calls or self.python_tag.startswith(stripped)):
            return ParsedOutput("", [], 0)  # decided only at the end
        if looks_like_calls:
            calls = self._calls(stripped.removeprefix(self.python_tag))
            if calls is not None:
                return ParsedOutput("", calls, len(text))
        return ParsedOutput(text, [], len(text))

    @staticmethod
    def _calls(text: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                value, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return None
            call = call_of(value)
            if call is None:
                return None
            calls.append(call)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos < len(text):
                if text[pos] != ";":
                    return None
                pos += 1


PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesParser, Llama3JsonParser,
                                                                            SmolLM2Parser)}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise UnknownToolParser(f"--tool-call-parser {name!r}: not one of {', '.join(sorted(PARSERS))}") from None
