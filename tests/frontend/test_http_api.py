"""The frontend's OpenAI-compatible HTTP API against a scripted scheduler, with the official
`openai` client: what only a scripted scheduler can make happen (failures before and during a
stream, readiness), and the shapes of echo, batched prompts and the request id."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from openai import OpenAI

SCRIPT = "The keeper climbed the stairs to light the lamp."
MODEL = "tiny-tokenizer"  # the folder's name: the default served model name


@pytest.fixture()
def client(frontend) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{frontend.http_port}/v1", api_key="-", max_retries=0, timeout=20)


@pytest.fixture()
def model_name(client) -> str:
    (model,) = client.models.list()
    return model.id


def _script(fake, tokenizer, *texts: str) -> list[list[int]]:
    scripts = [tokenizer.encode(text)[1:] for text in texts]
    fake.tokens_by_index = dict(enumerate(scripts))
    return scripts


def _wait_for(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _status(frontend, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{frontend.http_port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_served_model_name_defaults_to_the_folder_name(model_name, tokenizer_folder):
    assert model_name == tokenizer_folder.name


def test_text_follows_the_script_and_stop_strings(client, fake, tokenizer, model_name):
    _script(fake, tokenizer, SCRIPT)
    answer = client.completions.create(model=model_name, prompt="Hello", max_tokens=40, stop=" to")
    assert answer.choices[0].text == "The keeper climbed the stairs"
    assert answer.choices[0].finish_reason == "stop"
    assert fake.submits[-1].sampling.temperature == 1.0  # OpenAI's default, not gRPC's greedy


def test_only_a_whole_answer_without_stop_strings_asks_the_scheduler_to_hold_its_output(client, fake, tokenizer,
                                                                                       model_name):
    """stream=false and no stop string: the scheduler may merge the outputs after the first
    (hold_output); a stream, or a stop string the frontend must find token by token, never."""
    (script,) = _script(fake, tokenizer, SCRIPT)
    whole = client.completions.create(model=model_name, prompt="Hello", max_tokens=len(script))
    assert whole.choices[0].text == SCRIPT and fake.submits[-1].hold_output
    stopped = client.completions.create(model=model_name, prompt="Hello", max_tokens=40, stop=" to")
    assert stopped.choices[0].text == "The keeper climbed the stairs" and not fake.submits[-1].hold_output
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model_name, prompt="Hello", max_tokens=len(script), stream=True) if chunk.choices)
    assert streamed == SCRIPT and not fake.submits[-1].hold_output


def test_echo_and_batched_prompts_number_choices_prompt_major(client, fake, tokenizer, model_name):
    _script(fake, tokenizer, SCRIPT, SCRIPT)
    answer = client.completions.create(model=model_name, prompt=["One", "Two"], n=2, max_tokens=2, echo=True)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    assert [choice.text.split(" ")[0] for choice in answer.choices] == ["OneThe", "OneThe", "TwoThe", "TwoThe"]
    assert answer.usage.completion_tokens == 8
    whole = client.completions.create(model=model_name, prompt=["One", "Two"], max_tokens=2, echo=True)
    chunks = list(client.completions.create(model=model_name, prompt=["One", "Two"], max_tokens=2, echo=True,
                                            stream=True))
    by_index: dict[int, str] = {}
    for chunk in chunks:
        by_index[chunk.choices[0].index] = by_index.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert by_index == {choice.index: choice.text for choice in whole.choices}
    assert by_index[0].startswith("One") and by_index[1].startswith("Two")


def test_scheduler_refusals_before_the_first_token_are_http_statuses(client, fake, model_name):
    cases = [(grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError, 429),
             (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError, 400),
             (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError, 503)]
    for code, error_class, status in cases:
        fake.reject_code = code
        for stream in (False, True):
            with pytest.raises(error_class) as raised:
                client.completions.create(model=model_name, prompt="Hello", max_tokens=3, stream=stream)
            assert raised.value.status_code == status and "rejected by the fake scheduler" in raised.value.message
            if status in (429, 503):
                assert raised.value.response.headers["retry-after"] == "1"


def test_a_failure_after_the_stream_began_is_an_sse_error_frame(client, fake, tokenizer, model_name):
    (script,) = _script(fake, tokenizer, SCRIPT)
    fake.abort_after_messages = 3
    stream = client.completions.create(model=model_name, prompt="Hello", max_tokens=30, stream=True)
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk.choices[0].text)
    assert "".join(received) == tokenizer.decode(script[:3])
    assert "ended by the fake scheduler" in raised.value.message and raised.value.body["type"] == "service_unavailable"


def test_chat_without_a_template_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}])
    assert "no chat template" in raised.value.message and raised.value.body["param"] == "messages"


def test_health_follows_readiness(frontend, fake):
    assert _status(frontend, "/health") == 200
    fake.is_ready = False
    assert _wait_for(lambda: _status(frontend, "/health") == 503)
    fake.is_ready = True
    assert _wait_for(lambda: _status(frontend, "/health") == 200)


def test_request_id_header_is_echoed_or_made(frontend, fake, tokenizer, model_name):
    _script(fake, tokenizer, SCRIPT)
    body = json.dumps({"model": model_name, "prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{frontend.http_port}/v1/completions", data=body,
                                     headers={"x-request-id": "abc-1"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["x-request-id"] == "abc-1"
        assert json.loads(response.read())["id"] == "cmpl-abc-1"
    assert fake.submits[-1].request_id == "abc-1"
    with urllib.request.urlopen(f"http://127.0.0.1:{frontend.http_port}/version", timeout=5) as response:
        assert len(response.headers["x-request-id"]) == 32


def test_drain_lets_streams_finish_then_cuts_them_with_an_error_frame(tokenizer_folder, scheduler_server, fake,
                                                                      tokenizer):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.openai.config import HttpConfig
    from pagedserve.frontend.server import serve_frontend
    from pagedserve.launch.serve_config import free_port

    config = FrontendConfig(model_path=str(tokenizer_folder), scheduler_address=scheduler_server.address, port=0,
                            http=HttpConfig(port=free_port(), served_model_name="m"))
    server = serve_frontend(config, health_poll_interval_s=0.1)
    _script(fake, tokenizer, SCRIPT)
    fake.step_delay_s = 0.05
    client = OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-", max_retries=0, timeout=20)
    stream = iter(client.completions.create(model="m", prompt="Hello", max_tokens=100, stream=True))
    next(stream)
    drained = threading.Thread(target=server.drain, args=(0.3,))
    drained.start()
    assert _wait_for(lambda: _status(server, "/health") == 503, timeout=2)
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            pass
    assert "shut down before the request finished" in raised.value.message
    drained.join(10)
    assert not drained.is_alive()
