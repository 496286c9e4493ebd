"""POST /v1/responses bodies -> the chat request they amount to, and the 400s naming what is not
served (frontend/openai/responses/protocol.py)."""

from __future__ import annotations

import pytest

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.openai.protocol import chat_messages
from pagedserve.frontend.openai.responses.protocol import parse_responses
from pagedserve.frontend.openai.responses.serving import _renamed

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    parsed = parse_responses({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
                              "temperature": 0.5, "top_p": 0.8, "stream": True, "store": False})
    assert chat_messages(parsed.chat.messages) == [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}]
    chat = parsed.chat
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.stream) == (9, 0.5, 0.8, True)
    assert parsed.is_stream and chat.response_format is None and parsed.text_format == {"type": "text"}


def test_message_items_with_text_parts():
    parsed = parse_responses({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
    ]})
    assert chat_messages(parsed.chat.messages) == [{"role": "developer", "content": "Rules."},
                                                   {"role": "user", "content": "a\nb"},
                                                   {"role": "assistant", "content": "c"}]
    assert parsed.chat.max_completion_tokens is None and parsed.chat.temperature is None


def test_text_format_becomes_the_structured_output_response_format():
    parsed = parse_responses({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA,
                                                                "strict": True}}})
    assert parsed.chat.response_format == {"type": "json_schema",
                                           "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert parse_responses({"input": "x", "text": {"format": {"type": "json_object"}}}).chat.response_format == {
        "type": "json_object"}
    assert parse_responses({"input": "x", "text": {"format": {"type": "text"}}}).chat.response_format is None


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}, "tools[1].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
     "tools[1].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "function": {}}]}, "tools[0].function"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice.name"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"instructions": "x"}, "input"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidParameter) as caught:
        parse_responses(body)
    assert caught.value.field_name == param


def test_accepted_fields_that_change_nothing():
    parsed = parse_responses({"input": "x", "store": False, "tools": [], "tool_choice": "auto",
                              "parallel_tool_calls": False, "truncation": "disabled", "include": [],
                              "reasoning": {"effort": None}, "metadata": {"k": "v"}, "user": "u",
                              "text": {"format": {"type": "text"}, "verbosity": "medium"}})
    assert parsed.metadata == {"k": "v"} and parsed.parallel_tool_calls is False and parsed.tool_choice == "auto"


def test_errors_of_the_chat_checks_name_the_responses_fields():
    assert _renamed(InvalidParameter("max_completion_tokens", "too many")).field_name == "max_output_tokens"
    assert _renamed(InvalidParameter("response_format", "bad schema")).field_name == "text.format"
    assert _renamed(InvalidParameter("messages[1].content", "x")).field_name == "input[1].content"
    assert _renamed(InvalidParameter("temperature", "x")).field_name == "temperature"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_function_tools_and_tool_choice_become_the_chat_ones():
    parsed = parse_responses({"input": "x", "tools": [{"type": "function", "name": "get_weather",
                                                       "description": "Weather", "parameters": WEATHER,
                                                       "strict": True}],
                              "tool_choice": {"type": "function", "name": "get_weather"},
                              "parallel_tool_calls": False})
    assert parsed.chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                                   "parameters": WEATHER, "strict": True}}]
    assert parsed.chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert parsed.chat.parallel_tool_calls is False
    assert parsed.tools == [{"type": "function", "name": "get_weather", "description": "Weather",
                             "parameters": WEATHER, "strict": True}]
    assert parsed.tool_choice == {"type": "function", "name": "get_weather"}
    for choice in ("none", "auto", "required"):
        assert parse_responses({"input": "x", "tools": [{"type": "function", "name": "f"}],
                                "tool_choice": choice}).chat.tool_choice == choice
    defaulted = parse_responses({"input": "x", "tools": [{"type": "function", "name": "f"}]})
    assert defaulted.chat.tool_choice is None and defaulted.tool_choice == "auto"


def test_function_call_items_and_their_outputs_become_tool_call_and_tool_messages():
    parsed = parse_responses({"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21 C"}]},
    ], "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]})
    assert chat_messages(parsed.chat.messages) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}]


def test_function_call_output_items_answer_with_the_call_items():
    from pagedserve.frontend.openai.responses.function_tools import function_call_item
    from pagedserve.frontend.tools.tool_parsers import ToolCall

    item = function_call_item(ToolCall("get_weather", '{"city": "Paris"}', id="call_abc"))
    assert item == {"type": "function_call", "id": "fc_abc", "call_id": "call_abc", "name": "get_weather",
                    "arguments": '{"city": "Paris"}', "status": "completed"}
