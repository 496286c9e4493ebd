"""Cancellation, deadlines and a dying frontend: the scheduler aborts the work and every block
comes back (real `serve`, plus a second `pagedserve frontend` process that is killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.security.internal_token import INTERNAL_TOKEN_ENV
from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2_grpc
from tests.e2e.harness import assert_pool_whole, token_request, wait_for

PROMPT = [7 + i % 50 for i in range(40)]  # 40 tokens: three blocks of 16
LONG = 900  # far more tokens than any test waits for
DEADLINE_S = 2.0  # ample for the call to reach the scheduler; no token comes while the workers are paused


def _long_request(request_id: str, max_tokens: int = LONG):
    # three choices (three sequences, the most the pool holds at this length); the tests cancel it
    # while the workers are paused, so it cannot finish first however fast the host decodes
    request = token_request(PROMPT, max_tokens=max_tokens, ignore_eos=True, n=3)
    request.request_id = request_id
    return request


def _scheduler_events(server, request_id: str) -> list[str]:
    return [event["event"] for event in server.log_events()
            if event.get("process") == "scheduler" and event.get("request_id") == request_id]


def _was_aborted(server, request_id: str) -> bool:
    return wait_for(lambda: "request_aborted" in _scheduler_events(server, request_id), timeout=10)


def test_cancelled_stream_is_aborted_and_its_blocks_freed(service_server):
    call = service_server.stub.GenerateStream(_long_request("cancel-stream"), timeout=120)
    assert next(call).completions[0].token_ids
    held = service_server.stats()
    assert held.num_running == 1 and held.num_gpu_blocks_used >= 3
    with service_server.workers_paused():  # no step runs between the check above and the cancel
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert _was_aborted(service_server, "cancel-stream")
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert_pool_whole(service_server)
    assert "request_finished" not in _scheduler_events(service_server, "cancel-stream")


def test_cancelled_unary_call_is_aborted_and_its_blocks_freed(service_server):
    future = service_server.stub.Generate.future(_long_request("cancel-unary"), timeout=120)
    assert wait_for(lambda: service_server.stats().num_gpu_blocks_used >= 3, timeout=30)
    with service_server.workers_paused():  # no step runs between the check above and the cancel
        future.cancel()
        assert future.cancelled()
        assert _was_aborted(service_server, "cancel-unary")
    assert_pool_whole(service_server)
    assert "request_finished" not in _scheduler_events(service_server, "cancel-unary")


@pytest.mark.parametrize("streaming", [False, True])
def test_deadline_exceeded_is_reported_and_the_request_aborted(service_server, streaming):
    """The call waits on paused workers: no token can come before its deadline, on any host."""
    request_id = f"deadline-{'stream' if streaming else 'unary'}"
    request = _long_request(request_id)
    num_tokens = 0
    with service_server.workers_paused():
        with pytest.raises(grpc.RpcError) as info:
            if streaming:
                for message in service_server.stub.GenerateStream(request, timeout=DEADLINE_S):
                    num_tokens += len(message.completions[0].token_ids)
            else:
                service_server.stub.Generate(request, timeout=DEADLINE_S)
        assert _was_aborted(service_server, request_id)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert num_tokens == 0
    assert_pool_whole(service_server)
    assert "request_finished" not in _scheduler_events(service_server, request_id)
    frontend_codes = wait_for(lambda: any(
        event.get("request_id") == request_id and event.get("process") == "frontend"
        and (event["event"] == "request_deadline_exceeded" or event.get("code") == "DEADLINE_EXCEEDED")
        for event in service_server.log_events()), timeout=10)
    assert frontend_codes, "the frontend did not report the deadline"


def test_killed_frontend_has_its_requests_aborted(service_server, llama_checkpoint, tmp_path):
    """A second frontend on the same scheduler dies (SIGKILL) with three streams running: the
    scheduler sees their Submit streams close, aborts them and gets every block back."""
    port = free_port()
    log = open(tmp_path / "frontend.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "frontend", "--model", str(llama_checkpoint),
         "--port", str(port), "--http-port", "0", "--scheduler-address", f"127.0.0.1:{service_server.scheduler_port}"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, INTERNAL_TOKEN_ENV: service_server.internal_token})  # the scheduler's token
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)

        def is_serving() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"),
                                    timeout=2).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        assert wait_for(is_serving, timeout=120, interval=0.25), (tmp_path / "frontend.log").read_text()
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.GenerateStream(_long_request(f"orphan-{i}"), timeout=120) for i in range(3)]
        for call in calls:
            assert next(call).completions[0].token_ids
        assert service_server.stats().num_running == 3
        with service_server.workers_paused():  # none can finish between the check and the kill
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    list(call)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            for i in range(3):
                assert _was_aborted(service_server, f"orphan-{i}")
        assert_pool_whole(service_server)
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    response = service_server.stub.Generate(token_request([1, 2, 3], max_tokens=2), timeout=60)
    assert len(response.completions[0].token_ids) == 2, "the serve's own frontend stopped serving"
