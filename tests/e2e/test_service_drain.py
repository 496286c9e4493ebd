"""SIGTERM on `serve` drains it: readiness turns NOT_SERVING and new calls get UNAVAILABLE at
once, the streams already running finish whole, then every process exits 0."""

from __future__ import annotations

import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from tests.e2e.conftest import start_server
from tests.e2e.harness import PAUSE_ARGS, token_request, wait_for

NUM_STREAMS = 3
MAX_TOKENS = 200  # the drain is observed while the workers are paused: no need for long streams


def test_sigterm_finishes_running_streams_and_refuses_new_ones(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "drain", "--shutdown-timeout", "60", *PAUSE_ARGS)
    try:
        first_tokens = threading.Barrier(NUM_STREAMS + 1)
        results: dict[int, dict] = {}

        def stream(i: int) -> None:
            record = {"tokens": 0, "finish_reason": 0, "last_message_at": 0.0, "error": None}
            results[i] = record
            request = token_request([60 + i] * 8, max_tokens=MAX_TOKENS, ignore_eos=True)
            is_first = True
            try:
                for message in server.stub.GenerateStream(request, timeout=300):
                    record["tokens"] += len(message.completions[0].token_ids)
                    record["finish_reason"] = message.completions[0].finish_reason
                    record["last_message_at"] = time.monotonic()
                    if is_first:
                        is_first = False
                        first_tokens.wait(60)
            except grpc.RpcError as exc:
                record["error"] = exc.code()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        first_tokens.wait(60)
        # the streams cannot end while the drain is observed, however fast the host decodes
        with server.workers_paused():
            server.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: server.health() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30)
            assert server.health("") == health_pb2.HealthCheckResponse.SERVING, "alive while draining"
            try:
                server.stub.Generate(token_request([1, 2, 3], max_tokens=2), timeout=10)
                refused_code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                refused_code, details = exc.code(), exc.details()
            refused_at = time.monotonic()
        assert refused_code == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in details

        for thread in threads:
            thread.join(300)
        for record in results.values():
            assert record["error"] is None, record
            assert record["tokens"] == MAX_TOKENS
            assert record["finish_reason"] == 1  # FINISH_REASON_LENGTH
        assert max(record["last_message_at"] for record in results.values()) > refused_at, \
            "the streams had ended before the drain was observed"
        assert server.proc.wait(90) == 0
        events = {(event.get("process"), event["event"]): event for event in server.log_events()}
        assert events[("frontend", "frontend_stopped")]["num_requests_cut"] == 0
        assert events[("scheduler", "scheduler_stopping")]["num_streams_cut"] == 0
    finally:
        server.stop()
