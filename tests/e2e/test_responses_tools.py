"""Function tools over POST /v1/responses end to end: `serve --model smollm2 --tool-call-parser
smollm2 --enable-auto-tool-choice` with the official `openai` client (a round trip: a forced call
whose arguments validate against the tool's schema, its function_call_output, a text answer;
the streamed events of a call and their final response equal to the whole answer) and the OpenAI
Agents SDK running an agent with one function tool over the Responses API, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER,
        "strict": True}
QUESTION = "What is the weather in Paris?"
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(smollm2_tools):
    return smollm2_tools


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=240)


FORCED = dict(model="smollm2", input=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=80, temperature=0)


@pytest.fixture(scope="module")
def forced(client):
    return client.responses.create(**FORCED)


def test_a_function_tool_round_trip(client, forced):
    assert forced.status == "completed", forced
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert forced.tools[0].name == "get_weather" and forced.tool_choice == "required"
    answer = client.responses.create(
        model="smollm2", tools=[TOOL], tool_choice="none", max_output_tokens=40, temperature=0,
        input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text.strip(), answer
    # the call and its output were rendered (tool_choice none renders no tools)
    question = client.post("/../tokenize", body={"messages": [{"role": "user", "content": QUESTION}]}, cast_to=object)
    assert answer.usage.input_tokens > question["count"] + 10


def test_streamed_call_events_equal_the_whole_answer(client, forced):
    with client.responses.stream(**FORCED) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"], kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 0
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    (whole,) = forced.output
    assert delta.delta == done.arguments == item_done.item.arguments == whole.arguments
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments, streamed.status) == (whole.name, whole.arguments, whole.status)
    assert final.usage.output_tokens == forced.usage.output_tokens


def test_an_agent_with_a_function_tool_runs_over_the_responses_api(server):
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client
    from agents import set_tracing_disabled

    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        cities.append(city)
        return f"18 degrees and sunny in {city}"

    async def run():
        set_tracing_disabled(True)
        set_default_openai_client(AsyncOpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0,
                                              timeout=240), use_for_tracing=False)
        set_default_openai_api("responses")
        # The first turn is forced (a 135M model does not always call on its own); the SDK resets
        # tool_choice to auto after the call, and the second turn answers with the tool's result.
        agent = Agent(name="Assistant", model="smollm2", tools=[get_weather],
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
        whole = await Runner.run(agent, QUESTION, max_turns=4)
        streamed = Runner.run_streamed(agent, QUESTION, max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds
        assert [item.type for item in streamed.new_items] == [item.type for item in whole.new_items]
        assert streamed.final_output == whole.final_output
        return whole

    result = asyncio.run(run())
    assert len(cities) >= 2, "the tool was not called in each run"
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
