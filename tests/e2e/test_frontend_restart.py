"""A frontend killed under `serve` is started again on the same ports: killed idle, new gRPC and
HTTP requests succeed once it is back; killed under load, the streams it was serving end with
UNAVAILABLE (gRPC) or a cut connection (HTTP), the scheduler aborts their requests and frees their
blocks, and new requests succeed with the undisturbed tokens."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import grpc

from tests.e2e.conftest import start_server
from tests.e2e.harness import assert_pool_whole, token_request, wait_for

PROMPTS = [[7 + i, 40, 41, 42 + 3 * i] * (2 + i) for i in range(3)]
MAX_TOKENS = 900  # within max_model_len (1024); the streams wait on the kill before they finish


def _greedy(server, prompt: list[int]) -> list[int]:
    return list(server.stub.Generate(token_request(prompt, max_tokens=16, ignore_eos=True),
                                     timeout=120).completions[0].token_ids)


def _http_completion(server, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                       "temperature": 0}).encode()
    request = urllib.request.Request(server.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]


def _kill_frontend_and_wait_back(server) -> None:
    old = server.child_pids()["frontend"]
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: server.child_pids().get("frontend") not in (None, old), timeout=60), server.logs()[-3000:]
    server.wait_ready(120)


def _stream(server, prompt: list[int], received: list[int], codes: list) -> None:
    try:
        for message in server.stub.GenerateStream(
                token_request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=240):
            for completion in message.completions:
                received.extend(completion.token_ids)
        codes.append("finished")
    except grpc.RpcError as exc:
        codes.append(exc.code())


def _http_stream(server, prompt: list[int], received: list[bytes], outcome: list) -> None:
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(server.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=240) as response:
            for line in response:
                received.append(line)
        outcome.append("ended")
    except Exception as exc:  # the connection reset or cut short
        outcome.append(type(exc).__name__)


def test_a_killed_frontend_is_restarted_idle_and_under_load(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "frontend-kill", "--num-kv-blocks", "512",
                          "--served-model-name", "demo", http_port=True)
    try:
        undisturbed = _greedy(server, PROMPTS[0])
        http_undisturbed = _http_completion(server, PROMPTS[0])

        _kill_frontend_and_wait_back(server)  # idle
        assert _greedy(server, PROMPTS[0]) == undisturbed
        assert _http_completion(server, PROMPTS[0])["text"] == http_undisturbed["text"]

        received = [[] for _ in PROMPTS]
        codes: list = []
        http_received: list[bytes] = []
        http_outcome: list = []
        threads = [threading.Thread(target=_stream, args=(server, prompt, tokens, codes))
                   for prompt, tokens in zip(PROMPTS, received)]
        threads.append(threading.Thread(target=_http_stream, args=(server, PROMPTS[1], http_received, http_outcome)))
        for thread in threads:
            thread.start()
        assert wait_for(lambda: all(len(tokens) >= 3 for tokens in received) and len(http_received) >= 6,
                        timeout=120)
        assert server.stats().num_running == len(PROMPTS) + 1
        _kill_frontend_and_wait_back(server)  # under load
        for thread in threads:
            thread.join(60)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * len(PROMPTS), codes
        assert len(http_outcome) == 1 and not any(line.startswith(b"data: [DONE]") for line in http_received)
        assert all(len(tokens) < MAX_TOKENS for tokens in received)
        assert_pool_whole(server, timeout=60)  # the orphaned requests were aborted, their blocks freed
        assert _greedy(server, PROMPTS[0]) == undisturbed
        assert _http_completion(server, PROMPTS[0])["text"] == http_undisturbed["text"]

        exits = [event for event in server.log_events()
                 if event.get("event") == "child_exited" and event.get("child") == "frontend"]
        assert [event["delay_seconds"] for event in exits] == [1, 2]
        assert [event["restarts_left"] for event in exits] == [4, 3]
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
