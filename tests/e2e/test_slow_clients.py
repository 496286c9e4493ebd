"""Slow readers against a real `serve`: 32 streams on one connection whose client never reads
(with --max-concurrent-rpcs 32) take every Generation slot, yet liveness and readiness keep
answering; after --stream-write-timeout the streams are cut, their requests aborted and their
blocks freed, and the server takes requests again."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2_grpc
from tests.e2e.conftest import start_server
from tests.e2e.harness import PAUSE_ARGS, assert_pool_whole, token_request, wait_for

MAX_CONCURRENT_RPCS = 32
WRITE_TIMEOUT_S = 3.0
# Large messages (20 alternatives per token) and no BDP probing, so the client's 64 KiB HTTP/2
# window fills long before the 1000 tokens are sent: the server's writes stall.
SLOW_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def slow_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "slow", "--num-kv-blocks", "2200",
                          "--max-num-seqs", "64", "--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS),
                          "--stream-write-timeout", str(WRITE_TIMEOUT_S), *PAUSE_ARGS)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_unread_streams_leave_health_answering_and_are_cut_after_the_write_timeout(slow_server):
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(slow_server.address, options=SLOW_CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        requests = [token_request([5, 6, 7], max_tokens=1000, ignore_eos=True, logprobs=20, temperature=1.0,
                                  seed=index) for index in range(MAX_CONCURRENT_RPCS)]
        for index, request in enumerate(requests):
            request.request_id = f"unread-{index}"
        with slow_server.workers_paused():  # all 32 start in the same step, whatever the host's speed
            calls = [stub.GenerateStream(request) for request in requests]
            slow_server.wait_submitted(*(request.request_id for request in requests))
        started = time.monotonic()
        assert wait_for(lambda: slow_server.stats().num_running == MAX_CONCURRENT_RPCS, timeout=30)
        # every Generation slot is taken: health and readiness answer, a further call is refused
        assert _health(slow_server.address, "") == serving
        assert _health(slow_server.address, "pagedserve.v1.Generation") == serving
        with pytest.raises(grpc.RpcError) as info:
            slow_server.stub.Generate(token_request([5, 6], max_tokens=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the writes stall; past the timeout every stream is cut and its request aborted
        assert wait_for(lambda: slow_server.log_events_named("stream_write_timeout") == MAX_CONCURRENT_RPCS,
                        timeout=WRITE_TIMEOUT_S + 60), slow_server.logs()[-3000:]
        assert time.monotonic() - started >= WRITE_TIMEOUT_S
        assert_pool_whole(slow_server)
        # what the client had received before the cut, then the status (cut: CANCELLED)
        for call in calls:
            with pytest.raises(grpc.RpcError) as ended:
                for _ in call:
                    pass
            assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert _health(slow_server.address, "") == serving
    answer = slow_server.stub.Generate(token_request([5, 6, 7], max_tokens=4, ignore_eos=True), timeout=30)
    assert len(answer.completions[0].token_ids) == 4
