"""Streamed tool calls: the chat deltas of one choice, as OpenAI streams them.

```
 text so far ──parser.parse(final=False)──▶ resolved content and calls
   {"content": "…"}                                   content not sent yet (trailing whitespace held)
   {"tool_calls": [{"index", "id", "type": "function",
                    "function": {"name", "arguments": ""}}]}   once per call, when its block closes
   {"tool_calls": [{"index", "function": {"arguments": "{…}"}}]}
 end of text ──parse(final=True)──▶ the rest (an unclosed tag is content)
```

A partial tag (`<tool_c`) or an open block is held back until it is known to be a call or not,
and the parser's prefix property (tool_parsers.py) makes the concatenated deltas equal the
non-streamed answer of the same text: `final_message` gives that answer.
"""

from __future__ import annotations

from pagedserve.frontend.tools.tool_parsers import ParsedOutput, ToolCall, ToolParser


def message_content(parsed: ParsedOutput) -> str | None:
    """The message's content: None when there are calls and nothing but whitespace around them."""
    if parsed.calls and not parsed.content.strip():
        return None
    return parsed.content


def tool_call_body(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


class ToolStream:
    """Feeds a choice's text pieces; returns the deltas to send."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self.calls: list[ToolCall] = []  # sent so far (ids kept)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, piece: str) -> list[dict]:
        self._text += piece
        parsed = self._parser.parse(self._text, final=False)
        return self._deltas(parsed, len(parsed.content.rstrip()))

    def finish(self) -> list[dict]:
        parsed = self._parser.parse(self._text, final=True)
        content = message_content(parsed)
        return self._deltas(parsed, self._content_sent if content is None else len(content))

    def _deltas(self, parsed: ParsedOutput, content_end: int) -> list[dict]:
        deltas = []
        if content_end > self._content_sent:
            deltas.append({"content": parsed.content[self._content_sent:content_end]})
            self._content_sent = content_end
        for call in parsed.calls[len(self.calls):]:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments_json}}]})
        return deltas
