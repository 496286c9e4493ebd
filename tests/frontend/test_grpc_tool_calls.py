"""gRPC tool fields: GenerateRequest tools / tool_choice and history tool calls -> the tool
request (errors name the proto fields), Completion tool_calls and FINISH_REASON_TOOL_CALLS in
whole and streamed answers."""

from __future__ import annotations

import json

import pytest

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.grpc.tool_calls import StreamedCalls, chat_message_dict, parse_whole, tool_request_from_proto
from pagedserve.frontend.tools.tool_request import ToolSettings
from pagedserve.v1 import generation_pb2 as pb

SETTINGS = ToolSettings("smollm2", enable_auto=True)
CALL_TEXT = 'Ok <tool_call>[\n{"name": "now", "arguments": {"tz": "\\u00e9"}}\n]</tool_call>'


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                              **fields)


def _field(call) -> str:
    with pytest.raises(InvalidParameter) as raised:
        call()
    return raised.value.field_name


def test_tools_and_choice_from_proto():
    tools = [pb.Tool(name="now", description="time", parameters_json='{"type": "object"}')]
    assert tool_request_from_proto(_request(), SETTINGS) is None
    assert tool_request_from_proto(_request(tools=tools), SETTINGS).choice == "auto"
    named = tool_request_from_proto(_request(tools=tools, tool_choice="now"), SETTINGS)
    assert (named.choice, named.function_name) == ("function", "now")
    assert tool_request_from_proto(_request(tools=tools, tool_choice="none"), ToolSettings()).is_active is False
    assert _field(lambda: tool_request_from_proto(_request(tools=tools, tool_choice="other"), SETTINGS)) == "tool_choice"
    assert _field(lambda: tool_request_from_proto(_request(tools=[pb.Tool(name="a", parameters_json="{x")]),
                                                  SETTINGS)) == "tools[0].parameters_json"
    assert _field(lambda: tool_request_from_proto(_request(tools=[pb.Tool(name="a b")]), SETTINGS)) == "tools[0].name"
    assert _field(lambda: tool_request_from_proto(pb.GenerateRequest(prompt="x", tools=tools), SETTINGS)) == "tools"
    assert _field(lambda: tool_request_from_proto(_request(tools=tools, tool_choice="auto"), ToolSettings("hermes"))) \
        == "tool_choice"


def test_history_messages():
    message = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="now", arguments_json='{"a": 1}')])
    assert chat_message_dict(message, 0)["tool_calls"] == [{"id": "c1", "type": "function",
                                                            "function": {"name": "now", "arguments": {"a": 1}}}]
    assert chat_message_dict(pb.ChatMessage(role="tool", content="x", tool_call_id="c1"), 1)["tool_call_id"] == "c1"
    bad = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="now", arguments_json="[1]")])
    assert _field(lambda: chat_message_dict(bad, 2)) == "messages[2].tool_calls[0].function.arguments"


def test_whole_and_streamed_completions_agree():
    whole = pb.GenerateResponse(completions=[pb.Completion(index=0, text=CALL_TEXT, finish_reason=pb.FINISH_REASON_STOP)])
    parse_whole(whole, "smollm2")
    completion = whole.completions[0]
    assert completion.text == "Ok " and completion.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [(c.name, json.loads(c.arguments_json)) for c in completion.tool_calls] == [("now", {"tz": "é"})]
    for cut in range(len(CALL_TEXT) + 1):
        calls = StreamedCalls("smollm2")
        pieces = [CALL_TEXT[:cut], CALL_TEXT[cut:]]
        text, names, finish = "", [], None
        for position, piece in enumerate(pieces):
            reason = pb.FINISH_REASON_STOP if position == len(pieces) - 1 else pb.FINISH_REASON_UNSPECIFIED
            message = calls.rewrite(pb.GenerateResponse(completions=[pb.Completion(index=0, text=piece,
                                                                                     finish_reason=reason)]))
            text += message.completions[0].text
            names += [(c.name, c.arguments_json) for c in message.completions[0].tool_calls]
            finish = message.completions[0].finish_reason
        assert text == "Ok " and names == [(c.name, c.arguments_json) for c in completion.tool_calls]
        assert finish == pb.FINISH_REASON_TOOL_CALLS
    plain = pb.GenerateResponse(completions=[pb.Completion(text="<tool_call>[oops]</tool_call>",
                                                           finish_reason=pb.FINISH_REASON_STOP)])
    assert parse_whole(plain, "smollm2").completions[0].text == "<tool_call>[oops]</tool_call>"
    assert plain.completions[0].finish_reason == pb.FINISH_REASON_STOP
