"""The Responses output of a tool-calling answer, whole (objects.output_items) and streamed
(streaming.ResponseEventWriter): the events, parsed by the official client's own stream
accumulator, add up to the whole answer at every cut of canned smollm2 outputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.frontend.generation.completion_state import CompletionFinish, CompletionUpdate
from pagedserve.frontend.generation.updates import GenerationUpdate, Usage
from pagedserve.frontend.openai.responses.objects import ResponseIdentity, output_items
from pagedserve.frontend.openai.responses.protocol import parse_responses
from pagedserve.frontend.openai.responses.streaming import ResponseEventWriter

IDENTITY = ResponseIdentity("resp_1", "msg_1", 0, "smollm2")
REQUEST = parse_responses({"input": "x", "tools": [{"type": "function", "name": "get_weather"}]})
RUN = SimpleNamespace(usages={0: Usage(prompt_tokens=5, completion_tokens=7, cached_prompt_tokens=0)})
ONE_CALL = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
OUTPUTS = [
    ONE_CALL,
    'Let me look. <tool_call>[{"name": "get_weather", "arguments": {}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]</tool_call>',
    "Plain answer, <tool no call.",
    "",
    "<tool_call>[not json]</tool_call>",
]


def _streamed(text: str, cuts: list[int]) -> tuple[list[str], list[dict], dict]:
    """(event types, the final output as the official client accumulates it, the completed event's
    response) for `text` arriving in pieces cut at `cuts`."""
    writer = ResponseEventWriter(IDENTITY, REQUEST, SamplingParams(), tool_parser="smollm2")
    bounds = [0, *cuts, len(text)]
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    frames = writer.opening()
    for index, piece in enumerate(pieces):
        finish = CompletionFinish.STOP if index == len(pieces) - 1 else None
        frames += writer.deltas(GenerationUpdate([CompletionUpdate(0, piece, [], finish=finish)]))
    frames += writer.closing(RUN)
    state, kinds, last = ResponseStreamState(input_tools=omit, text_format=omit), [], None
    for frame in frames:
        data = json.loads(frame.decode().split("\ndata: ", 1)[1])
        kinds.append(data["type"])
        for event in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data)):
            if event.type == "response.completed":
                last = event.response
    return kinds, [item.to_dict() for item in last.output], data["response"]


def _without_ids(items: list[dict]) -> list[dict]:
    """Calls get fresh ids per parse: compare everything else (and not what the client parses
    into `parsed_arguments` and `parsed`)."""
    out = []
    for item in items:
        item = {key: value for key, value in item.items()
                if key != "parsed_arguments" and (key not in ("id", "call_id") or item["type"] == "message")}
        if "content" in item:
            item["content"] = [{key: value for key, value in part.items() if key != "parsed"}
                               for part in item["content"]]
        out.append(item)
    return out


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_items_equal_the_whole_answer_at_every_cut(text):
    whole = _without_ids(output_items(IDENTITY, text, "completed", "smollm2"))
    for cut in range(len(text) + 1):
        _, accumulated, completed = _streamed(text, [cut])
        assert _without_ids(accumulated) == whole == _without_ids(completed["output"]), (text, cut)
    _, accumulated, _ = _streamed(text, list(range(1, len(text))))  # one character at a time
    assert _without_ids(accumulated) == whole


def test_the_events_of_a_call_and_of_text_before_it():
    kinds, items, _ = _streamed(OUTPUTS[1], [5, 20, 60])
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert [item["type"] for item in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me look. "
    assert items[2]["name"] == "get_time" and json.loads(items[2]["arguments"]) == {"tz": "CET"}
    assert items[1]["id"] == "fc_" + items[1]["call_id"].removeprefix("call_")
    kinds, items, _ = _streamed(ONE_CALL, [10])
    assert kinds == ["response.created", "response.in_progress", *call_events, "response.completed"]


def test_text_only_answers_keep_one_message_item():
    whole = output_items(IDENTITY, "Hi there", "completed", "smollm2")
    assert whole == output_items(IDENTITY, "Hi there", "completed", None)
    kinds, items, _ = _streamed("", [])
    assert [item["type"] for item in items] == ["message"] and items[0]["content"][0]["text"] == ""
