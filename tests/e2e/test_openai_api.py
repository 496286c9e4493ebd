"""The OpenAI-compatible HTTP API of a real `serve`, driven by the official `openai` client.

The server (conftest.openai_server) serves a tiny Llama checkpoint whose tokenizer has a chat
template, as `tiny-chat`, behind an API key, with room for 4 running sequences and 2 waiting
requests.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import OPENAI_API_KEY
from tests.e2e.harness import assert_pool_whole, text_request, wait_for

MODEL = "tiny-chat"
PROMPT = "The keeper climbed the narrow stairs to light the lamp"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Where is the lighthouse?"}]


@pytest.fixture(scope="module")
def client(openai_server) -> OpenAI:
    return OpenAI(base_url=openai_server.http_url + "/v1", api_key=OPENAI_API_KEY, max_retries=0, timeout=60)


@dataclass
class RawResponse:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def _request(server, path: str, body: bytes | str | None, key: str | None) -> RawResponse:
    """A plain HTTP call (urllib), for what the openai client would not send."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(server.http_url + path, data=data, headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return RawResponse(response.status, response.read().decode())
    except urllib.error.HTTPError as exc:
        return RawResponse(exc.code, exc.read().decode())


def _get(server, path: str, key: str | None = OPENAI_API_KEY) -> RawResponse:
    return _request(server, path, None, key)


def _post(server, path: str, content: bytes | str, key: str | None = OPENAI_API_KEY) -> RawResponse:
    return _request(server, path, content, key)


def test_completion_whole_and_streamed_agree_and_match_grpc(client, openai_server):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.model == MODEL and whole.id.startswith("cmpl-")
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks)
    grpc_answer = openai_server.stub.Generate(text_request(PROMPT, max_tokens=12, ignore_eos=True), timeout=60)
    assert grpc_answer.completions[0].text == choice.text
    assert grpc_answer.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_renders_the_template_and_takes_content_parts(client, openai_server):
    rendered = "<s><|system|>\nYou are terse.</s>\n<|user|>\nWhere is the lighthouse?</s>\n<|assistant|>\n"
    tokens = _post(openai_server, "/tokenize", json.dumps({"messages": MESSAGES})).json()["tokens"]
    by_text = _post(openai_server, "/tokenize", json.dumps({"prompt": rendered, "add_special_tokens": False}))
    assert tokens == by_text.json()["tokens"]
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Where is the"},
                                                       {"type": "text", "text": "lighthouse?"}]}]
    joined = [MESSAGES[0], {"role": "user", "content": "Where is the\nlighthouse?"}]
    first = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=6, temperature=0)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_usage_chunk_reports_cached_prompt_tokens(client):
    prompt = PROMPT + ", and every evening the keeper lit the lamp again and again."  # > 2 blocks of 16
    usages = []
    for _ in range(2):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert all(chunk.usage is None for chunk in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        usages.append(chunks[-1].usage)
    assert usages[0].completion_tokens == usages[1].completion_tokens == 4
    assert usages[1].prompt_tokens_details.cached_tokens >= 16  # the second reuses the first's blocks
    chat_chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == 3


def test_continuous_usage_counts_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (load generators such as guidellm send it):
    each chunk's usage counts its choice's prompt and the tokens generated so far."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, seed=1, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    prompt_tokens = last.usage.prompt_tokens  # one prompt, counted once for its two choices
    counts = {0: [], 1: []}
    for chunk in choice_chunks:
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
        counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    for index, seen in counts.items():
        assert seen[0] == 0 and seen == sorted(seen) and seen[-1] == 5  # the role chunk first, then growing


def test_n_choices_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, stream=True,
                                                 seed=3, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert {chunk.choices[0].index for chunk in chunks} == {0, 1}
    assert all(texts.values())


def test_logprobs_of_completions_and_chat(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the best
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for token in content:
        assert len(token.top_logprobs) == 2 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
    no_top = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(token.top_logprobs == [] for token in no_top.choices[0].logprobs.content)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens] == logprobs.tokens


def test_stop_string_ends_the_text(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "§§"],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]
    included = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert included.choices[0].text == text[:text.index(stop) + len(stop)]


def test_same_seed_same_text(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content
    assert sample(11) == sample(11)


def test_max_completion_tokens_wins_over_max_tokens(client):
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=3,
                                            extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"


def test_beam_search_through_the_grpc_path(client, openai_server):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    grpc_answer = openai_server.stub.Generate(text_request(PROMPT, max_tokens=6, beam_width=2, ignore_eos=True),
                                              timeout=60)
    assert [choice.text for choice in answer.choices] == [c.text for c in grpc_answer.completions]


@pytest.mark.parametrize("params, param, words", [
    ({"temperature": -1}, "temperature", "must be >= 0"),
    ({"top_p": 3.0}, "top_p", "(0, 1]"),
    ({"extra_body": {"n": "two"}}, "n", "valid integer"),
    ({"max_tokens": 5000}, "max_tokens", "max_model_len"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
    ({"best_of": 3}, "best_of", "use_beam_search"),
    ({"extra_body": {"priority": 2**31}}, "priority", "must be in"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}}},
     "response_format", "Unimplemented keys"),
    ({"extra_body": {"allowed_token_ids": [1, 2]}}, "allowed_token_ids", "not supported"),
    ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens", "not supported"),
])
def test_bad_requests_raise_bad_request_error_naming_the_field(client, params, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 4, **params})
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param and raised.value.body["type"] == "invalid_request_error"
    assert words in raised.value.message


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert raised.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    assert raised.value.body["param"] == "top_logprobs"


def test_malformed_bodies_are_400_not_422_or_500(openai_server):
    for body in (b"{not json", b"\xff\xfe{}", b"[1, 2]", b'{"prompt": "a\\ud800b", "max_tokens": 2}', b"",
                 b'{"model": "tiny-chat", "prompt": 5}', b'{"model": "tiny-chat"}',
                 b"{" * 100_000 + b"}" * 100_000):
        response = _post(openai_server, "/v1/completions", body)
        assert response.status_code == 400, (body[:40], response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    huge = json.dumps({"model": MODEL, "prompt": "x" * (17 * 2**20)})
    response = _post(openai_server, "/v1/completions", huge)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


def test_api_key_is_required_except_for_health(openai_server):
    wrong = OpenAI(base_url=openai_server.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert raised.value.status_code == 401 and "API key" in raised.value.message
    assert _get(openai_server, "/v1/models", key=None).status_code == 401
    assert _get(openai_server, "/health", key=None).status_code == 200


def test_unknown_model_and_path_are_404(client, openai_server):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert "gpt-4" in raised.value.message and raised.value.body["code"] == "model_not_found"
    assert _get(openai_server, "/v1/nothing").status_code == 404
    assert _get(openai_server, "/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_models_tokenize_detokenize_version(client, openai_server):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    tokens = _post(openai_server, "/tokenize", json.dumps({"model": MODEL, "prompt": PROMPT})).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = _post(openai_server, "/detokenize", json.dumps({"tokens": tokens["tokens"]})).json()["prompt"]
    assert text == PROMPT
    assert _get(openai_server, "/version").json()["version"]


def test_flooding_the_waiting_queue_raises_rate_limit_error(client, openai_server):
    """12 streams while the workers are paused: no step can take a request off the waiting queue,
    so beyond the 4 of the first step and the 2 the queue holds, every one is refused at once."""
    results, streams, lock = [], [], threading.Lock()

    def one() -> None:
        try:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, stream=True,
                                               extra_body={"ignore_eos": True})
            with lock:
                streams.append(stream)
            results.append("ok")
        except openai.RateLimitError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(12)]
    with openai_server.workers_paused():
        for thread in threads:
            thread.start()
        assert wait_for(lambda: sum(isinstance(result, openai.RateLimitError) for result in results) >= 12 - 4 - 2,
                        timeout=60), results
    for thread in threads:
        thread.join(60)
    for stream in streams:
        stream.close()
    limited = [result for result in results if isinstance(result, openai.RateLimitError)]
    assert limited, results
    assert "waiting" in limited[0].message and limited[0].response.headers["retry-after"] == "1"
    assert len(results) == 12
    assert_pool_whole(openai_server)


def _frontend_sample(server, name: str, **labels) -> float:
    for family in text_string_to_metric_families(server.metrics("frontend")):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _aborts(server) -> float:
    return _frontend_sample(server, "pagedserve_requests_total", finish_reason="abort", protocol="http")


def _scheduler_events(server, request_id: str) -> list[str]:
    return [event["event"] for event in server.log_events()
            if event.get("process") == "scheduler" and event.get("request_id") == request_id]


def test_disconnect_mid_stream_aborts_and_frees_blocks(client, openai_server):
    aborted = _aborts(openai_server)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"x-request-id": "http-disconnect"})
    for _ in range(3):
        next(iter(stream))
    assert openai_server.stats().num_running == 1
    with openai_server.workers_paused():  # it cannot finish: only the disconnect can end it
        stream.close()
        assert wait_for(lambda: _aborts(openai_server) == aborted + 1, timeout=30)
        assert wait_for(lambda: "request_aborted" in _scheduler_events(openai_server, "http-disconnect"), timeout=30)
    stats = assert_pool_whole(openai_server)
    assert stats.num_running == 0
    assert "request_finished" not in _scheduler_events(openai_server, "http-disconnect")


def test_client_timeout_aborts_a_whole_request(client, openai_server):
    """The request waits on paused workers: it cannot finish before the client's timeout."""
    aborted = _aborts(openai_server)
    with openai_server.workers_paused():
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=2.0).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=1000, extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": "http-timeout"})
        assert wait_for(lambda: _aborts(openai_server) == aborted + 1, timeout=30)
        assert wait_for(lambda: "request_aborted" in _scheduler_events(openai_server, "http-timeout"), timeout=30)
    assert_pool_whole(openai_server)
    assert "request_finished" not in _scheduler_events(openai_server, "http-timeout")


def test_http_requests_are_counted_and_logged(client, openai_server):
    finished = _frontend_sample(openai_server, "pagedserve_requests_total", finish_reason="length", protocol="http")
    response = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                           extra_body={"ignore_eos": True},
                                                           extra_headers={"x-request-id": "http-req-1"})
    assert response.headers["x-request-id"] == "http-req-1"
    assert _frontend_sample(openai_server, "pagedserve_requests_total", finish_reason="length",
                            protocol="http") == finished + 1
    assert _frontend_sample(openai_server, "pagedserve_generation_tokens_total", protocol="http") >= 3

    def access_line():
        return next((event for event in openai_server.log_events() if event.get("event") == "http_request"
                     and event.get("request_id") == "http-req-1"), None)
    assert wait_for(lambda: access_line() is not None, timeout=10)
    line = access_line()
    assert line["status"] == 200 and line["path"] == "/v1/completions" and line["latency_ms"] > 0
    assert any(event.get("event") == "request_finished" and event.get("request_id") == "http-req-1"
               for event in openai_server.log_events())


def test_health_is_200_when_ready(openai_server):
    with urllib.request.urlopen(openai_server.http_url + "/health", timeout=10) as response:
        assert response.status == 200
