"""Observability of a real `serve`: the pinned Prometheus metrics and the latency histograms of
both processes, JSON logs with the request id bound in frontend and scheduler, and the request
id taken from `x-request-id` metadata."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import token_request, wait_for

FRONTEND_METRICS = [
    "pagedserve_time_to_first_token_seconds_count", "pagedserve_inter_token_latency_seconds_count",
    "pagedserve_request_latency_seconds_count", "pagedserve_requests_total",
    "pagedserve_prompt_tokens_total", "pagedserve_generation_tokens_total",
]
SCHEDULER_METRICS = [
    "pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_requests_swapped",
    "pagedserve_kv_blocks_total", "pagedserve_kv_blocks_used", "pagedserve_preemptions_total",
    "pagedserve_prefix_cache_queries_total", "pagedserve_prefix_cache_hits_total",
    "pagedserve_step_seconds_count", "pagedserve_queue_time_seconds_count",
]
PROMPT = [11, 12, 13, 14, 15, 16]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_pinned_metrics_and_latency_histograms(service_server):
    frontend_before = _samples(service_server.metrics("frontend"))
    scheduler_before = _samples(service_server.metrics("scheduler"))
    list(service_server.stub.GenerateStream(token_request(PROMPT, max_tokens=8, ignore_eos=True), timeout=60))
    frontend = _samples(service_server.metrics("frontend"))
    names = {name for name, _ in frontend}
    assert set(FRONTEND_METRICS) <= names, set(FRONTEND_METRICS) - names

    def delta(name: str, **labels) -> float:  # of the gRPC requests: the metrics tell protocols apart
        labels["protocol"] = "grpc"
        return _value(frontend, name, **labels) - _value(frontend_before, name, **labels)

    assert delta("pagedserve_time_to_first_token_seconds_count") == 1
    assert delta("pagedserve_inter_token_latency_seconds_count") == 7  # 8 tokens, each as it comes
    assert delta("pagedserve_request_latency_seconds_count") == 1
    assert delta("pagedserve_requests_total", finish_reason="length") == 1
    assert delta("pagedserve_prompt_tokens_total") == len(PROMPT)
    assert delta("pagedserve_generation_tokens_total") == 8
    # a whole answer (unary, no stop string) arrives as its first output and the rest merged
    # (hold_output): a time to first token, no inter-token gaps
    frontend_before = frontend
    service_server.stub.Generate(token_request(PROMPT, max_tokens=8, ignore_eos=True), timeout=60)
    frontend = _samples(service_server.metrics("frontend"))
    assert delta("pagedserve_time_to_first_token_seconds_count") == 1
    assert delta("pagedserve_inter_token_latency_seconds_count") == 0
    assert delta("pagedserve_generation_tokens_total") == 8

    assert wait_for(lambda: _value(_samples(service_server.metrics("scheduler")),
                                   "pagedserve_queue_time_seconds_count")
                    > _value(scheduler_before, "pagedserve_queue_time_seconds_count"), timeout=10)
    scheduler = _samples(service_server.metrics("scheduler"))
    names = {name for name, _ in scheduler}
    assert set(SCHEDULER_METRICS) <= names, set(SCHEDULER_METRICS) - names
    assert _value(scheduler, "pagedserve_kv_blocks_total") == service_server.stats().num_gpu_blocks_total
    # each request: its prefill, then decode runs (a run of several forwards is one step)
    assert (_value(scheduler, "pagedserve_step_seconds_count")
            >= _value(scheduler_before, "pagedserve_step_seconds_count") + 4)
    assert {"swap", "recompute"} <= {dict(labels).get("mode") for name, labels in scheduler
                                     if name == "pagedserve_preemptions_total"}


def _events(server, request_id: str) -> list[dict]:
    return [event for event in server.log_events() if event.get("request_id") == request_id]


@pytest.mark.parametrize("streaming", [False, True])
def test_request_id_from_metadata_is_bound_in_frontend_and_scheduler_logs(service_server, streaming):
    request_id = f"trace-{'stream' if streaming else 'unary'}-7f3a"
    metadata = (("x-request-id", request_id),)
    request = token_request(PROMPT, max_tokens=3)
    if streaming:
        call = service_server.stub.GenerateStream(request, metadata=metadata, timeout=60)
        messages = list(call)
        assert {message.request_id for message in messages} == {request_id}
    else:
        response, call = service_server.stub.Generate.with_call(request, metadata=metadata, timeout=60)
        assert response.request_id == request_id
    assert (("x-request-id", request_id)) in tuple(call.initial_metadata())

    def logged() -> set[tuple[str, str]]:
        return {(event["process"], event["event"]) for event in _events(service_server, request_id)}

    expected = {("frontend", "request_finished"), ("scheduler", "request_submitted"),
                ("scheduler", "request_finished")}
    assert wait_for(lambda: expected <= logged(), timeout=10), logged()
    for event in _events(service_server, request_id):
        assert {"timestamp", "level", "pid"} <= set(event), event


def test_request_id_field_wins_and_errors_carry_the_id(service_server):
    request = token_request(PROMPT, max_tokens=2)
    request.request_id = "from-the-field"
    response = service_server.stub.Generate(request, metadata=(("x-request-id", "from-metadata"),), timeout=60)
    assert response.request_id == "from-the-field"
    with pytest.raises(grpc.RpcError) as info:
        service_server.stub.Generate(token_request(PROMPT, temperature=-1.0),
                                     metadata=(("x-request-id", "trace-refused"),), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("x-request-id", "trace-refused") in tuple(info.value.trailing_metadata())
    assert wait_for(lambda: any(event["event"] == "request_failed" and event["process"] == "frontend"
                                for event in _events(service_server, "trace-refused")), timeout=10)
