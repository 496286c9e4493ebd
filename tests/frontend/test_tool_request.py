"""Tools and tool_choice of a chat request: checks against the server's flags, the chat template
that renders them (or the 400 when none does), and the forced-call grammar of each parser, run
on a byte vocabulary: what it accepts parses back into calls that validate against the tool's
schema, and what breaks the schema is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.contracts.constraint_grammar import check_constraint
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.openai.protocol import ChatCompletionBody, chat_messages, generation_plan, parse_body
from pagedserve.frontend.tokenization.chat_template import ChatTemplate
from pagedserve.frontend.tools.tool_parsers import get_parser
from pagedserve.frontend.tools.tool_request import ToolSettings, forced_constraint, parse_tool_request
from pagedserve.frontend.tools.tool_templates import family_template
from pagedserve.scheduler.structured_output.compiler import GrammarCompiler
from pagedserve.scheduler.structured_output.vocabulary import SPECIAL_PREFIX, vocabulary_from_tokens

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
AUTO = ToolSettings("smollm2", enable_auto=True)
SMOL_CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
               "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
EOS = 256
BYTE_TOKENS = [bytes([byte]) for byte in range(256)] + [SPECIAL_PREFIX + b"<eos>"]


def _error(call) -> tuple[str, str]:
    with pytest.raises(InvalidParameter) as raised:
        call()
    return raised.value.field_name, str(raised.value)


def test_tool_choice_against_the_flags():
    request = parse_tool_request(TOOLS, None, None, AUTO)
    assert request.choice == "auto" and request.is_active and not request.is_forced
    assert parse_tool_request(TOOLS, "none", None, ToolSettings()).is_active is False
    assert _error(lambda: parse_tool_request(TOOLS, None, None, ToolSettings("hermes")))[0] == "tool_choice"
    field, message = _error(lambda: parse_tool_request(TOOLS, "required", None, ToolSettings()))
    assert field == "tool_choice" and "--tool-call-parser" in message
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "now"}}, False, ToolSettings("hermes"))
    assert (named.choice, named.function_name, named.parallel) == ("function", "now", False)
    assert _error(lambda: parse_tool_request(TOOLS, {"type": "function", "function": {"name": "x"}}, None,
                                             AUTO))[0] == "tool_choice.function.name"
    assert _error(lambda: parse_tool_request(None, "required", None, AUTO))[0] == "tool_choice"
    assert _error(lambda: parse_tool_request(TOOLS, "sometimes", None, AUTO))[0] == "tool_choice"
    assert _error(lambda: parse_tool_request(TOOLS, "auto", "yes", AUTO))[0] == "parallel_tool_calls"


@pytest.mark.parametrize("tools,field", [
    ({"type": "function"}, "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], "tools[0].function.description"),
])
def test_malformed_tools_name_the_field(tools, field):
    assert _error(lambda: parse_tool_request(tools, "required", None, AUTO))[0] == field


def test_parameters_the_constraint_cannot_enforce_are_refused_at_once():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    field, message = _error(lambda: forced_constraint(parse_tool_request(tools, "required", None, AUTO), "smollm2"))
    assert field == "tools" and "not" in message
    assert parse_tool_request(tools, "auto", None, AUTO).choice == "auto"  # rendered only: not compiled


def test_forced_choice_with_another_constraint_is_refused():
    body = parse_body(ChatCompletionBody, {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                           "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert _error(lambda: generation_plan(body, tool_settings=AUTO))[0] == "tool_choice"


def test_history_messages_are_checked_and_converted():
    body = parse_body(ChatCompletionBody, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]})
    messages = chat_messages(body.messages)
    assert messages[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": {}}
    assert messages[1]["tool_call_id"] == "call_1"
    for bad, field in [({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
                       ({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{x"}}]},
                        "messages[0].tool_calls[0].function.arguments"),
                       ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls")]:
        parsed = parse_body(ChatCompletionBody, {"messages": [bad]})
        assert _error(lambda: chat_messages(parsed.messages))[0] == field


def test_a_template_without_tools_is_refused_and_the_family_template_renders_them(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = parse_tool_request(TOOLS, "auto", None, AUTO).template_tools()
    plain = ChatTemplate(tokenizer, SMOL_CHATML)
    assert not plain.renders_tools()
    assert _error(lambda: plain.render(messages, True, tools))[0] == "tools"
    assert _error(lambda: plain.render(messages + [{"role": "tool", "content": "x", "tool_call_id": "1"}]))[0] == \
        "messages"
    assert plain.render(messages) == ChatTemplate(tokenizer, SMOL_CHATML, family_template("smollm2")).render(messages)
    smol = ChatTemplate(tokenizer, SMOL_CHATML, family_template("smollm2"))
    prompt = smol.render(messages + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "c"}], True, tools)
    assert "<tools>[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"" in prompt
    assert '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>' in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    aware = ChatTemplate(tokenizer, "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert aware.renders_tools() and "get_weather" in aware.render(messages, True, tools)


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(lambda: vocabulary_from_tokens(BYTE_TOKENS, [EOS], [EOS], len(BYTE_TOKENS)))


def _accepts(grammars, constraint, text: str) -> bool:
    matcher = grammars.new_matcher(constraint)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting() and matcher.consume_token(EOS)


def _format(parser: str, calls: list[tuple[str, dict]]) -> str:
    key = "parameters" if parser == "llama3_json" else "arguments"
    items = [json.dumps({"name": name, key: args}, ensure_ascii=False) for name, args in calls]
    if parser == "smollm2":
        return "<tool_call>[\n" + ",\n".join(items) + "\n]</tool_call>"
    if parser == "hermes":
        return "\n".join(f"<tool_call>\n{item}\n</tool_call>" for item in items)
    return "; ".join(items)


@pytest.mark.parametrize("parser", ["smollm2", "hermes", "llama3_json"])
def test_forced_grammar_accepts_calls_the_parser_reads(grammars, parser):
    required = parse_tool_request(TOOLS, "required", None, ToolSettings(parser))
    constraint = forced_constraint(required, parser)
    check_constraint(constraint)
    good = [("get_weather", {"city": "Zürich \"x\"", "days": 2}), ("now", {})]
    text = _format(parser, good)
    assert _accepts(grammars, constraint, text)
    parsed = get_parser(parser).parse(text)
    assert [(call.name, json.loads(call.arguments_json)) for call in parsed.calls] == good
    jsonschema.validate(json.loads(parsed.calls[0].arguments_json), WEATHER)
    for bad in ([("get_weather", {"days": 2})], [("get_weather", {"city": "x", "days": 0})], [("other", {})],
                [("now", {"extra": 1})]):
        assert not _accepts(grammars, constraint, _format(parser, bad)), bad
    assert not _accepts(grammars, constraint, "Sure! " + text)
    assert not _accepts(grammars, constraint, text.replace(", ", ",\n    ", 1))  # no free whitespace
    single = forced_constraint(parse_tool_request(TOOLS, {"type": "function", "function": {"name": "now"}}, False,
                                                  ToolSettings(parser)), parser)
    assert _accepts(grammars, single, _format(parser, [("now", {})]))
    assert not _accepts(grammars, single, _format(parser, [("now", {}), ("now", {})]))
    assert not _accepts(grammars, single, _format(parser, [("get_weather", {"city": "x"})]))
