"""Back-pressure of a real `serve` with a tiny waiting queue (one running sequence, two waiting
requests, 100 waiting prompt tokens): a full queue answers RESOURCE_EXHAUSTED before any
response is sent, and overload is refused rather than queued. The queue is filled while the
workers are paused (ServeProcess.workers_paused): no step can take a request off it meanwhile, so
what is accepted and what is refused does not depend on the host's speed."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.conftest import start_server
from tests.e2e.harness import PAUSE_ARGS, assert_pool_whole, token_request, wait_for

MAX_WAITING_REQUESTS = 2
MAX_WAITING_TOKENS = 100


@pytest.fixture(scope="module")
def small_queue_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "small-queue", "--max-num-seqs", "1",
                          "--max-waiting-requests", str(MAX_WAITING_REQUESTS),
                          "--max-waiting-tokens", str(MAX_WAITING_TOKENS), "--num-kv-blocks", "128", *PAUSE_ARGS)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _request(request_id: str, prompt: list[int], max_tokens: int):
    request = token_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    request.request_id = request_id
    return request


def _start_running(server, request_id: str):
    """A long stream that holds the only running slot."""
    call = server.stub.GenerateStream(_request(request_id, [3, 4, 5, 6], 1000), timeout=180)
    assert next(call).completions[0].token_ids
    return call


def _refusal(call_result) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call_result()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    return info.value


def test_full_queue_is_resource_exhausted_before_any_response(small_queue_server):
    server = small_queue_server
    running = _start_running(server, "bp-running")
    with server.workers_paused():
        waiting = [server.stub.GenerateStream(_request(f"bp-waiting-{i}", [20 + i] * 10, 4), timeout=180)
                   for i in range(MAX_WAITING_REQUESTS)]
        server.wait_submitted(*(f"bp-waiting-{i}" for i in range(MAX_WAITING_REQUESTS)))

        refused = server.stub.GenerateStream(_request("bp-refused-stream", [30] * 10, 4), timeout=60)
        error = _refusal(lambda: next(refused))
        assert "waiting queue is full" in error.details()
        assert tuple(refused.initial_metadata()) == (), "headers went out before the status"
        _refusal(lambda: server.stub.Generate(_request("bp-refused-unary", [31] * 10, 4), timeout=60))
    assert server.stats().num_waiting == MAX_WAITING_REQUESTS

    running.cancel()
    for call in waiting:
        messages = list(call)
        assert messages[-1].HasField("usage") and messages[-1].usage.completion_tokens == 4
    assert_pool_whole(server)
    rejected = [event for event in server.log_events()
                if event["event"] == "request_rejected" and event.get("process") == "scheduler"]
    assert {"bp-refused-stream", "bp-refused-unary"} <= {event["request_id"] for event in rejected}
    assert {event["code"] for event in rejected} == {"RESOURCE_EXHAUSTED"}


def test_waiting_prompt_tokens_are_bounded(small_queue_server):
    server = small_queue_server
    running = _start_running(server, "tokens-running")
    with server.workers_paused():
        waiting = [server.stub.GenerateStream(_request("tokens-60", [40] * 60, 2), timeout=180)]
        server.wait_submitted("tokens-60")
        error = _refusal(lambda: server.stub.Generate(_request("tokens-60-more", [41] * 60, 2), timeout=60))
        assert "prompt tokens" in error.details()
        waiting.append(server.stub.GenerateStream(_request("tokens-30", [42] * 30, 2), timeout=180))
        server.wait_submitted("tokens-30")  # 60 + 30 tokens fit the bound of 100
    assert server.stats().num_waiting == 2
    running.cancel()
    for call in waiting:
        assert list(call)[-1].usage.completion_tokens == 2
    assert_pool_whole(server)


def test_overload_is_refused_not_queued(small_queue_server):
    """24 requests at once while one stream holds the only running slot: the queue takes two,
    the other 22 are refused at once; the two run when the slot frees."""
    server = small_queue_server
    num_requests = 24
    running = _start_running(server, "overload-running")

    def send(i: int) -> grpc.StatusCode:
        try:
            server.stub.Generate(_request(f"burst-{i}", [50 + i] * 8, 30), timeout=120)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(num_requests) as pool:
        with server.workers_paused():
            futures = [pool.submit(send, i) for i in range(num_requests)]
            num_refused = num_requests - MAX_WAITING_REQUESTS
            assert wait_for(lambda: sum(future.done() for future in futures) >= num_refused, timeout=60)
        assert server.stats().num_waiting == MAX_WAITING_REQUESTS
        running.cancel()
    codes = Counter(future.result() for future in futures)
    assert codes == {grpc.StatusCode.OK: MAX_WAITING_REQUESTS, grpc.StatusCode.RESOURCE_EXHAUSTED: num_refused}, codes
    assert_pool_whole(server)
