"""The validation table through the real processes: every bad field of GenerateRequest is
INVALID_ARGUMENT naming the field, before the scheduler sees the request; random requests never
crash a process and never leak a block."""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.v1 import generation_pb2 as pb
from tests.e2e.harness import assert_pool_whole, text_request, token_request

VOCAB_SIZE = 512  # the test checkpoint's (conftest.py)
MAX_MODEL_LEN = 1024
PROMPT = [5, 6, 7, 8]
BAD_UTF8 = b"\xc3\x28"  # a two-byte sequence that is not UTF-8
PLACEHOLDER = "Q~"  # two bytes, replaced by BAD_UTF8 in the serialized request


def _params(**params):
    return token_request(PROMPT, **params)


def _raw(request: pb.GenerateRequest) -> bytes:
    data = request.SerializeToString()
    assert data.count(PLACEHOLDER.encode()) == 1
    return data.replace(PLACEHOLDER.encode(), BAD_UTF8)


# (row id, request or serialized bytes, field the error must name)
TABLE = [
    ("temperature-negative", _params(temperature=-0.5), "temperature"),
    ("temperature-nan", _params(temperature=math.nan), "temperature"),
    ("top_p-above-one", _params(top_p=1.5), "top_p"),
    ("top_p-negative", _params(top_p=-0.1), "top_p"),
    ("top_k-negative", _params(top_k=-1), "top_k"),
    ("min_p-above-one", _params(min_p=1.5), "min_p"),
    ("min_tokens-above-max_tokens", _params(min_tokens=10, max_tokens=5), "min_tokens"),
    ("max_tokens-huge", _params(max_tokens=2**32 - 1), "max_tokens"),
    ("max_tokens-past-max_model_len", _params(max_tokens=MAX_MODEL_LEN - len(PROMPT) + 1), "max_tokens"),
    ("seed-too-large", _params(seed=2**63), "seed"),
    ("repetition_penalty-negative", _params(repetition_penalty=-1.0), "repetition_penalty"),
    ("presence_penalty-out-of-range", _params(presence_penalty=3.0), "presence_penalty"),
    ("frequency_penalty-out-of-range", _params(frequency_penalty=-3.0), "frequency_penalty"),
    ("stop-too-many", _params(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("stop-empty-string", _params(stop=[""]), "stop"),
    ("stop-too-long", _params(stop=["x" * 257]), "stop"),
    ("stop_token_ids-outside-vocabulary", _params(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    ("n-too-large", _params(n=65), "n"),
    ("n-with-beam-search", _params(n=2, beam_width=4), "n"),
    ("beam_width-too-large", _params(beam_width=33), "beam_width"),
    ("beam_width-with-sampling", _params(beam_width=4, temperature=0.8), "beam_width"),
    ("beam_width-with-top_p", _params(beam_width=4, top_p=0.5), "beam_width"),
    ("length_penalty-nan", _params(length_penalty=math.nan), "length_penalty"),
    ("logprobs-too-many", _params(logprobs=21), "logprobs"),
    ("request_id-too-long", pb.GenerateRequest(request_id="r" * 257, prompt="Hi"), "request_id"),
    ("prompt-missing", pb.GenerateRequest(), "prompt"),
    ("prompt-empty", text_request(""), "prompt"),
    ("prompt_token_ids-empty", token_request([]), "prompt_token_ids"),
    ("prompt-too-long", text_request("word " * 2000), "prompt"),
    ("prompt_token_ids-too-long", token_request([5] * MAX_MODEL_LEN), "prompt_token_ids"),
    ("prompt_token_ids-outside-vocabulary", token_request([5, VOCAB_SIZE]), "prompt_token_ids"),
    ("prompt_token_ids-max-uint32", token_request([2**32 - 1]), "prompt_token_ids"),
    ("prompt-invalid-utf8", _raw(text_request(PLACEHOLDER)), "prompt"),
    ("stop-invalid-utf8", _raw(text_request("Hi", stop=["ok", PLACEHOLDER])), "params.stop[1]"),
    ("request_id-invalid-utf8", _raw(pb.GenerateRequest(request_id=PLACEHOLDER, prompt="Hi")), "request_id"),
]
ROW_IDS = [row[0] for row in TABLE]
# fields an INVALID_ARGUMENT may name (the scheduler names no field when a request could never fit
# the KV pool: "request '…' rejected: needs up to N KV blocks")
KNOWN_FIELDS = {field.name for field in pb.SamplingParams.DESCRIPTOR.fields} | {
    "request_id", "prompt", "prompt_token_ids"}


def _tag(request, row_id: str):
    """The row's request with a request id the scheduler's log can be searched for."""
    if isinstance(request, bytes) or request.request_id:
        return request
    tagged = pb.GenerateRequest()
    tagged.CopyFrom(request)
    tagged.request_id = f"invalid-{row_id}"
    return tagged


def _call(server, method: str, request, timeout: float = 60):
    """Generate (unary) or GenerateStream (drained), with a message or raw bytes."""
    serializer = (lambda data: data) if isinstance(request, bytes) else pb.GenerateRequest.SerializeToString
    path = f"/pagedserve.v1.Generation/{method}"
    if method == "Generate":
        return [server.channel.unary_unary(path, request_serializer=serializer,
                                           response_deserializer=pb.GenerateResponse.FromString)(
            request, timeout=timeout)]
    return list(server.channel.unary_stream(path, request_serializer=serializer,
                                            response_deserializer=pb.GenerateResponse.FromString)(
        request, timeout=timeout))


@pytest.mark.parametrize("row_id, request_msg, field_name", TABLE, ids=ROW_IDS)
def test_bad_field_is_invalid_argument_naming_it(service_server, row_id, request_msg, field_name):
    request_msg = _tag(request_msg, row_id)
    for method in ("Generate", "GenerateStream"):
        with pytest.raises(grpc.RpcError) as info:
            _call(service_server, method, request_msg)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
        assert info.value.details().startswith(f"{field_name}:"), (method, info.value.details())


def test_the_table_never_reached_the_scheduler(service_server):
    """Every row was refused by the frontend: the scheduler logged none of their request ids."""
    tagged = {f"invalid-{row_id}" for row_id in ROW_IDS}
    seen = {event.get("request_id") for event in service_server.log_events() if event.get("process") == "scheduler"}
    assert not tagged & seen
    assert_pool_whole(service_server)


def test_n_zero_with_beam_search_is_the_pinned_default(service_server):
    """proto3 cannot tell an explicit n = 0 from an unset one: the contract pins 0 -> 1, which is
    what beam search requires, so the request is served with beam_width completions."""
    response = service_server.stub.Generate(_params(n=0, beam_width=3, max_tokens=4), timeout=60)
    assert len(response.completions) == 3


_wild_floats = st.one_of(st.floats(-3.0, 3.0, width=32),
                         st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf, -1e30]))
_WILD = {  # anything the wire allows
    "max_tokens": st.one_of(st.integers(0, 6), st.sampled_from([MAX_MODEL_LEN, 2**32 - 1])),
    "min_tokens": st.integers(0, 2**32 - 1),
    "temperature": _wild_floats, "top_p": _wild_floats, "min_p": _wild_floats,
    "repetition_penalty": _wild_floats, "presence_penalty": _wild_floats,
    "frequency_penalty": _wild_floats, "length_penalty": _wild_floats,
    "top_k": st.integers(-2**31, 2**31 - 1),
    "stop": st.lists(st.text(max_size=300), max_size=18),
    "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=3),
    "n": st.integers(0, 2**32 - 1), "beam_width": st.integers(0, 2**32 - 1),
    "logprobs": st.integers(0, 2**32 - 1), "seed": st.integers(0, 2**64 - 1),
    "prompt": st.text(max_size=40),
    "prompt_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40),
}
_VALID = {  # in range, and cheap to serve (at most 6 tokens per completion)
    "max_tokens": st.integers(0, 6), "min_tokens": st.integers(0, 1),
    "temperature": st.one_of(st.just(0.0), st.floats(0.125, 2.0, width=32)),
    "top_p": st.one_of(st.just(0.0), st.floats(0.0625, 1.0, width=32)),
    "min_p": st.one_of(st.just(0.0), st.floats(0.0, 0.5, width=32)),
    "repetition_penalty": st.one_of(st.just(0.0), st.floats(0.5, 2.0, width=32)),
    "presence_penalty": st.floats(-2.0, 2.0, width=32), "frequency_penalty": st.floats(-2.0, 2.0, width=32),
    "length_penalty": st.floats(-1.0, 2.0, width=32), "top_k": st.integers(0, VOCAB_SIZE + 10),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "n": st.integers(0, 4), "beam_width": st.sampled_from([0, 1, 2, 3]), "logprobs": st.integers(0, 5),
    "seed": st.integers(0, 2**63 - 1), "prompt": st.text(min_size=1, max_size=40),
    "prompt_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40),
}
_BEAM_EXCLUDES = {"temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0, "n": 0}


@st.composite
def _requests(draw):
    """Random GenerateRequests: every field in range except up to two drawn from anything the
    wire allows, so both served and refused requests come up."""
    wild = draw(st.sets(st.sampled_from(sorted(_WILD)), max_size=2))
    value = {name: draw(_WILD[name] if name in wild else _VALID[name]) for name in _VALID}
    if value["beam_width"] > 1:  # beam search excludes sampling, unless that is the wild part
        value.update({name: zero for name, zero in _BEAM_EXCLUDES.items() if name not in wild})
    params = pb.SamplingParams(
        **{name: value[name] for name in _VALID if name not in ("seed", "length_penalty", "prompt",
                                                                "prompt_token_ids")},
        ignore_eos=draw(st.booleans()), include_stop_str_in_output=draw(st.booleans()))
    if draw(st.booleans()):
        params.seed = value["seed"]
    if draw(st.booleans()):
        params.length_penalty = value["length_penalty"]
    if draw(st.booleans()):
        request = pb.GenerateRequest(prompt=value["prompt"], params=params)
    else:
        request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=value["prompt_token_ids"]),
                                     params=params)
    return request


def _check_served(request, messages: list[pb.GenerateResponse], method: str) -> None:
    if isinstance(request, bytes):
        return  # random bytes that happened to parse: served is fine
    params = request.params
    num_completions = params.beam_width if params.beam_width > 1 else (params.n or 1)
    max_tokens = params.max_tokens or 16
    last = messages[-1]
    assert last.HasField("usage")
    if method == "Generate":
        assert sorted(c.index for c in last.completions) == list(range(num_completions))
    tokens: dict[int, int] = {}
    for message in messages:
        for completion in message.completions:
            tokens[completion.index] = tokens.get(completion.index, 0) + len(completion.token_ids)
    assert set(tokens) <= set(range(num_completions))
    assert all(count <= max_tokens for count in tokens.values())


def test_random_requests_never_crash_a_process_or_leak_a_block(service_server):
    pids_before = service_server.child_pids()
    outcomes: list[str] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None, derandomize=True)
    @given(request=st.one_of(_requests(), _requests(), _requests(), st.binary(max_size=48)),
           method=st.sampled_from(["Generate", "GenerateStream"]))
    def send(request, method):
        try:
            messages = _call(service_server, method, request)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details(), request)
            details = exc.details()
            named = details.split(":")[0].split(".")[-1].split("[")[0]
            assert named in KNOWN_FIELDS or "KV blocks" in details or "undecodable" in details, details
            outcomes.append(named)
            return
        _check_served(request, messages, method)
        outcomes.append("served")

    send()
    assert outcomes.count("served") >= 10 and len(set(outcomes)) >= 5, outcomes
    assert service_server.proc.poll() is None
    assert service_server.child_pids() == pids_before, "a process died or was restarted"
    assert service_server.health() == health_pb2.HealthCheckResponse.SERVING
    assert_pool_whole(service_server)
