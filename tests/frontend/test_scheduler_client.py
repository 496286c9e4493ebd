"""The frontend's client of the scheduler's internal service reads each Submit stream on the thread
that iterates it (no channel spin thread between gRPC and that thread), and still ends the stream
the way the rest of the frontend expects: every message, then the end; a cancel from another
thread; a deadline. On a scheduler that serves Session, the same requests share one Session and
end the same ways."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerClient, SchedulerRejected, SchedulerTimeout, SubmitCancelled,
)


@pytest.fixture(params=["submit", "session"])
def client(request, scheduler_server, fake):
    fake.has_session = request.param == "session"
    client = SchedulerClient(scheduler_server.address, frontend_id="test")
    assert client.get_info().has_session == fake.has_session
    yield client
    client.close()


def _request(request_id: str, max_tokens: int) -> Request:
    return Request(request_id=request_id, prompt_token_ids=[5, 6, 7],
                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _grpc_client_threads() -> set[threading.Thread]:
    """Threads gRPC's channel code runs (the channel spin thread among them)."""
    return {thread for thread in threading.enumerate()
            if "_run_with_context" in getattr(getattr(thread, "_target", None), "__qualname__", "")}


def test_a_submit_stream_is_read_on_the_iterating_thread(scheduler_server, fake):
    """(a Session's responses are read by its own thread, which hands each request its outputs)"""
    client = SchedulerClient(scheduler_server.address, frontend_id="test")
    fake.step_delay_s = 0.02
    outputs, before, started = [], _grpc_client_threads(), set()
    for output in client.submit(_request("r-read", 5), timeout=10.0):
        outputs.append(output)
        started |= _grpc_client_threads() - before  # while the call is open
    tokens = [token for output in outputs for delta in output.deltas for token in delta.token_ids]
    assert tokens == fake.tokens_by_index[0][:5]
    assert outputs[-1].is_finished
    assert started == set()  # gRPC ran no thread of its own to receive the stream
    client.close()


def test_a_cancel_from_another_thread_ends_the_stream(client, fake):
    fake.step_delay_s = 0.05
    fake.tokens_by_index = {0: list(range(40, 140))}
    stream = client.submit(_request("r-cancel", 100), timeout=10.0)
    received = []
    threading.Timer(0.3, stream.cancel).start()
    started = time.monotonic()
    with pytest.raises(SubmitCancelled):
        for output in stream:
            received.append(output)
    assert time.monotonic() - started < 3.0
    assert 0 < len(received) < 100
    assert fake.wait_closed("r-cancel", 5.0)
    assert "r-cancel" in fake.cancelled_ids


def test_a_deadline_ends_the_stream(client, fake):
    fake.step_delay_s = 0.05
    fake.tokens_by_index = {0: list(range(40, 140))}
    with pytest.raises(SchedulerTimeout):
        list(client.submit(_request("r-deadline", 100), timeout=0.4))


def test_requests_on_one_session_each_get_their_own_outputs_and_end(client, fake):
    fake.step_delay_s = 0.01
    fake.tokens_by_index = {0: list(range(40, 140))}
    streams = [client.submit(_request(f"r-many-{i}", 5 + i), timeout=10.0) for i in range(6)]
    cancelled = client.submit(_request("r-many-cancelled", 100), timeout=10.0)
    first = next(iter(cancelled))
    cancelled.cancel()
    for i, stream in enumerate(streams):
        outputs = list(stream)
        assert [token for output in outputs for delta in output.deltas for token in delta.token_ids] == \
            fake.tokens_by_index[0][:5 + i]
        assert outputs[-1].is_finished
    assert first.deltas and fake.wait_closed("r-many-cancelled", 5.0)
    assert "r-many-cancelled" in fake.cancelled_ids
    assert all(fake.wait_closed(f"r-many-{i}", 5.0) for i in range(6))
    assert {f"r-many-{i}" for i in range(6)} <= set(fake.completed_ids)


def test_a_second_request_with_a_running_ones_id_is_refused_and_its_end_leaves_that_one_alone(client, fake):
    fake.step_delay_s = 0.01
    fake.tokens_by_index = {0: list(range(40, 140))}
    first = client.submit(_request("r-twice", 30), timeout=10.0)
    outputs = iter(first)
    received = [next(outputs)]
    second = client.submit(_request("r-twice", 30), timeout=10.0)
    if fake.has_session:  # refused in the frontend: the scheduler's refusal would end the first
        with pytest.raises(SchedulerRejected):
            list(second)
    second.cancel()  # what a Generation does with a stream that failed before its end
    received += list(outputs)
    assert [token for output in received for delta in output.deltas for token in delta.token_ids] == \
        fake.tokens_by_index[0][:30]
    assert received[-1].is_finished
