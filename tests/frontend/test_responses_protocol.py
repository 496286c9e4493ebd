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
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
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
