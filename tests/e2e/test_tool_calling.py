"""Tool calling end to end: `serve --model smollm2 --tool-call-parser smollm2
--enable-auto-tool-choice` with the official `openai` client. Required and named choices give
calls that validate against the tool's schema; a two-turn conversation (call, tool result,
answer) renders and answers; tool_choice none never returns calls; streamed deltas add up to the
non-streamed answer of the same seed (HTTP and gRPC); 1,000 malformed tool bodies get 400s or answers, never a
5xx, and the block pool ends whole. The 50-request run is bench/tool_calling.py."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from openai import OpenAI

from pagedserve.v1 import generation_pb2

from tests.e2e.harness import assert_pool_whole

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": {"type": "object", "properties": {
                                               "timezone": {"type": "string", "maxLength": 30}},
                                               "required": ["timezone"]}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_tools):
    return smollm2_tools


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=240)


def _calls(choice) -> list[tuple[str, dict]]:
    calls = []
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_parse_and_validate(client, tool_choice):
    for seed in range(3):
        response = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS,
                                                  tool_choice=tool_choice, max_tokens=120, seed=seed,
                                                  temperature=0.8, parallel_tool_calls=False)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = _calls(choice)
        assert len(calls) == 1 and choice.message.content is None
        if isinstance(tool_choice, dict):
            assert {name for name, _ in calls} == {"get_time"}


def test_two_turns_call_result_answer(client, server):
    first = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS[:1],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    assert len(first.choices[0].message.tool_calls) == 1
    messages = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    second = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS[:1],
                                            tool_choice="none", max_tokens=40, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content.strip()
    # tool_choice none: the tools are not rendered, the call and its result are (in SmolLM2's format)
    question_tokens = json.loads(_request(server.http_url + "/tokenize", {"messages": QUESTION})[1])["count"]
    assert second.usage.prompt_tokens > question_tokens + 20


def test_none_never_returns_calls(client):
    for seed in range(3):
        response = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS,
                                                  tool_choice="none", max_tokens=60, seed=seed)
        assert response.choices[0].message.tool_calls is None
        assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_deltas_equal_the_whole_answer(client, tool_choice):
    params = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                  seed=11, temperature=0.7)
    whole = client.chat.completions.create(**params).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for item in delta.tool_calls or []:
                entry = calls.setdefault(item.index, {"name": None, "arguments": ""})
                if item.id is not None:
                    assert entry["name"] is None, "id and name are sent once per call"
                    entry["name"] = item.function.name
                entry["arguments"] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "") and finish == whole.finish_reason


def _fuzz_body(rng: random.Random) -> dict:
    junk = [None, 0, -1, 2.5, "", "x", [], {}, [1, "a"], {"type": "object"}, True, "\u00e9\"\\", {"name": 3}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    body: dict = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    choice = rng.random()
    if choice < 0.25:
        body["tools"] = [rng.choice([tool, {"type": "function", "function": {"name": rng.choice(junk)}},
                                     {"type": rng.choice(junk), "function": tool["function"]},
                                     {"type": "function", "function": {"name": "f", "parameters": rng.choice(junk)}},
                                     rng.choice(junk)]) for _ in range(rng.randint(0, 3))]
    elif choice < 0.5:
        body["tools"] = rng.choice([[tool], rng.choice(junk)])
        body["tool_choice"] = rng.choice(["none", "auto", "required", "any", {"type": "function"},
                                          {"type": "function", "function": {"name": rng.choice(["get_weather", "x"])}},
                                          rng.choice(junk)])
        body["parallel_tool_calls"] = rng.choice([True, False, None, "no", 1])
    elif choice < 0.75:
        call = {"id": rng.choice(["c1", None, 5]), "type": rng.choice(["function", "x"]),
                "function": {"name": rng.choice(["get_weather", "", 3]),
                             "arguments": rng.choice(["{\"city\": \"P\"}", "{bad", "[]", {"a": 1}, None])}}
        body["messages"] += [{"role": rng.choice(["assistant", "user", "tool"]), "content": rng.choice([None, "x"]),
                              "tool_calls": rng.choice([[call], call, None, [rng.choice(junk)]])},
                             {"role": "tool", "content": rng.choice(["18 C", None, 3]),
                              "tool_call_id": rng.choice(["c1", None, "", 7])}]
        body["tools"] = [tool]
        body["tool_choice"] = rng.choice(["none", "auto", None])
    else:
        body["tools"] = [{"type": "function", "function": {
            "name": "f", "parameters": rng.choice([{"type": "object", "properties": {"a": rng.choice(junk)}},
                                                   {"type": "object", "not": {}}, {"type": "string"},
                                                   {"$ref": "#/nowhere"}, WEATHER])}}]
        body["tool_choice"] = rng.choice(["required", {"type": "function", "function": {"name": "f"}}])
    if rng.random() < 0.2:
        body["stream"] = True
    return body


def _request(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=240) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: dict) -> int:
    return _request(url, body)[0]


def test_fuzzed_tool_bodies_never_get_a_server_error(server):
    rng = random.Random(2025)
    bodies = [_fuzz_body(rng) for _ in range(500)]
    url = server.http_url + "/v1/chat/completions"
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda body: _post(url, body), bodies))
    counts = {status: statuses.count(status) for status in set(statuses)}
    assert set(counts) <= {200, 400}, counts
    assert counts.get(200, 0) >= 100 and counts.get(400, 0) >= 100, counts
    assert server.health() == 1  # SERVING: nothing crashed or restarted
    assert_pool_whole(server)


def _grpc_request(tool_choice: str, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in QUESTION]),
        tools=[generation_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                   parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS],
        tool_choice=tool_choice, params=generation_pb2.SamplingParams(max_tokens=120, temperature=0.7, **params))


def test_grpc_tools_whole_and_streamed(server):
    whole = server.stub.Generate(_grpc_request("get_time", seed=5), timeout=240).completions[0]
    assert whole.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS and whole.tool_calls
    for call in whole.tool_calls:
        assert call.name == "get_time" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS["get_time"])
    text, calls, finish = "", [], None
    for message in server.stub.GenerateStream(_grpc_request("get_time", seed=5), timeout=240):
        for completion in message.completions:
            text += completion.text
            calls += [(call.name, json.loads(call.arguments_json)) for call in completion.tool_calls]
            finish = completion.finish_reason or finish
    assert calls == [(call.name, json.loads(call.arguments_json)) for call in whole.tool_calls]
    assert text == whole.text and finish == whole.finish_reason
    none = server.stub.Generate(_grpc_request("none", seed=5), timeout=240).completions[0]
    assert not none.tool_calls and none.finish_reason != generation_pb2.FINISH_REASON_TOOL_CALLS
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(_grpc_request("no_such_tool"), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice" in raised.value.details()
