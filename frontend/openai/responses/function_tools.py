"""Function tools of the Responses API, mapped onto chat-completions tool calling
(pagedserve.frontend.tools) and back:

```
 Responses                                          chat completions
 tools: [{type: function, name, description,        tools: [{type: function, function: {name,
          parameters, strict}]                               description, parameters, strict}}]
 tool_choice: none | auto | required                the same
 tool_choice: {type: function, name: N}             {type: function, function: {name: N}}
 input items, consecutive function_call             one assistant message with tool_calls
   {call_id, name, arguments}                         [{id: call_id, function: {name, arguments}}]
 input item function_call_output {call_id, output}  a tool message {tool_call_id, content}
 answer: content around the calls, calls           output: a message item (when there is content),
                                                     then one function_call item per call
                                                     {id: fc_…, call_id, name, arguments, status}
```

Errors name the Responses field (`tools[1].name`, `tool_choice.name`, `input[3].arguments`).
Built-in tool types (web_search, file_search, ...) are refused as `tools[i].type`.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.openai.protocol import ChatMessage
from pagedserve.frontend.tools.tool_parsers import ToolCall
from pagedserve.frontend.tools.tool_request import CHOICES, MAX_TOOLS, NAME_PATTERN

BUILT_IN_TOOLS = {"web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom"}
FUNCTION_FIELDS = {"type", "name", "description", "parameters", "strict"}


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict] | None, list[dict]]:
    """(the chat `tools`, None without any; the tools as the response object echoes them)."""
    if not tools:
        return None, []
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter("tools", f"at most {MAX_TOOLS} tools")
    chat, echoed, names = [], [], set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            name = kind if kind in BUILT_IN_TOOLS else repr(kind)
            raise InvalidParameter(f"{where}.type", f"the built-in tool {name} is not supported (only function tools)")
        extra = sorted(set(tool) - FUNCTION_FIELDS)
        if extra:
            raise InvalidParameter(f"{where}.{extra[0]}", "is not a field of a function tool")
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidParameter(f"{where}.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise InvalidParameter(f"{where}.name", f"{name!r} is defined twice")
        names.add(name)
        description, parameters, strict = tool.get("description"), tool.get("parameters"), tool.get("strict")
        if description is not None and not isinstance(description, str):
            raise InvalidParameter(f"{where}.description", "must be a string")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidParameter(f"{where}.parameters", "must be a JSON Schema object")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParameter(f"{where}.strict", "must be a boolean")
        function = {"name": name, "parameters": parameters, "strict": strict}
        if description is not None:
            function["description"] = description
        chat.append({"type": "function", "function": function})
        echoed.append({"type": "function", "name": name, "description": description, "parameters": parameters,
                       "strict": strict})
    return chat, echoed


def chat_tool_choice(tool_choice: str | dict[str, Any] | None, tools: list[dict] | None) -> str | dict | None:
    """The chat tool_choice; none|auto without tools are accepted (they change nothing)."""
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidParameter("tool_choice", 'must be "none", "auto", "required" or '
                                                  '{"type": "function", "name": …}')
        if not tools and tool_choice in ("none", "auto"):
            return None
        if not tools:
            raise InvalidParameter("tool_choice", f"{tool_choice!r} needs tools")
        return tool_choice
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise InvalidParameter("tool_choice", 'only "none", "auto", "required" and {"type": "function", "name": …} '
                                              'are supported')
    name = tool_choice["name"]
    if name not in {tool["function"]["name"] for tool in tools or []}:
        raise InvalidParameter("tool_choice.name", f"{name!r} is not one of the tools")
    return {"type": "function", "function": {"name": name}}


def history_call(item: dict[str, Any], where: str) -> dict:
    """A function_call input item as a chat tool call."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidParameter(f"{where}.call_id", "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"{where}.name", "must be a non-empty string")
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidParameter(f"{where}.arguments", "must be a JSON object's text")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(item: dict[str, Any], where: str) -> ChatMessage:
    """A function_call_output input item as a chat tool message."""
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidParameter(f"{where}.call_id", "must be a non-empty string")
    if isinstance(output, list):
        texts = []
        for index, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") or \
                    not isinstance(part.get("text"), str):
                raise InvalidParameter(f"{where}.output[{index}]", "only input_text parts are supported")
            texts.append(part["text"])
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise InvalidParameter(f"{where}.output", "must be a string or an array of input_text parts")
    return ChatMessage(role="tool", content=output, tool_call_id=call_id)


def function_call_item(call: ToolCall, status: str = "completed", *, arguments: str | None = None) -> dict:
    """A call as an output item; its id derives from the call's id (call_X -> fc_X)."""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments_json if arguments is None else arguments,
            "status": status}
