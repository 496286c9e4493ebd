"""Stop conditions in both Generate and GenerateStream: EOS, ignore_eos, stop token ids, stop
strings (across token boundaries), max_tokens, min_tokens."""

from __future__ import annotations

import json
import time
import shutil

import pytest

from pagedserve.v1 import generation_pb2
from tests.e2e.conftest import start_server
from tests.e2e.harness import text_request, token_request, wait_for

LENGTH = generation_pb2.FINISH_REASON_LENGTH
STOP = generation_pb2.FINISH_REASON_STOP
STOP_SEQUENCE = generation_pb2.FINISH_REASON_STOP_SEQUENCE
PROBE_PROMPT = [11, 42, 97, 130, 7, 300, 21]


def _run(server, request, streaming: bool) -> generation_pb2.Completion:
    """The single completion of a request, assembled from the stream when streaming."""
    if not streaming:
        response = server.stub.Generate(request, timeout=60)
        assert len(response.completions) == 1
        return response.completions[0]
    completion = generation_pb2.Completion()
    messages = list(server.stub.GenerateStream(request, timeout=60))
    assert messages, "the stream carried no message"
    for message in messages[:-1]:
        for delta in message.completions:
            assert delta.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED
    for message in messages:
        for delta in message.completions:
            completion.text += delta.text
            completion.token_ids.extend(delta.token_ids)
            if delta.finish_reason:
                completion.finish_reason = delta.finish_reason
                completion.stop_sequence = delta.stop_sequence
    assert messages[-1].completions[-1].finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
    assert messages[-1].usage.completion_tokens == len(completion.token_ids)
    return completion


@pytest.fixture(scope="module")
def eos_checkpoint(llama_checkpoint, hf_reference, tmp_path_factory):
    """The Llama checkpoint with its EOS set to the 6th token greedy decoding of the probe prompt
    produces, so that EOS is actually reached; returns (folder, eos id, greedy ids without EOS)."""
    greedy = hf_reference(llama_checkpoint, PROBE_PROMPT, 20)
    position = next(i for i in range(5, len(greedy)) if greedy[i] not in greedy[:i])
    eos_id = greedy[position]
    folder = tmp_path_factory.mktemp("llama-eos")
    shutil.copytree(llama_checkpoint, folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos_id
        path.write_text(json.dumps(config))
    return folder, eos_id, greedy


@pytest.fixture(scope="module")
def eos_server(eos_checkpoint, tmp_path_factory):
    server = start_server(eos_checkpoint[0], tmp_path_factory, "llama-eos", "--num-kv-blocks", "64")
    yield server
    assert server.stop() == 0, server.logs()[-3000:]


@pytest.mark.parametrize("streaming", [False, True])
def test_eos_stops_and_ignore_eos_continues(eos_server, eos_checkpoint, streaming):
    _, eos_id, greedy = eos_checkpoint
    position = greedy.index(eos_id)
    stopped = _run(eos_server, token_request(PROBE_PROMPT, max_tokens=20), streaming)
    assert list(stopped.token_ids) == greedy[:position + 1]
    assert stopped.finish_reason == STOP
    ignored = _run(eos_server, token_request(PROBE_PROMPT, max_tokens=12, ignore_eos=True), streaming)
    assert len(ignored.token_ids) == 12
    assert list(ignored.token_ids)[:position + 1] == greedy[:position + 1]
    assert ignored.finish_reason == LENGTH


@pytest.mark.parametrize("streaming", [False, True])
def test_max_tokens_and_stop_token_ids(llama_server, streaming):
    full = _run(llama_server, token_request(PROBE_PROMPT, max_tokens=16, ignore_eos=True), streaming)
    assert len(full.token_ids) == 16 and full.finish_reason == LENGTH
    ids = list(full.token_ids)
    position = next(i for i in range(3, 16) if ids[i] not in ids[:i])
    stopped = _run(llama_server, token_request(PROBE_PROMPT, max_tokens=16, ignore_eos=True,
                                               stop_token_ids=[ids[position]]), streaming)
    assert list(stopped.token_ids) == ids[:position + 1]
    assert stopped.finish_reason == STOP


@pytest.mark.parametrize("streaming", [False, True])
def test_min_tokens_suppresses_early_stop(llama_server, streaming):
    full = _run(llama_server, token_request(PROBE_PROMPT, max_tokens=16, ignore_eos=True), streaming)
    stop_id = full.token_ids[0]
    early = _run(llama_server, token_request(PROBE_PROMPT, max_tokens=16, ignore_eos=True,
                                             stop_token_ids=[stop_id]), streaming)
    assert list(early.token_ids) == [stop_id] and early.finish_reason == STOP
    held = _run(llama_server, token_request(PROBE_PROMPT, max_tokens=16, ignore_eos=True,
                                            stop_token_ids=[stop_id], min_tokens=6), streaming)
    assert len(held.token_ids) >= 6
    assert stop_id not in list(held.token_ids)[:6]
    if held.finish_reason == STOP:
        assert held.token_ids[-1] == stop_id
    else:
        assert held.finish_reason == LENGTH and len(held.token_ids) == 16


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(llama_server, streaming, include):
    prompt = "The lighthouse keeper climbed the stairs"
    full = _run(llama_server, text_request(prompt, max_tokens=40, ignore_eos=True), streaming)
    text = full.text
    assert len(text) > 12, text
    stop = text[6:10]
    cut = text.index(stop)
    stopped = _run(llama_server, text_request(prompt, max_tokens=40, ignore_eos=True, stop=[stop],
                                              include_stop_str_in_output=include), streaming)
    assert stopped.text == (text[:cut + len(stop)] if include else text[:cut])
    assert stopped.finish_reason == STOP_SEQUENCE
    assert stopped.stop_sequence == stop


def _with_id(request: generation_pb2.GenerateRequest, request_id: str) -> generation_pb2.GenerateRequest:
    request.request_id = request_id
    return request


def _scheduler_messages(server, request_id: str) -> int:
    """The scheduler's request_finished event for request_id: its log line may reach the file a
    moment after the answer reached the client, so it is waited for."""
    events = []

    def logged() -> bool:
        events[:] = [event for event in server.log_events() if event.get("event") == "request_finished"
                     and event.get("process") == "scheduler" and event.get("request_id") == request_id]
        return bool(events)

    assert wait_for(logged, timeout=10), f"no request_finished event of {request_id} in the scheduler's log"
    (event,) = events
    return event["num_messages"]


def test_a_whole_result_comes_in_two_scheduler_messages_and_equals_the_stream(llama_server):
    """Generate (unary) without stop strings: the scheduler sends the first output, then the rest
    merged (hold_output); tokens, logprobs and finish reasons equal those GenerateStream gathers
    from one message per step. With a stop string the frontend needs every step, so none is held."""
    params = dict(max_tokens=24, ignore_eos=True, n=2, temperature=0.9, seed=7, logprobs=2)
    whole = llama_server.stub.Generate(_with_id(token_request(PROBE_PROMPT, **params), "whole-held"), timeout=60)
    stream = list(llama_server.stub.GenerateStream(_with_id(token_request(PROBE_PROMPT, **params), "whole-streamed"),
                                                   timeout=60))
    for index in (0, 1):
        streamed = [delta for message in stream for delta in message.completions if delta.index == index]
        (held,) = [completion for completion in whole.completions if completion.index == index]
        assert list(held.token_ids) == [t for delta in streamed for t in delta.token_ids]
        assert len(held.token_ids) == 24 and held.finish_reason == LENGTH == streamed[-1].finish_reason
        assert [(lp.token_id, round(lp.logprob, 4)) for lp in held.logprobs] == \
            [(lp.token_id, round(lp.logprob, 4)) for delta in streamed for lp in delta.logprobs]
        assert held.cumulative_logprob == pytest.approx(streamed[-1].cumulative_logprob, abs=1e-4)
    assert whole.usage.completion_tokens == stream[-1].usage.completion_tokens == 48
    assert _scheduler_messages(llama_server, "whole-held") == 2
    assert _scheduler_messages(llama_server, "whole-streamed") >= 24
    with_stop = llama_server.stub.Generate(_with_id(token_request(PROBE_PROMPT, max_tokens=12, ignore_eos=True,
                                                                  stop=["never said"]), "whole-stop"), timeout=60)
    assert len(with_stop.completions[0].token_ids) == 12
    assert _scheduler_messages(llama_server, "whole-stop") >= 12


def _num_steps(server) -> float:
    """Steps the scheduler has reported (pagedserve_step_seconds_count), once it stopped changing."""
    from prometheus_client.parser import text_string_to_metric_families

    def count() -> float:
        return next(sample.value for family in text_string_to_metric_families(server.metrics("scheduler"))
                    for sample in family.samples if sample.name == "pagedserve_step_seconds_count")

    last = count()
    for _ in range(50):
        time.sleep(0.1)
        now = count()
        if now == last:
            return now
        last = now
    raise AssertionError("the scheduler's step count does not settle")


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, top_p=0.9, seed=11, logprobs=2)])
def test_a_whole_answer_is_computed_in_decode_runs_with_the_streams_tokens(llama_server, params):
    """A lone request decodes in runs of several steps per plan (StepPlan.num_steps), greedy or
    seeded: unary (hold_output), the run answered at once; streamed, each step's tokens sent as
    they come (StepPlan.streams_steps); the same tokens and logprobs either way."""
    params = dict(max_tokens=40, ignore_eos=True, **params)
    before = _num_steps(llama_server)
    whole = llama_server.stub.Generate(_with_id(token_request(PROBE_PROMPT, **params), f"runs-{len(params)}"),
                                       timeout=60)
    after_whole = _num_steps(llama_server)
    stream = list(llama_server.stub.GenerateStream(token_request(PROBE_PROMPT, **params), timeout=60))
    after_stream = _num_steps(llama_server)
    (held,) = whole.completions
    streamed = [delta for message in stream for delta in message.completions]
    assert list(held.token_ids) == [t for delta in streamed for t in delta.token_ids] and len(held.token_ids) == 40
    assert [(lp.token_id, round(lp.logprob, 4)) for lp in held.logprobs] == \
        [(lp.token_id, round(lp.logprob, 4)) for delta in streamed for lp in delta.logprobs]
    assert after_whole - before <= 15  # the prefill, then runs of up to 16 to each block's end
    assert after_stream - after_whole <= 15
    assert len(stream) > after_stream - after_whole  # more messages than plans: a run's steps one by one
