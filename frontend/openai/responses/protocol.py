"""POST /v1/responses bodies -> the chat-completions request they amount to, or InvalidParameter
naming the field (`param`).

A Responses request is served as one chat completion, stateless:

```
 Responses field                        chat-completions field
 input: "text"                          messages: [{"role": "user", "content": "text"}]
 input: [message items]                 messages (role user|system|developer|assistant; content a
                                        string or input_text / output_text parts)
 instructions                           a first system message
 max_output_tokens                      max_completion_tokens (left out: the rest of the context)
 temperature, top_p                     the same (left out: the model's defaults)
 text.format text|json_object|          response_format text | json_object |
   json_schema{name, schema, strict}      json_schema{name, schema, strict}
 stream                                 stream
 tools (function), tool_choice,         tools, tool_choice, parallel_tool_calls; function_call and
   parallel_tool_calls, function_call     function_call_output items as an assistant message with
   and function_call_output items         tool_calls and a tool message (function_tools.py)
```

Refused with a 400 naming the field: `store: true` and `previous_response_id` (nothing is kept),
built-in tools (`tools[i].type`), input items other than messages and function calls and their
outputs (reasoning, ...), content parts other than text (images, files), `reasoning` with an effort,
`include`, `background`, `conversation`, `prompt`, `truncation: auto`, `top_logprobs`, and any
field the API does not define.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.openai.protocol import ChatCompletionBody, ChatMessage, TextPart, parse_body
from pagedserve.frontend.openai.responses.function_tools import (
    chat_tool_choice, chat_tools, history_call, tool_message,
)

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
TEXT_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ResponsesBody(BaseModel):
    """The fields of POST /v1/responses this server reads; any other is refused (check_fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None


@dataclass(slots=True)
class ResponsesRequest:
    """A parsed Responses request: the chat body it amounts to and what the answer echoes."""

    chat: ChatCompletionBody
    instructions: str | None
    max_output_tokens: int | None
    text_format: dict
    tool_choice: str | dict
    is_stream: bool
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    parallel_tool_calls: bool = True
    tools: list[dict] = field(default_factory=list)  # the function tools, as the response echoes them


def parse_responses(body: Any) -> ResponsesRequest:
    """The parsed request; InvalidParameter naming the first field it cannot serve."""
    parsed = parse_body(ResponsesBody, body)
    extra = sorted(parsed.model_extra or {})
    if extra:
        raise InvalidParameter(extra[0], "is not a field of the Responses API served here")
    _refuse_unsupported(parsed)
    tools, echoed_tools = chat_tools(parsed.tools)
    tool_choice = chat_tool_choice(parsed.tool_choice, tools)
    messages = []
    if parsed.instructions:
        messages.append(ChatMessage(role="system", content=parsed.instructions))
    messages.extend(input_messages(parsed.input))
    text_format = _text_format(parsed.text)
    if parsed.max_output_tokens is not None and parsed.max_output_tokens < 1:
        raise InvalidParameter("max_output_tokens", "must be at least 1")
    chat = ChatCompletionBody(model=parsed.model, messages=messages, max_completion_tokens=parsed.max_output_tokens,
                              temperature=parsed.temperature, top_p=parsed.top_p, stream=parsed.stream,
                              user=parsed.user or parsed.safety_identifier, tools=tools, tool_choice=tool_choice,
                              parallel_tool_calls=parsed.parallel_tool_calls if tools else None,
                              response_format=None if text_format["type"] == "text" else _response_format(text_format))
    return ResponsesRequest(chat=chat, instructions=parsed.instructions, max_output_tokens=parsed.max_output_tokens,
                            text_format=text_format, tool_choice=parsed.tool_choice or "auto",
                            tools=echoed_tools,
                            is_stream=bool(parsed.stream), metadata=dict(parsed.metadata or {}), user=parsed.user,
                            parallel_tool_calls=True if parsed.parallel_tool_calls is None
                            else parsed.parallel_tool_calls)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat messages: a string is one user message; a list holds message items and
    function calls (consecutive ones: one assistant message) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise InvalidParameter("input", "must not be empty")
    messages = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "function_call":
            call = history_call(item, where)
            if messages and messages[-1].role == "assistant":  # the text before the calls, or earlier calls
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            continue
        if kind == "function_call_output":
            messages.append(tool_message(item, where))
            continue
        if kind != "message":
            raise InvalidParameter(f"{where}.type", f"{kind!r}: only message, function_call and function_call_output "
                                                    "items are supported")
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise InvalidParameter(f"{where}.role", f"must be one of {', '.join(INPUT_ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            messages.append(ChatMessage(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise InvalidParameter(f"{where}.content", "must be a string or an array of content parts")
        parts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidParameter(f"{where}.content[{part_index}]",
                                       f"only text parts (input_text, output_text) are supported, not {kind!r}")
            parts.append(TextPart(type="text", text=part["text"]))
        messages.append(ChatMessage(role=role, content=parts))
    return messages


def _refuse_unsupported(body: ResponsesBody) -> None:
    if body.store:
        raise InvalidParameter("store", "responses are not stored here (stateless): send store: false")
    if body.previous_response_id is not None:
        raise InvalidParameter("previous_response_id", "responses are not stored here (stateless): send the "
                                                        "earlier turns in input")
    if body.reasoning and any(value is not None for value in body.reasoning.values()):
        raise InvalidParameter("reasoning", "reasoning is not supported")
    if body.include:
        raise InvalidParameter("include", f"{body.include[0]!r} is not supported")
    if body.background:
        raise InvalidParameter("background", "background responses are not supported")
    if body.conversation is not None:
        raise InvalidParameter("conversation", "conversations are not stored here (stateless)")
    if body.prompt is not None:
        raise InvalidParameter("prompt", "prompt templates are not supported")
    if body.truncation not in (None, "disabled"):
        raise InvalidParameter("truncation", "only disabled is supported")
    if body.top_logprobs:
        raise InvalidParameter("top_logprobs", "logprobs are not supported on /v1/responses")


def _text_format(text: dict[str, Any] | None) -> dict:
    if text is None:
        return {"type": "text"}
    for key in text:
        if key not in ("format", "verbosity"):
            raise InvalidParameter(f"text.{key}", "is not supported")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidParameter("text.verbosity", "only medium is supported")
    text_format = text.get("format") or {"type": "text"}
    if not isinstance(text_format, dict) or text_format.get("type") not in TEXT_FORMAT_TYPES:
        raise InvalidParameter("text.format.type", f"must be one of {', '.join(TEXT_FORMAT_TYPES)}")
    if text_format["type"] == "json_schema" and not isinstance(text_format.get("schema"), dict):
        raise InvalidParameter("text.format.schema", "is required (a JSON Schema object)")
    return text_format


def _response_format(text_format: dict) -> dict:
    """text.format as chat's response_format (the structured-output machinery reads that)."""
    if text_format["type"] == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.get("name", "response"), "schema": text_format["schema"]}
    if "strict" in text_format:
        schema["strict"] = text_format["strict"]
    return {"type": "json_schema", "json_schema": schema}
