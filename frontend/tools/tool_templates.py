"""Chat templates that render tools, for model families whose own template has none.

A chat request that uses tools (a `tools` list that is rendered, assistant messages with
`tool_calls`, or `tool` messages) is rendered with the model's template (or --chat-template)
when that template renders the Jinja `tools` variable, as transformers' apply_chat_template
(tools=...) passes it; else with the template of the family of --tool-call-parser when there is
one; else it is refused (400): a template that ignores the tools would give a plain-text answer
to a question the client asked with tools.

SMOLLM2_TOOLS is SmolLM2-Instruct's tool-calling prompt (the system prompt its instruct data used:
the tools as a JSON list in <tools>, calls as a JSON list in <tool_call>[...]</tool_call>, tool
results as a user turn in <tool_response>), in ChatML.
"""

from __future__ import annotations

PROBE_TOOL_NAME = "pagedserve_probe_tool_7f3a"
PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_TOOL_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
PROBE_MESSAGES = [{"role": "user", "content": "probe"}]

SMOLLM2_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nYou are an expert in composing functions. You are given a question and a set of "
    "possible functions.\\nBased on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose.\\nIf none of the functions can be used, point it out and refuse to answer.\\nIf the "
    "given question lacks the parameters required by the function, also point it out.\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'You have access to the following tools:\\n<tools>' + (tools | tojson) + '</tools>\\n\\nThe output MUST "
    "strictly adhere to the following format, and NO other text MUST be included.\\nThe example format is as "
    "follows. Please make sure the parameter type is correct. If no function call is needed, please make the "
    "tool calls an empty list \\'[]\\'.\\n<tool_call>[\\n{\"name\": \"func_name1\", \"arguments\": "
    "{\"argument1\": \"value1\", \"argument2\": \"value2\"}},\\n(more tool calls as required)\\n]</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{{- '<tool_call>[\\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call.get('function') else call %}"
    "{{- '{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if function['arguments'] is string %}{{- function['arguments'] }}"
    "{%- else %}{{- function['arguments'] | tojson }}{%- endif %}"
    "{{- '}' }}{%- if not loop.last %}{{- ',\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '\\n]</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

FAMILY_TEMPLATES = {"smollm2": SMOLLM2_TOOLS}


def family_template(parser: str | None) -> str | None:
    """The shipped tool-aware template of the --tool-call-parser's model family, if any."""
    return FAMILY_TEMPLATES.get(parser or "")


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(message.get("tool_calls") or message.get("role") == "tool" for message in messages)
