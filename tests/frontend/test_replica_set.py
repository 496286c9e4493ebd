"""A frontend over two scripted schedulers (`--scheduler-address A --scheduler-address B`):
placement, retry of a refusal before the first token, resumption on the other replica when one
breaks mid-stream, readiness and ModelInfo of the set, and the priority reaching the scheduler."""

from __future__ import annotations

import grpc
import pytest
from fake_scheduler import FakeSchedulerServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def replicas():
    servers = [FakeSchedulerServer(), FakeSchedulerServer()]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def frontend(tokenizer_folder, replicas):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.server import serve_frontend

    config = FrontendConfig(model_path=str(tokenizer_folder),
                            scheduler_address=",".join(server.address for server in replicas),
                            host="127.0.0.1", port=0, scheduler_recovery_timeout=5.0)
    server = serve_frontend(config, health_poll_interval_s=0.1)
    yield server
    server.stop(grace_s=1.0)


@pytest.fixture()
def fakes(replicas):
    for server in replicas:
        server.fake.reset()
    return [server.fake for server in replicas]


@pytest.fixture(scope="module")
def channel(frontend):
    with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as chan:
        yield chan


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


def _request(prompt: str = "Hello there", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))


def _health(channel) -> int:
    import time

    time.sleep(0.4)  # a few readiness polls
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=5).status


def test_requests_are_spread_over_both_replicas_and_carry_their_priority(fakes, stub):
    for index in range(6):
        request = _request(f"prompt number {index} " * 3, max_tokens=2)
        request.priority = -3 if index == 0 else 7
        assert len(stub.Generate(request, timeout=10).completions[0].token_ids) == 2
    assert all(fake.submits for fake in fakes)
    priorities = sorted(submit.priority for fake in fakes for submit in fake.submits)
    assert priorities == [-3] + [7] * 5


def test_a_refusal_before_the_first_token_is_retried_on_the_other_replica(fakes, stub):
    fakes[0].reject_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    fakes[1].reject_code = None
    for index in range(4):
        answer = stub.Generate(_request(f"retry {index}", max_tokens=3), timeout=10)
        assert len(answer.completions[0].token_ids) == 3
    assert len(fakes[1].submits) == 4


def test_a_stream_broken_midway_resumes_on_the_other_replica(fakes, stub):
    fakes[0].abort_after_messages = 2  # replica 0 ends every stream with UNAVAILABLE after 2 tokens
    script = fakes[0].tokens_by_index[0]
    for index in range(2):  # new prompts go to the least used replica: one of them starts on replica 0
        answer = stub.Generate(_request(f"resume me {index}", max_tokens=5), timeout=20)
        assert list(answer.completions[0].token_ids) == script[:5]  # no gap, no repeat
    continued = [submit for submit in fakes[1].submits if submit.continuations]
    assert continued and all(list(submit.continuations[0].token_ids) == script[:2] for submit in continued)


def test_a_replica_that_is_not_ready_gets_nothing_and_the_set_is_ready_while_one_is(fakes, stub, channel):
    fakes[0].is_ready = False
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    for index in range(3):
        stub.Generate(_request(f"only one {index}", max_tokens=1), timeout=10)
    assert not fakes[0].submits and len(fakes[1].submits) == 3
    fakes[1].is_ready = False
    assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(_request("nobody", max_tokens=1), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    fakes[0].is_ready = fakes[1].is_ready = True
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_model_info_counts_the_blocks_of_every_ready_replica(fakes, stub):
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).num_kv_blocks == 200


def test_the_replicas_model_info_counts_as_ready_are_the_ones_requests_go_to(fakes, stub, channel):
    """ModelInfo asks every replica afresh; the router must agree with that answer at once, not
    after its next readiness poll (a client that waits for ModelInfo to count every replica, as an
    operator's check does, would otherwise send its first requests to the replicas seen earlier)."""
    fakes[0].is_ready = False
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING  # the polls saw replica 0 not ready
    fakes[0].is_ready, fakes[1].is_ready = True, False
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).num_kv_blocks == 100
    for index in range(3):
        stub.Generate(_request(f"after model info {index}", max_tokens=1), timeout=10)
    assert len(fakes[0].submits) == 3 and not fakes[1].submits
    fakes[1].is_ready = True
