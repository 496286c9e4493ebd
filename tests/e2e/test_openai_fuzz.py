"""Fuzzed request bodies against the OpenAI-compatible API of a real `serve`: every answer is a
valid OpenAI success or error (never a 5xx), the server stays up, and the block pool ends whole.

Bodies mix the fields the API knows, with values of every JSON type (some valid, many not:
huge numbers, NaN, wrong types, nested junk), unknown fields, and raw bytes that are not JSON or
not UTF-8. Generation lengths stay small so the run is quick.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import OPENAI_API_KEY
from tests.e2e.harness import assert_pool_whole

PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
SUCCESS_OBJECTS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion"}

scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from([2**31, 2**63, -2**63, 10**30])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=6)
small_int = st.integers(-2, 12) | st.sampled_from([0, 2**40, -1])
text = st.text(max_size=24)
token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=6)
# Per field: values a client would send (mostly within range), then junk of any type.
valid_fields = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 20),
    "min_p": st.floats(0, 0.5), "n": st.integers(1, 2), "stop": text | st.lists(st.text(max_size=4), max_size=3),
    "seed": st.integers(0, 2**40), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 4), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "best_of": st.integers(1, 2), "use_beam_search": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "user": st.text(max_size=5),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "priority": st.integers(0, 1), "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=1),
    "max_completion_tokens": st.integers(1, 8), "unknown_field": junk,
}
path_fields = {
    "/v1/completions": {"prompt": text | token_ids | st.lists(text, min_size=1, max_size=2), "echo": st.booleans(),
                        "logprobs": st.integers(0, 3), "model": st.sampled_from(["tiny-chat", "gpt-4"])},
    "/v1/chat/completions": {
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
             "content": text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]),
                                                                "text": st.text(max_size=10)}), max_size=2)}),
            min_size=1, max_size=3),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3), "model": st.sampled_from(["tiny-chat", "x"]),
        "add_generation_prompt": st.booleans()},
    "/tokenize": {"prompt": text, "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                             "content": text}), max_size=2),
                  "add_special_tokens": st.booleans()},
    "/detokenize": {"tokens": st.lists(st.integers(-2, 520), max_size=6)},
}
BASES = {"/v1/completions": {"model": "tiny-chat", "prompt": "The lamp"},
         "/v1/chat/completions": {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}]},
         "/tokenize": {"prompt": "The lamp"}, "/detokenize": {"tokens": [40, 41]}}


@st.composite
def json_bodies(draw, path: str) -> bytes:
    """A valid body of `path`, some fields set to values in range, a few to junk; max_tokens
    small so that generations stay short."""
    body = dict(BASES[path])
    own = {**(valid_fields if path.startswith("/v1") else {}), **path_fields[path]}
    for name in draw(st.lists(st.sampled_from(sorted(own)), unique=True, max_size=4)):
        body[name] = draw(own[name])
    if draw(st.integers(0, 9)) < 4:  # some bodies stay valid, so that generations run too
        for name in draw(st.lists(st.sampled_from(sorted(own)), unique=True, min_size=1, max_size=2)):
            body[name] = draw(junk)
    if path.startswith("/v1"):
        body["max_tokens"] = draw(st.integers(1, 8) | small_int)
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.sampled_from([b"", b"{", b"null", b"[]", b'"text"', b"\xff\xfe\x00{}", b'{"prompt": "\xc3"}',
                              b'{"prompt": "\\ud83d", "max_tokens": 2}', b"{}" * 3]) | st.binary(max_size=40)


def _post(server, path: str, body: bytes) -> tuple[int, str, str]:
    request = urllib.request.Request(server.http_url + path, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {OPENAI_API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("content-type", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read().decode()


def _check_error(body: dict) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def _check_success(path: str, content_type: str, text: str) -> None:
    if content_type.startswith("text/event-stream"):
        frames = [frame for frame in text.split("\n\n") if frame]
        assert frames[-1] == "data: [DONE]", frames[-3:]
        for frame in frames[:-1]:
            if frame.startswith("event: error\n"):
                _check_error(json.loads(frame.split("data: ", 1)[1]))
                continue
            chunk = json.loads(frame.removeprefix("data: "))
            assert chunk["object"] in ("text_completion", "chat.completion.chunk"), chunk
            assert isinstance(chunk["choices"], list)
        return
    body = json.loads(text)
    if path in SUCCESS_OBJECTS:
        assert body["object"] == SUCCESS_OBJECTS[path] and body["choices"], body
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
            assert all(not isinstance(value, float) or math.isfinite(value) for value in _numbers(choice))
    elif path == "/tokenize":
        assert body["count"] == len(body["tokens"])
    else:
        assert isinstance(body["prompt"], str)


def _numbers(item):
    if isinstance(item, dict):
        for value in item.values():
            yield from _numbers(value)
    elif isinstance(item, list):
        for value in item:
            yield from _numbers(value)
    elif isinstance(item, (int, float)):
        yield item


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_bodies_get_openai_answers(openai_server, data):
    """(--hypothesis-show-statistics lists the paths, statuses and blamed params it saw.)"""
    path = data.draw(st.sampled_from(PATHS))
    body = data.draw(st.one_of(json_bodies(path), json_bodies(path), json_bodies(path), raw_bodies))
    status, content_type, text = _post(openai_server, path, body)
    param = json.loads(text)["error"]["param"] if status != 200 else ""
    event(f"{path} {status} {param}")
    assert status in (200, 400, 404, 429), (status, body[:200], text[:300])
    if status == 200:
        _check_success(path, content_type, text)
    else:
        _check_error(json.loads(text))


def test_server_is_up_and_pool_whole_after_fuzzing(openai_server):
    assert openai_server.proc.poll() is None
    with urllib.request.urlopen(openai_server.http_url + "/health", timeout=10) as response:
        assert response.status == 200
    assert_pool_whole(openai_server)
    assert not [event for event in openai_server.log_events()
                if event.get("level") == "error" and event.get("process") == "frontend"]
