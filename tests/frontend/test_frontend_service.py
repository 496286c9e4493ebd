"""The real frontend gRPC server against a scripted scheduler (a double of the scheduler process)."""

from __future__ import annotations

import io
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fake_scheduler import FakeSchedulerServer

from pagedserve.frontend.client import GenerateOptions, generate_cli
from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SCRIPT_0 = "The keeper climbed the stairs to light the lamp."
SCRIPT_1 = "Ships passed in the night and saw the beam."


def _script(fake, tokenizer, *texts: str) -> list[list[int]]:
    scripts = [tokenizer.encode(text)[1:] for text in texts]
    fake.tokens_by_index = dict(enumerate(scripts))
    return scripts


def _request(prompt="Hello", request_id="", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt=prompt, params=pb.SamplingParams(**params))


def _wait_for(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_stream_delivers_deltas_then_finish_and_usage(stub, fake, tokenizer):
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    fake.cached_prompt_tokens = 2
    messages = list(stub.GenerateStream(_request("Hello there", max_tokens=len(script), request_id="r-1"), timeout=10))
    assert len(messages) == len(script), "one message per scheduler step"
    assert all(m.request_id == "r-1" for m in messages)
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1] for c in m.completions)
    assert all(not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.completions[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(c.text for m in messages for c in m.completions) == SCRIPT_0
    assert [t for m in messages for c in m.completions for t in c.token_ids] == script
    prompt_ids = tokenizer.encode("Hello there")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (
        len(prompt_ids), len(script), 2)
    submitted = fake.submits[-1]
    assert list(submitted.prompt_token_ids) == prompt_ids and submitted.request_id == "r-1"
    assert submitted.sampling.max_tokens == len(script) and submitted.sampling.top_p == 1.0


def test_generate_returns_the_whole_result(stub, fake, tokenizer):
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    response = stub.Generate(_request(max_tokens=len(script)), timeout=10)
    assert len(response.request_id) >= 16
    (completion,) = response.completions
    assert completion.text == SCRIPT_0 and list(completion.token_ids) == script
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.usage.completion_tokens == len(script)
    assert not completion.logprobs


def test_generate_asks_the_scheduler_to_hold_its_output_and_a_stream_does_not(stub, fake, tokenizer):
    (script,) = _script(fake, tokenizer, "one two three")
    response = stub.Generate(_request(max_tokens=len(script)), timeout=10)
    assert list(response.completions[0].token_ids) == script and fake.submits[-1].hold_output
    list(stub.GenerateStream(_request(max_tokens=20), timeout=10))
    assert not fake.submits[-1].hold_output
    stub.Generate(_request(max_tokens=20, stop=["never said"]), timeout=10)
    assert not fake.submits[-1].hold_output  # the frontend must see each token to find it
    stub.Generate(_request(max_tokens=20, beam_width=2), timeout=10)
    assert not fake.submits[-1].hold_output  # beam search sends its completions once anyway


def test_stop_token_id_finishes_with_stop(stub, fake, tokenizer):
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    response = stub.Generate(_request(max_tokens=50, stop_token_ids=[script[3]]), timeout=10)
    assert list(response.completions[0].token_ids) == script[:4]
    assert response.completions[0].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_finishes_one_index_only(stub, fake, tokenizer, include):
    scripts = _script(fake, tokenizer, SCRIPT_0, SCRIPT_1)
    stop = "stairs"
    assert not any(tokenizer.decode([t]) == stop for t in scripts[0]), "the stop string must span tokens"
    max_tokens = len(scripts[1])
    messages = list(stub.GenerateStream(
        _request(max_tokens=max_tokens, n=2, stop=[stop], include_stop_str_in_output=include,
                 request_id=f"stop-{include}"), timeout=10))
    texts = {0: "", 1: ""}
    finishes = {}
    for message in messages:
        indices = [c.index for c in message.completions]
        assert len(indices) == len(set(indices)), "each message names an index at most once"
        for c in message.completions:
            texts[c.index] += c.text
            if c.finish_reason:
                assert c.index not in finishes, "a completion finishes once"
                finishes[c.index] = (c.finish_reason, c.stop_sequence)
    cut = SCRIPT_0.index(stop) + (len(stop) if include else 0)
    assert texts[0] == SCRIPT_0[:cut]
    assert finishes[0] == (pb.FINISH_REASON_STOP_SEQUENCE, stop)
    assert texts[1] == SCRIPT_1 and finishes[1] == (pb.FINISH_REASON_LENGTH, "")
    assert fake.finish_requests == [(f"stop-{include}", 0)]
    assert messages[-1].usage.completion_tokens < 2 * max_tokens


def test_stop_string_ending_the_last_completion_releases_the_request(stub, fake, tokenizer):
    _script(fake, tokenizer, SCRIPT_0)
    fake.step_delay_s = 0.01
    response = stub.Generate(_request(max_tokens=100, stop=["lamp"], request_id="last"), timeout=10)
    assert response.completions[0].text == SCRIPT_0[:SCRIPT_0.index("lamp")]
    assert response.completions[0].stop_sequence == "lamp"
    assert _wait_for(lambda: "last" in fake.cancelled_ids), "the internal stream was not closed"
    assert fake.finish_requests == [], "closing the stream is enough when nothing else runs"


def test_beam_search_completions_arrive_once_at_the_end(stub, fake, tokenizer):
    scripts = _script(fake, tokenizer, SCRIPT_0, SCRIPT_1, "A third beam.")
    messages = list(stub.GenerateStream(_request(max_tokens=8, beam_width=3), timeout=10))
    assert len(messages) == 1
    (message,) = messages
    assert [c.index for c in message.completions] == [0, 1, 2]
    assert [c.cumulative_logprob for c in message.completions] == [-1.0, -2.0, -3.0]
    for completion, script in zip(message.completions, scripts):
        assert list(completion.token_ids) == script[:8]
        assert completion.text == tokenizer.decode(script[:8])
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    assert message.usage.completion_tokens == sum(len(s[:8]) for s in scripts)


def test_logprobs_when_asked(stub, fake, tokenizer):
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    response = stub.Generate(_request(max_tokens=4, logprobs=2), timeout=10)
    logprobs = response.completions[0].logprobs
    assert [lp.token_id for lp in logprobs] == script[:4]
    assert all(lp.logprob == pytest.approx(-0.5) and len(lp.top) == 2 for lp in logprobs)
    assert response.completions[0].cumulative_logprob == pytest.approx(-2.0)


@pytest.mark.parametrize("params, field_name", [
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=200), "max_tokens"),
    (dict(stop_token_ids=[512]), "stop_token_ids"),
])
def test_invalid_parameters_are_invalid_argument(stub, fake, params, field_name):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(**params), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field_name}:")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(_request(**params), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.submits == []


def test_token_ids_outside_the_model_vocabulary(stub, fake):
    request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=[5, 512]))
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in info.value.details()


def test_invalid_utf8_is_invalid_argument_not_a_crash(channel, stub, fake):
    raw = b"\x12\x02\xff\xfe"  # GenerateRequest.prompt (field 2) holding bytes that are not UTF-8
    for method in ("Generate", "Tokenize"):
        call = channel.unary_unary(f"/pagedserve.v1.Generation/{method}",
                                   request_serializer=lambda data: data, response_deserializer=lambda data: data)
        with pytest.raises(grpc.RpcError) as info:
            call(raw if method == "Generate" else b"\x0a\x02\xff\xfe", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "UTF-8" in info.value.details()
    assert stub.Tokenize(pb.TokenizeRequest(text="still fine"), timeout=10).token_ids


def test_scheduler_statuses_map_to_public_codes(stub, fake):
    fake.reject_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.reject_code = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(_request(), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_not_ready_scheduler_means_unavailable_and_not_serving(channel, stub, fake, frontend):
    health = health_pb2_grpc.HealthStub(channel)
    check = lambda service: health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status  # noqa: E731
    assert _wait_for(lambda: check("pagedserve.v1.Generation") == SERVING)
    fake.is_ready = False
    assert _wait_for(lambda: check("pagedserve.v1.Generation") == NOT_SERVING)
    assert check("") == SERVING, "the process itself stays alive"
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not ready" in info.value.details()
    fake.is_ready = True
    assert _wait_for(lambda: check("pagedserve.v1.Generation") == SERVING)
    assert stub.Generate(_request(max_tokens=2), timeout=10).completions[0].token_ids


def test_cancelled_client_call_closes_the_internal_stream(stub, fake, tokenizer):
    _script(fake, tokenizer, SCRIPT_0)
    fake.step_delay_s = 0.05
    call = stub.GenerateStream(_request(max_tokens=100, request_id="gone"), timeout=10)
    first = next(call)
    assert first.completions[0].token_ids
    call.cancel()
    assert _wait_for(lambda: "gone" in fake.cancelled_ids), "the scheduler stream outlived the client call"
    assert "gone" not in fake.completed_ids


def test_cancelled_unary_call_closes_the_internal_stream_at_once(stub, fake, tokenizer):
    _script(fake, tokenizer, SCRIPT_0)
    fake.step_delay_s = 0.05
    future = stub.Generate.future(_request(max_tokens=100, request_id="unary-gone"))
    assert _wait_for(lambda: any(s.request_id == "unary-gone" for s in fake.submits))
    time.sleep(0.1)
    future.cancel()
    assert _wait_for(lambda: "unary-gone" in fake.cancelled_ids, timeout=2.0)
    assert "unary-gone" not in fake.completed_ids


def test_deadline_exceeded_aborts_the_request(stub, fake, tokenizer):
    _script(fake, tokenizer, SCRIPT_0)
    fake.step_delay_s = 0.05
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(max_tokens=100, request_id="late"), timeout=0.4)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_for(lambda: "late" in fake.cancelled_ids)


def test_unreachable_scheduler_is_unavailable_until_it_starts(tokenizer_folder, tokenizer):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.openai.config import HttpConfig
    from pagedserve.frontend.server import serve_frontend

    scheduler_port = free_port()
    config = FrontendConfig(model_path=str(tokenizer_folder), scheduler_address=f"127.0.0.1:{scheduler_port}", port=0,
                            http=HttpConfig(port=0))
    server = serve_frontend(config, health_poll_interval_s=0.1)
    late_scheduler = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as chan:
            stub = generation_pb2_grpc.GenerationStub(chan)
            for rpc in (lambda: stub.Generate(_request(), timeout=10),
                        lambda: list(stub.GenerateStream(_request(), timeout=10)),
                        lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)):
                with pytest.raises(grpc.RpcError) as info:
                    rpc()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(chan)
            check = lambda: health.Check(  # noqa: E731
                health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=5).status
            assert check() == NOT_SERVING
            late_scheduler = FakeSchedulerServer(port=scheduler_port)
            assert _wait_for(lambda: check() == SERVING, timeout=5.0), "the frontend never reconnected"
            assert stub.Generate(_request(max_tokens=2), timeout=10).usage.completion_tokens == 2
    finally:
        server.stop(grace_s=0.5)
        if late_scheduler is not None:
            late_scheduler.stop()


def test_reflection_lists_the_services(channel, frontend):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=5)
    names = {service.name for response in responses for service in response.list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("package", ["grpc.reflection.v1alpha", "grpc.reflection.v1"])
def test_reflection_answers_under_v1_and_v1alpha(channel, frontend, package):
    """grpcurl and Postman ask v1 first; the messages are the same on the wire."""
    call = channel.stream_stream(f"/{package}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagedserve.v1.Generation")]
    listed, described = list(call(iter(requests), timeout=5))
    assert "pagedserve.v1.Generation" in {service.name for service in listed.list_services_response.service}
    assert described.file_descriptor_response.file_descriptor_proto


def test_tokenize_and_model_info(stub, fake, tokenizer):
    assert list(stub.Tokenize(pb.TokenizeRequest(text="the lamp"), timeout=5).token_ids) == tokenizer.encode("the lamp")
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert (info.model_name, info.max_model_len, info.vocab_size, list(info.eos_token_ids)) == (
        "fake-model", 128, 512, [2])
    assert (info.block_size, info.num_kv_blocks, info.tensor_parallel_size) == (16, 100, 1)


def test_metrics_use_the_pinned_names(stub, fake, tokenizer, frontend):
    """A stream's gaps are inter-token latencies; a unary Generate's outputs may be merged in the
    scheduler (hold_output), so it gives a time to first token and no gaps."""
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    url = f"http://127.0.0.1:{frontend.metrics_port}/metrics"

    def values() -> dict[str, float]:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                if line and not line.startswith("#")}

    ttft, itl = ('pagedserve_time_to_first_token_seconds_count{protocol="grpc"}',
                 'pagedserve_inter_token_latency_seconds_count{protocol="grpc"}')
    stub.Generate(_request(max_tokens=5), timeout=10)
    after_unary = values()
    for name in ("pagedserve_time_to_first_token_seconds_count", "pagedserve_inter_token_latency_seconds_count",
                 "pagedserve_request_latency_seconds_count", "pagedserve_prompt_tokens_total",
                 "pagedserve_generation_tokens_total"):
        assert any(key.startswith(name) for key in after_unary), name
    assert after_unary['pagedserve_requests_total{finish_reason="length",protocol="grpc"}'] >= 1
    assert after_unary['pagedserve_generation_tokens_total{protocol="grpc"}'] >= 5
    list(stub.GenerateStream(_request(max_tokens=5), timeout=10))
    stub.Generate(_request(max_tokens=5), timeout=10)
    after = values()
    assert after[ttft] - after_unary[ttft] == 2
    assert after[itl] - after_unary.get(itl, 0) == 4  # the stream's four gaps, none of the unary call


def test_generate_cli_streams_text(frontend, fake, tokenizer):
    (script,) = _script(fake, tokenizer, SCRIPT_0)
    fake.step_delay_s = 0.01
    out, err = _RecordingStream(), io.StringIO()
    options = GenerateOptions(prompt="Hello", address=f"127.0.0.1:{frontend.port}", max_tokens=len(script))
    code = generate_cli(options, timeout=10, out=out, err=err)
    assert code == 0
    assert "".join(out.writes) == SCRIPT_0 + "\n"
    assert len(out.writes) > 5, "the text was not streamed piece by piece"
    assert "finish_reason=length" in err.getvalue()
    err = io.StringIO()
    too_long = GenerateOptions(prompt="Hello", address=f"127.0.0.1:{frontend.port}", max_tokens=1000)
    bad = generate_cli(too_long, timeout=10, out=io.StringIO(), err=err)
    assert bad == 2 and "INVALID_ARGUMENT" in err.getvalue()


class _RecordingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)
