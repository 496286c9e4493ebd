"""The public port of a real `serve` with --api-key: gRPC and HTTP both require the key (health
and reflection stay open); request ids with control characters are refused before anything runs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from tests.e2e.conftest import OPENAI_API_KEY
from tests.e2e.harness import text_request, token_request


@pytest.fixture
def bare_channel(openai_server):
    """A channel that sends no key."""
    with grpc.insecure_channel(openai_server.address) as channel:
        yield channel


def _calls(stub, metadata):
    request = token_request([5, 6, 7], max_tokens=2)
    return {
        "Generate": lambda: stub.Generate(request, timeout=30, metadata=metadata),
        "GenerateStream": lambda: list(stub.GenerateStream(request, timeout=30, metadata=metadata)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=30, metadata=metadata),
        "ModelInfo": lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=metadata),
    }


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream", "Tokenize", "ModelInfo"])
@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong-key"),),
                                      (("authorization", OPENAI_API_KEY),)], ids=["none", "wrong", "no-scheme"])
def test_grpc_call_without_the_key_is_unauthenticated(bare_channel, rpc, metadata):
    stub = generation_pb2_grpc.GenerationStub(bare_channel)
    with pytest.raises(grpc.RpcError) as info:
        _calls(stub, metadata)[rpc]()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_call_with_the_key_is_served_and_health_and_reflection_are_open(bare_channel):
    stub = generation_pb2_grpc.GenerationStub(bare_channel)
    metadata = (("authorization", f"Bearer {OPENAI_API_KEY}"),)
    for call in _calls(stub, metadata).values():
        call()
    health = health_pb2_grpc.HealthStub(bare_channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(bare_channel)
    answers = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=5))
    names = {service.name for service in answers[0].list_services_response.service}
    assert "pagedserve.v1.Generation" in names


def test_http_requires_the_same_key(openai_server):
    body = json.dumps({"model": "tiny-chat", "prompt": "hello", "max_tokens": 2}).encode()
    for key, expected in ((None, 401), ("wrong", 401), (OPENAI_API_KEY, 200)):
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(openai_server.http_url + "/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == expected, key


# (the x-request-id metadata cannot carry them: gRPC allows only printable ASCII in header values,
# and the same check, request_id_or_new, runs on an id taken from metadata)
@pytest.mark.parametrize("request_id", ["abc\ndef", "abc\x1b[31mred", "tab\there", "nul\x00", "caf\u00e9"])
def test_request_id_with_control_characters_is_invalid(openai_server, request_id):
    request = text_request("hello", max_tokens=2)
    request.request_id = request_id
    with pytest.raises(grpc.RpcError) as info:
        openai_server.stub.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in info.value.details()

