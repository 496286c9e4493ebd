"""Requests that once took the replica down (beam scoring overflow, more beam candidates than the
vocabulary) are refused, and five innocent streams running meanwhile are untouched."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2

from tests.e2e.conftest import VOCAB_SIZE
from tests.e2e.harness import assert_pool_whole, stream_tokens, token_request, wait_for

PROMPTS = [[11 + i, 40, 41, 42 + 3 * i] * (2 + i) for i in range(5)]
MAX_TOKENS = 120
POISON = [  # (what it is, the request, the field the refusal names)
    ("overflowing beam score", token_request([5, 6, 7], max_tokens=8, beam_width=2, length_penalty=1e30),
     "length_penalty"),
    ("700 stop ids", token_request([5, 6, 7], max_tokens=8, beam_width=2, stop_token_ids=list(range(3, 703))),
     "stop_token_ids"),
    ("more beam candidates than the vocabulary", token_request(
        [5, 6, 7], max_tokens=8, beam_width=16, stop_token_ids=list(range(4, 44))), "stop_token_ids"),
]


def test_poison_requests_are_refused_and_innocent_streams_finish_unchanged(service_server):
    server = service_server
    undisturbed = [list(server.stub.Generate(token_request(p, max_tokens=MAX_TOKENS, ignore_eos=True),
                                             timeout=120).completions[0].token_ids) for p in PROMPTS]
    received: list[list[int]] = [[] for _ in PROMPTS]
    errors: list[Exception] = []
    threads = [threading.Thread(target=stream_tokens, args=(server, p, r, errors), kwargs={"max_tokens": MAX_TOKENS})
               for p, r in zip(PROMPTS, received)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: all(len(r) >= 3 for r in received), timeout=60)
    assert 41 * 16 > VOCAB_SIZE  # candidates a step of the last poison request
    for name, request, field_name in POISON:
        for call in (server.stub.Generate, lambda r, timeout: list(server.stub.GenerateStream(r, timeout=timeout))):
            try:
                call(request, timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, exc)
                assert exc.details().startswith(field_name), (name, exc.details())
            else:
                raise AssertionError(f"{name}: the poison request was served")
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert received == undisturbed
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert_pool_whole(server)
