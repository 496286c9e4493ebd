"""A scheduler that dies mid-request: the frontend waits for a restarted one (a new scripted
scheduler on the same port, a new instance) and resubmits each running request as a continuation,
so the client's stream goes on without a gap or a repeated token. A scheduler that is still there
and ends a stream itself, a recovery timeout that passes, or recovery turned off end the request
with UNAVAILABLE. Each test runs with requests on their own Submit streams and on the frontend's
Session."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fake_scheduler import FakeSchedulerServer

from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STEP_DELAY_S = 0.03
RECOVERY_TIMEOUT_S = 3.0
SCRIPT_0 = "The keeper climbed the stairs to light the lamp, and the lamp burned until dawn came."
SCRIPT_1 = "Ships passed in the night and saw the beam."


class Replica:
    """A scripted scheduler on a fixed port that can die and come back as a new instance."""

    def __init__(self, has_session: bool = False) -> None:
        self.has_session = has_session
        self.port = free_port()
        self.server: FakeSchedulerServer | None = None
        self.instances: list[FakeSchedulerServer] = []
        self.script: dict[int, list[int]] = {}

    def start(self) -> FakeSchedulerServer:
        self.server = FakeSchedulerServer(self.port)
        self.server.fake.step_delay_s = STEP_DELAY_S
        self.server.fake.has_session = self.has_session
        if self.script:
            self.server.fake.tokens_by_index = dict(self.script)
        self.instances.append(self.server)
        return self.server

    def kill(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def fake(self):
        return self.server.fake


@pytest.fixture(params=["submit", "session"])
def replica(request):
    replica = Replica(has_session=request.param == "session")
    replica.start()
    yield replica
    replica.kill()


def _frontend(tokenizer_folder, replica: Replica, recovery_timeout: float):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.server import serve_frontend

    config = FrontendConfig(model_path=str(tokenizer_folder), scheduler_address=f"127.0.0.1:{replica.port}",
                            host="127.0.0.1", port=0, scheduler_recovery_timeout=recovery_timeout)
    return serve_frontend(config, health_poll_interval_s=0.1)


@pytest.fixture()
def frontend(tokenizer_folder, replica):
    server = _frontend(tokenizer_folder, replica, RECOVERY_TIMEOUT_S)
    yield server
    server.stop(grace_s=1.0)


def _health(channel) -> int:
    check = health_pb2_grpc.HealthStub(channel).Check
    return check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=5).status


def _wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _request(prompt="Hello", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))


class Stream:
    """A GenerateStream read on a thread: its messages, and its error if it failed."""

    def __init__(self, stub, request: pb.GenerateRequest) -> None:
        self.call = stub.GenerateStream(request, timeout=60)
        self.messages: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as exc:
            self.error = exc

    def tokens(self, index: int = 0) -> list[int]:
        return [token for message in self.messages for completion in message.completions
                if completion.index == index for token in completion.token_ids]

    def text(self, index: int = 0) -> str:
        return "".join(completion.text for message in self.messages for completion in message.completions
                       if completion.index == index)

    def finish(self, index: int = 0) -> int:
        return [c.finish_reason for m in self.messages for c in m.completions if c.index == index][-1]

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive()


def _script(replica: Replica, tokenizer, *texts: str) -> list[list[int]]:
    scripts = [tokenizer.encode(text)[1:] for text in texts]
    replica.script = dict(enumerate(scripts))
    replica.fake.tokens_by_index = dict(replica.script)
    return scripts


def test_stream_continues_on_the_restarted_scheduler_without_gap_or_repeat(replica, stub, channel, tokenizer):
    (script,) = _script(replica, tokenizer, SCRIPT_0)
    max_tokens = len(script)
    stream = Stream(stub, _request("Hello there", max_tokens=max_tokens))
    assert _wait_for(lambda: len(stream.tokens()) >= 5)
    replica.kill()
    assert _wait_for(lambda: _health(channel) == NOT_SERVING)
    with pytest.raises(grpc.RpcError) as info:  # new calls are refused while it is down
        stub.Generate(_request(max_tokens=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    num_before = len(stream.tokens())
    assert num_before < max_tokens
    restarted = replica.start()
    stream.join()

    assert stream.error is None, stream.error
    assert stream.tokens() == script
    assert stream.text() == tokenizer.decode(script)
    assert stream.finish() == pb.FINISH_REASON_LENGTH
    usage = stream.messages[-1].usage
    assert usage.prompt_tokens == len(tokenizer.encode("Hello there"))
    assert usage.completion_tokens == max_tokens
    (resubmitted,) = restarted.fake.submits
    assert list(resubmitted.prompt_token_ids) == tokenizer.encode("Hello there")
    (continuation,) = resubmitted.continuations
    assert continuation.index == 0 and not continuation.is_finished
    assert list(continuation.token_ids) == script[:len(continuation.token_ids)]
    assert len(continuation.token_ids) >= num_before
    assert continuation.cumulative_logprob == pytest.approx(-0.5 * len(continuation.token_ids))
    assert _health(channel) == SERVING


def test_each_index_continues_from_its_own_tokens_and_finished_ones_stay_finished(replica, stub, tokenizer):
    script_0, script_1 = _script(replica, tokenizer, SCRIPT_0, SCRIPT_1)
    stream = Stream(stub, _request(max_tokens=len(script_0), n=2, stop=["night"]))
    assert _wait_for(lambda: any(c.index == 1 and c.finish_reason for m in stream.messages for c in m.completions))
    assert _wait_for(lambda: len(stream.tokens(0)) >= 8)
    replica.kill()
    restarted = replica.start()
    stream.join()

    assert stream.error is None, stream.error
    assert stream.tokens(0) == script_0
    assert stream.text(1) == "Ships passed in the "
    assert stream.finish(1) == pb.FINISH_REASON_STOP_SEQUENCE
    (resubmitted,) = restarted.fake.submits
    by_index = {c.index: c for c in resubmitted.continuations}
    assert by_index[1].is_finished and list(by_index[1].token_ids) == stream.tokens(1)
    assert not by_index[0].is_finished
    assert list(by_index[0].token_ids) == script_0[:len(by_index[0].token_ids)]


def test_the_scheduler_can_die_again_while_the_request_resumes(replica, stub, tokenizer):
    (script,) = _script(replica, tokenizer, SCRIPT_0)
    stream = Stream(stub, _request(max_tokens=len(script)))
    for num_tokens in (3, 9):
        assert _wait_for(lambda: len(stream.tokens()) >= num_tokens)
        replica.kill()
        time.sleep(0.3)
        replica.start()
    stream.join()
    assert stream.error is None, stream.error
    assert stream.tokens() == script
    assert [len(instance.fake.submits) for instance in replica.instances] == [1, 1, 1]


def test_beam_search_starts_over(replica, stub, tokenizer):
    _script(replica, tokenizer, SCRIPT_0, SCRIPT_1)
    replica.fake.step_delay_s = 1.0  # the beams arrive whole, at the end
    stream = Stream(stub, _request(max_tokens=6, beam_width=2))
    assert _wait_for(lambda: len(replica.fake.submits) == 1)
    replica.kill()
    restarted = replica.start()
    stream.join()
    assert stream.error is None, stream.error
    assert sorted(c.index for m in stream.messages for c in m.completions) == [0, 1]
    (resubmitted,) = restarted.fake.submits
    assert not resubmitted.continuations


def test_no_restart_within_the_recovery_timeout_fails_with_unavailable(replica, stub, tokenizer):
    _script(replica, tokenizer, SCRIPT_0)
    stream = Stream(stub, _request(max_tokens=40))
    assert _wait_for(lambda: len(stream.tokens()) >= 3)
    replica.kill()
    killed_at = time.monotonic()
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "--scheduler-recovery-timeout" in stream.error.details()
    assert RECOVERY_TIMEOUT_S - 0.5 < time.monotonic() - killed_at < RECOVERY_TIMEOUT_S + 5


def test_recovery_timeout_zero_fails_at_once(tokenizer_folder, replica, tokenizer):
    frontend = _frontend(tokenizer_folder, replica, 0.0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
            assert _wait_for(lambda: _health(channel) == SERVING)
            _script(replica, tokenizer, SCRIPT_0)
            stream = Stream(generation_pb2_grpc.GenerationStub(channel), _request(max_tokens=40))
            assert _wait_for(lambda: len(stream.tokens()) >= 3)
            replica.kill()
            killed_at = time.monotonic()
            stream.join()
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed_at < 2.0
    finally:
        frontend.stop(grace_s=1.0)


def test_a_live_scheduler_ending_the_stream_is_final(replica, stub, tokenizer):
    _script(replica, tokenizer, SCRIPT_0)
    replica.fake.abort_after_messages = 3
    started = time.monotonic()
    stream = Stream(stub, _request(max_tokens=40))
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "ended by the fake scheduler" in stream.error.details()
    assert time.monotonic() - started < 2.0
    assert len(replica.fake.submits) == 1, "the same scheduler instance is not asked again"


def test_a_client_that_cancels_during_the_outage_is_not_resubmitted(replica, stub, tokenizer):
    _script(replica, tokenizer, SCRIPT_0)
    stream = Stream(stub, _request(max_tokens=40))
    assert _wait_for(lambda: len(stream.tokens()) >= 3)
    replica.kill()
    time.sleep(0.5)
    stream.call.cancel()
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    restarted = replica.start()
    time.sleep(1.0)
    assert not restarted.fake.submits


def test_a_resubmission_refused_for_a_full_queue_is_tried_again(replica, stub, tokenizer):
    (script,) = _script(replica, tokenizer, SCRIPT_0)
    stream = Stream(stub, _request(max_tokens=len(script)))
    assert _wait_for(lambda: len(stream.tokens()) >= 3)
    replica.kill()
    restarted = replica.start()
    restarted.fake.is_ready = False  # (before the frontend's next poll: it polls every 0.2 s)
    restarted.fake.reject_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    restarted.fake.is_ready = True
    assert _wait_for(lambda: len(restarted.fake.submits) >= 2)
    restarted.fake.reject_code = None
    stream.join()
    assert stream.error is None, stream.error
    assert stream.tokens() == script
    assert len(restarted.fake.submits) >= 3
