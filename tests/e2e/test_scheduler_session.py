"""The internal Session stream (scheduler/session.py, frontend/upstream/scheduler_session.py): a
frontend's requests share one stream to the scheduler, and each keeps the contract its own Submit
stream had: its outputs, its refusals and status codes, its cancel and its deadline, every block
back (real `serve`)."""

from __future__ import annotations

import queue
import threading

import grpc

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.scheduler_codec import sampling_to_proto
from pagedserve.internal import scheduler_pb2
from tests.e2e.harness import assert_pool_whole, token_request, wait_for

PROMPTS = [[11 + i, 12, 13 + 2 * i, 14, 15, 16 + i] for i in range(4)]


def _scheduler_events(server, name: str) -> list[dict]:
    return [event for event in server.log_events()
            if event.get("process") == "scheduler" and event.get("event") == name]


def _stream(server, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    request = token_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    request.request_id = request_id
    tokens = []
    for message in server.stub.GenerateStream(request, timeout=120):
        for completion in message.completions:
            tokens.extend(completion.token_ids)
    return tokens


def test_a_frontends_requests_share_one_session_and_a_cancel_ends_only_its_own(service_server):
    server = service_server
    sessions_before = len(_scheduler_events(server, "session_opened"))
    results: dict[str, list[int]] = {}
    errors: list[Exception] = []

    def run(index: int) -> None:
        try:
            results[f"shared-{index}"] = _stream(server, PROMPTS[index], f"shared-{index}", 12)
        except Exception as exc:  # reported by the test thread
            errors.append(exc)

    cancelled = token_request(PROMPTS[0], max_tokens=900, ignore_eos=True)
    cancelled.request_id = "shared-cancelled"
    call = server.stub.GenerateStream(cancelled, timeout=120)
    assert next(call).completions[0].token_ids
    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    call.cancel()  # while the others run on the same session
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert wait_for(lambda: any(event.get("request_id") == "shared-cancelled"
                                for event in _scheduler_events(server, "request_aborted")), timeout=10)
    # one request at a time gives each the same tokens
    for index, prompt in enumerate(PROMPTS):
        assert results[f"shared-{index}"] == _stream(server, prompt, f"alone-{index}", 12)
    submitted = {event["request_id"]: event for event in _scheduler_events(server, "request_submitted")}
    ours = [f"shared-{index}" for index in range(len(PROMPTS))] + ["shared-cancelled"]
    assert all(submitted[request_id]["via"] == "session" for request_id in ours), submitted
    assert len(_scheduler_events(server, "session_opened")) - sessions_before <= 1  # the frontend's one
    assert_pool_whole(server)


def _submit(request_id: str, prompt: list[int], timeout: float = 0.0, **params) -> scheduler_pb2.SessionRequest:
    sampling = sampling_to_proto(SamplingParams(**params))
    request = scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    return scheduler_pb2.SessionRequest(submit=scheduler_pb2.SessionSubmit(request=request, timeout=timeout))


def test_a_raw_session_refuses_times_out_and_ends_each_request_on_its_own(service_server):
    """A client of the internal port itself: a duplicate id and a token outside the vocabulary are
    refused with INVALID_ARGUMENT, a request past its timeout ends with DEADLINE_EXCEEDED and is
    aborted, and the one valid request still gets every token; a half-close ends the stream once
    nothing is open."""
    server = service_server
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    call = server.scheduler.Session(requests(), timeout=120)
    outputs: dict[str, list[scheduler_pb2.SessionOutput]] = {}
    with server.workers_paused():  # nothing can finish or time out by producing its tokens first
        outbox.put(_submit("raw-valid", [5, 6, 7], max_tokens=6, ignore_eos=True))
        outbox.put(_submit("raw-valid", [5, 6, 7], max_tokens=6, ignore_eos=True))
        outbox.put(_submit("raw-outside", [5, 10 ** 6], max_tokens=6))
        outbox.put(_submit("raw-late", [8, 9, 10], timeout=0.5, max_tokens=6, ignore_eos=True))
        while len(outputs) < 3 or len(outputs.get("raw-valid", [])) < 1:
            for output in next(call).outputs:
                outputs.setdefault(output.request_id, []).append(output)
    assert outputs["raw-valid"][0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already running" in outputs["raw-valid"][0].status_message
    assert outputs["raw-outside"][0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "outside the vocabulary" in outputs["raw-outside"][0].status_message
    assert [output.status_code for output in outputs["raw-late"]] == [grpc.StatusCode.DEADLINE_EXCEEDED.value[0]]
    outbox.put(None)  # half-close: the stream ends once raw-valid has finished
    for response in call:
        for output in response.outputs:
            outputs[output.request_id].append(output)
    valid = outputs["raw-valid"][1:]
    assert all(output.status_code == 0 for output in valid) and valid[-1].response.is_finished
    assert sum(len(delta.token_ids) for output in valid for delta in output.response.deltas) == 6
    aborted = [event for event in _scheduler_events(server, "request_aborted") if event.get("request_id") == "raw-late"]
    assert [event["reason"] for event in aborted] == ["deadline_exceeded"]
    assert_pool_whole(server)
