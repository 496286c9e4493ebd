"""LangChain's `ChatOpenAI` against `serve --model smollm2 --tool-call-parser smollm2
--enable-auto-tool-choice`, as an agent framework calls it: `with_structured_output` by JSON schema
and by function calling (a pydantic object back, its JSON validated against the schema),
`bind_tools` with a forced tool (calls whose arguments validate), a tool's result sent back in a
second turn, and streaming (chunks that add up to the whole answer, tool-call chunks to the
same call) synchronously and with asyncio. Short answers on the shared server of
test_tool_calling."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

PERSON = "Describe a person called Anna who is 31 years old."


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=30)
    age: int


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather of a city."""
    return f"18 degrees {unit} and sunny in {city}"


WEATHER_ARGS = get_weather.tool_call_schema.model_json_schema()


@pytest.fixture(scope="module")
def llm(smollm2_tools) -> ChatOpenAI:
    return ChatOpenAI(base_url=smollm2_tools.http_url + "/v1", api_key="-", model="smollm2", temperature=0,
                      max_tokens=48, max_retries=0, timeout=240)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_returns_the_pydantic_object(llm, method):
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    prompt = PERSON if method != "json_mode" else PERSON + " Answer in JSON with the keys name and age."
    result = structured.invoke(prompt)
    assert result["parsing_error"] is None, result["raw"]
    person = result["parsed"]
    assert isinstance(person, Person), result["raw"]
    jsonschema.validate(person.model_dump(), Person.model_json_schema())


def test_a_forced_tool_gives_calls_that_validate_and_a_second_turn_answers(llm):
    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    message = with_tools.invoke([question])
    assert isinstance(message, AIMessage) and message.tool_calls, message
    for call in message.tool_calls:
        assert call["name"] == "get_weather" and call["id"]
        jsonschema.validate(call["args"], WEATHER_ARGS)
    results = [ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]) for call in message.tool_calls]
    answer = llm.bind_tools([get_weather]).invoke([question, message, *results])
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls), answer
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_streamed_chunks_add_up_to_the_whole_answer(llm):
    whole = llm.invoke(PERSON)
    chunks = list(llm.stream(PERSON))
    assert len(chunks) > 1
    assert "".join(chunk.content for chunk in chunks) == whole.content


def test_streamed_tool_call_chunks_add_up_to_the_whole_call(llm):
    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    whole = with_tools.invoke("What is the weather in Paris?")
    merged = None
    for chunk in with_tools.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.tool_calls, merged
    assert [(call["name"], call["args"]) for call in merged.tool_calls] == \
        [(call["name"], call["args"]) for call in whole.tool_calls]


def test_async_calls_run_side_by_side(llm):
    structured = llm.with_structured_output(Person)

    async def both():
        return await asyncio.gather(llm.ainvoke(PERSON), structured.ainvoke(PERSON))

    text, person = asyncio.run(both())
    assert text.content == llm.invoke(PERSON).content
    assert isinstance(person, Person)
