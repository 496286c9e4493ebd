"""Tool calling on the public gRPC API: GenerateRequest `tools` / `tool_choice` and the chat
history's tool calls -> the frontend's tool request; parsed calls -> Completion `tool_calls` and
FINISH_REASON_TOOL_CALLS (the process edge of pagedserve.frontend.tools).

```
 Tool {name, description, parameters_json}   -> the OpenAI tool {"type": "function", "function": {…}}
 tool_choice ""                               -> none without tools, auto with them
             "none" | "auto" | "required"     -> the same
             any other text                   -> the tool of that name, forced
 Completion.text                              -> the content around the calls
 Completion.tool_calls                        -> each call once (streamed: when its block closes)
```
"""

from __future__ import annotations

import json

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.tools.tool_parsers import ToolCall, get_parser
from pagedserve.frontend.tools.tool_request import (
    CHOICES, ToolRequest, ToolSettings, history_tool_calls, parse_tool_request,
)
from pagedserve.frontend.tools.tool_stream import ToolStream, message_content
from pagedserve.v1 import generation_pb2


def tool_request_from_proto(msg: generation_pb2.GenerateRequest, settings: ToolSettings) -> ToolRequest | None:
    """The request's tools and choice, checked; None without tools."""
    tools = []
    for index, tool in enumerate(msg.tools):
        function: dict = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            try:
                function["parameters"] = json.loads(tool.parameters_json)
            except (ValueError, RecursionError):
                raise InvalidParameter(f"tools[{index}].parameters_json", "is not JSON") from None
        tools.append({"type": "function", "function": function})
    if tools and msg.WhichOneof("input") != "messages":
        raise InvalidParameter("tools", "need the messages input (the chat template renders them)")
    choice = msg.tool_choice or None
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return parse_tool_request(tools or None, choice, None, settings)
    except InvalidParameter as exc:
        if exc.field_name == "tool_choice.function.name":
            raise InvalidParameter("tool_choice", str(exc).split(": ", 1)[-1]) from None
        if exc.field_name.startswith("tools[") and exc.field_name.endswith(".function.parameters"):
            raise InvalidParameter(exc.field_name.replace(".function.parameters", ".parameters_json"),
                                   str(exc).split(": ", 1)[-1]) from None
        raise InvalidParameter(exc.field_name.replace(".function.", "."), str(exc).split(": ", 1)[-1]) from None


def chat_message_dict(message: generation_pb2.ChatMessage, index: int) -> dict:
    """A proto chat message as templates take it (role, content, tool_calls, tool_call_id)."""
    item: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        item["tool_calls"] = history_tool_calls(
            [{"id": call.id or None, "type": "function",
              "function": {"name": call.name, "arguments": call.arguments_json or "{}"}} for call in message.tool_calls],
            f"messages[{index}].tool_calls")
    if message.tool_call_id:
        item["tool_call_id"] = message.tool_call_id
    return item


def _fill_calls(completion: generation_pb2.Completion, calls: list[ToolCall]) -> None:
    for call in calls:
        completion.tool_calls.add(id=call.id, name=call.name, arguments_json=call.arguments_json)
    if calls and completion.finish_reason == generation_pb2.FINISH_REASON_STOP:
        completion.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS


def parse_whole(response: generation_pb2.GenerateResponse, parser: str) -> generation_pb2.GenerateResponse:
    """Generate's answer with each completion's text parsed into content and tool calls."""
    for completion in response.completions:
        parsed = get_parser(parser).parse(completion.text)
        completion.text = message_content(parsed) or ""
        _fill_calls(completion, parsed.calls)
    return response


class StreamedCalls:
    """GenerateStream messages with each completion's text run through a ToolStream."""

    def __init__(self, parser: str) -> None:
        self._parser = parser
        self._streams: dict[int, ToolStream] = {}

    def rewrite(self, message: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        for completion in message.completions:
            stream = self._streams.get(completion.index)
            if stream is None:
                stream = self._streams[completion.index] = ToolStream(get_parser(self._parser))
            num_sent = len(stream.calls)
            deltas = stream.feed(completion.text)
            if completion.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                deltas += stream.finish()
            completion.text = "".join(delta.get("content", "") for delta in deltas)
            _fill_calls(completion, stream.calls[num_sent:])
            if stream.has_calls and completion.finish_reason == generation_pb2.FINISH_REASON_STOP:
                completion.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS
        return message
