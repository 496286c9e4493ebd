"""One failure path for both protocols: a request that fails over gRPC and the same one over HTTP
are classified alike, counted once under the same metrics label, logged once with the same kind,
and (when the scheduler still runs them) aborted in the scheduler."""

from __future__ import annotations

import time

import grpc
import openai
import pytest
import structlog
from openai import OpenAI

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.generation.drain import RequestCut
from pagedserve.frontend.generation.errors import ErrorKind, UndeliveredOutputExceeded
from pagedserve.frontend.generation.failure import close_failed
from pagedserve.frontend.metrics import FrontendMetrics
from pagedserve.frontend.upstream.scheduler_client import SchedulerUnavailable, SubmitCancelled
from pagedserve.v1 import generation_pb2 as pb

FAILURE_EVENTS = {"request_failed", "request_cancelled", "request_deadline_exceeded", "request_cut_by_drain",
                  "stream_backlog_exceeded"}


@pytest.fixture()
def client(frontend) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{frontend.http_port}/v1", api_key="-", max_retries=0, timeout=20)


def _count(frontend, protocol: str, label: str) -> tuple[float, float]:
    """(requests counted under `label`, requests timed) of a protocol."""
    registry = frontend.metrics.registry
    counted = registry.get_sample_value("pagedserve_requests_total", {"finish_reason": label, "protocol": protocol})
    timed = registry.get_sample_value("pagedserve_request_latency_seconds_count", {"protocol": protocol})
    return counted, timed


def _grpc_failure(stub, request_id: str) -> grpc.StatusCode:
    request = pb.GenerateRequest(prompt="Hello", request_id=request_id, params=pb.SamplingParams(max_tokens=50))
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=20)
    return info.value.code()


def _http_failure(client, request_id: str) -> int:
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=50,
                                  extra_headers={"x-request-id": request_id})
    return raised.value.status_code


def _wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _failure_events(logs: list[dict], request_id: str) -> list[dict]:
    return [event for event in logs if event.get("request_id") == request_id and event["event"] in FAILURE_EVENTS]


# The kind of each failure, its gRPC status and HTTP status, and the metrics label it counts under.
SCHEDULER_FAILURES = [
    ("refused-busy", dict(reject_code=grpc.StatusCode.RESOURCE_EXHAUSTED), ErrorKind.BUSY,
     grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rejected"),
    ("refused-invalid", dict(reject_code=grpc.StatusCode.INVALID_ARGUMENT), ErrorKind.INVALID,
     grpc.StatusCode.INVALID_ARGUMENT, 400, "rejected"),
    ("refused-unavailable", dict(reject_code=grpc.StatusCode.UNAVAILABLE), ErrorKind.UNAVAILABLE,
     grpc.StatusCode.UNAVAILABLE, 503, "error"),
    ("broken-stream", dict(bad_index_at_message=1), ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL, 500, "error"),
]


@pytest.mark.parametrize("name, script, kind, grpc_code, http_status, label", SCHEDULER_FAILURES,
                         ids=[case[0] for case in SCHEDULER_FAILURES])
def test_a_failure_is_classified_and_counted_alike_over_grpc_and_http(
        stub, client, fake, frontend, name, script, kind, grpc_code, http_status, label):
    for key, value in script.items():
        setattr(fake, key, value)
    before = {protocol: _count(frontend, protocol, label) for protocol in ("grpc", "http")}
    with structlog.testing.capture_logs() as logs:
        assert _grpc_failure(stub, f"{name}-grpc") == grpc_code
        assert _http_failure(client, f"{name}-http") == http_status
    for protocol in ("grpc", "http"):
        counted, timed = _count(frontend, protocol, label)
        assert (counted - before[protocol][0], timed - before[protocol][1]) == (1, 1), protocol
        (event,) = _failure_events(logs, f"{name}-{protocol}")
        assert (event["event"], event["kind"]) == ("request_failed", kind.value), event
    assert [event["code"] for event in _failure_events(logs, f"{name}-grpc")] == [grpc_code.name]
    assert [event["code"] for event in _failure_events(logs, f"{name}-http")] == [http_status]


def test_a_stream_broken_mid_request_is_aborted_in_the_scheduler(stub, client, fake):
    """The frontend gives up on a scheduler stream that is still running (it named a completion
    that does not exist): over either protocol the scheduler sees that request's stream cancelled."""
    fake.bad_index_at_message = 2
    _grpc_failure(stub, "broken-grpc")
    _http_failure(client, "broken-http")
    for request_id in ("broken-grpc", "broken-http"):
        assert _wait_for(lambda: request_id in fake.cancelled_ids), request_id
        assert request_id not in fake.completed_ids, request_id


# -- the decision table, on its own ----------------------------------------------------------------
def _close(exc: BaseException, **options):
    metrics = FrontendMetrics()
    timer = metrics.start_request("http")
    with structlog.testing.capture_logs() as logs:
        error = close_failed(exc, timer, request_id="r", code_of=lambda error: error.kind.name, **options)
        close_failed(SchedulerUnavailable("later"), timer, request_id="r")  # a second close: counted once
    counts = {label: metrics.registry.get_sample_value(
        "pagedserve_requests_total", {"finish_reason": label, "protocol": "http"}) for label in ("abort", "error",
                                                                                               "rejected")}
    return error, {label: count for label, count in counts.items() if count}, logs[0]


def test_the_backlog_comes_before_the_cut_and_the_cut_before_the_cancellation():
    error, counts, event = _close(UndeliveredOutputExceeded(5, 4), was_cut=True)
    assert (error.kind, counts, event["event"], event["max_undelivered"]) == (
        ErrorKind.BUSY, {"abort": 1}, "stream_backlog_exceeded", 4)
    error, counts, event = _close(SubmitCancelled("gone", grpc.StatusCode.CANCELLED), was_cut=True)
    assert (error.kind, error.message, counts, event["event"]) == (
        ErrorKind.UNAVAILABLE, str(RequestCut()), {"error": 1}, "request_cut_by_drain")


def test_a_cancellation_is_a_timeout_when_the_deadline_has_passed():
    gone = SubmitCancelled("gone", grpc.StatusCode.CANCELLED)
    error, counts, event = _close(gone)
    assert (error.kind, counts, event["event"], event["code"]) == (
        ErrorKind.CANCELLED, {"abort": 1}, "request_cancelled", "CANCELLED")
    error, counts, event = _close(gone, deadline_passed=lambda: True)
    assert (error.kind, counts, event["event"], event["code"]) == (
        ErrorKind.TIMEOUT, {"abort": 1}, "request_deadline_exceeded", "TIMEOUT")


def test_any_other_failure_is_classified_and_names_its_field():
    error, counts, event = _close(InvalidParameter("temperature", "must be >= 0"))
    assert (error.kind, error.param, counts) == (ErrorKind.INVALID, "temperature", {"rejected": 1})
    assert (event["event"], event["log_level"], event["param"]) == ("request_failed", "info", "temperature")
    error, counts, event = _close(KeyError("bug"))
    assert (error.kind, counts, event["log_level"]) == (ErrorKind.INTERNAL, {"error": 1}, "error")
