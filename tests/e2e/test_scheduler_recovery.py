"""A scheduler killed with SIGKILL mid-stream loses no request: the frontend (started on its own,
like the scheduler and the worker) waits for the restarted scheduler and resubmits every running
request with the tokens already streamed, and each client's stream goes on to exactly the tokens
of an undisturbed run: greedy streams, a seeded sampling stream, a greedy stream with penalties
and an n = 2 seeded stream, with the scheduler killed once, then twice.

The worker does not survive its scheduler: it has registered once and only heartbeats afterwards,
so a new scheduler (on the same ZeroMQ addresses) never hears a registration, and its step
numbering would start over anyway. The test restarts the worker with the scheduler, as a
supervisor must (here on fresh ZeroMQ ports; the scheduler keeps its gRPC port).
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2_grpc
from tests.e2e.harness import assert_pool_whole, token_request, wait_for
from tests.e2e.test_service_restart import Frontend, Process, Replica

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_TOKENS = 48
RECOVERY_TIMEOUT_S = 120
PROMPTS = [[11 + 7 * i, 40 + i, 41, 42 + 3 * i] * (2 + i % 3) for i in range(8)]
REQUESTS = {
    **{f"greedy-{i}": token_request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True) for i, prompt in enumerate(PROMPTS)},
    "seeded": token_request([5, 6, 7, 8, 9], max_tokens=MAX_TOKENS, temperature=0.8, seed=1234, ignore_eos=True),
    "penalties": token_request([21, 22, 23], max_tokens=MAX_TOKENS, repetition_penalty=1.3, presence_penalty=0.5,
                               frequency_penalty=0.3, ignore_eos=True),
    "n2": token_request([30, 31, 32, 33], max_tokens=MAX_TOKENS, temperature=0.8, seed=99, n=2, ignore_eos=True),
}
NUM_INDICES = {name: request.params.n or 1 for name, request in REQUESTS.items()}


class RecoveringReplica(Replica):
    def kill_scheduler(self) -> None:
        """SIGKILL (the test froze it with SIGSTOP first, where it saw the streams)."""
        self.scheduler.stop(signal.SIGKILL)

    def restart(self) -> None:
        """What a supervisor does: stop the orphaned worker, start scheduler and worker again."""
        self.worker.stop()
        self.start()


class RecoveringFrontend(Frontend):
    """test_service_restart's Frontend, given --scheduler-recovery-timeout."""

    def __init__(self, checkpoint, scheduler_port: int, log_dir) -> None:
        self.port = free_port()
        self.process = Process("frontend-recovering", [
            "frontend", "--model", str(checkpoint), "--port", str(self.port), "--http-port", "0",
            "--scheduler-address", f"127.0.0.1:{scheduler_port}",
            "--scheduler-recovery-timeout", str(RECOVERY_TIMEOUT_S)], log_dir)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)


class Stream:
    """One GenerateStream read on a thread: tokens and finish reason per index."""

    def __init__(self, stub, name: str) -> None:
        self.name = name
        self.tokens: dict[int, list[int]] = {index: [] for index in range(NUM_INDICES[name])}
        self.finish: dict[int, int] = {}
        self.error: Exception | None = None
        self.prompt_tokens = 0
        self.thread = threading.Thread(target=self._read, args=(stub,), name=name)
        self.thread.start()

    def _read(self, stub) -> None:
        try:
            for message in stub.GenerateStream(REQUESTS[self.name], timeout=300):
                for completion in message.completions:
                    self.tokens[completion.index].extend(completion.token_ids)
                    if completion.finish_reason:
                        self.finish[completion.index] = completion.finish_reason
                if message.HasField("usage"):
                    self.prompt_tokens = message.usage.prompt_tokens
        except Exception as exc:  # reported by the test thread
            self.error = exc

    def min_tokens(self) -> int:
        return min(len(tokens) for tokens in self.tokens.values())

    @property
    def is_done(self) -> bool:
        return not self.thread.is_alive()

    def result(self) -> dict:
        self.thread.join(300)
        assert not self.thread.is_alive(), f"{self.name} did not end"
        assert self.error is None, f"{self.name}: {self.error}"
        return {"tokens": self.tokens, "finish": self.finish, "prompt_tokens": self.prompt_tokens}


@pytest.fixture(scope="module")
def replica(llama_checkpoint, tmp_path_factory):
    replica = RecoveringReplica(llama_checkpoint, tmp_path_factory.mktemp("scheduler-recovery"))
    replica.start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def frontend(replica, llama_checkpoint):
    frontend = RecoveringFrontend(llama_checkpoint, replica.port, replica.log_dir)
    assert wait_for(lambda: frontend.health() == SERVING, timeout=240, interval=0.25)
    yield frontend
    frontend.channel.close()
    frontend.process.stop()


@pytest.fixture(scope="module")
def undisturbed(frontend) -> dict[str, dict]:
    streams = [Stream(frontend.stub, name) for name in REQUESTS]
    return {stream.name: stream.result() for stream in streams}


def _freeze_when(replica: RecoveringReplica, streams: list[Stream], min_tokens: int) -> list[int]:
    """Waits until every index of every stream has min_tokens tokens, then freezes the scheduler
    (SIGSTOP) and returns how many each stream had; none may have ended."""
    assert wait_for(lambda: all(s.min_tokens() >= min_tokens or s.is_done for s in streams),
                    timeout=240, interval=0.002)
    replica.scheduler.proc.send_signal(signal.SIGSTOP)
    counts = [stream.min_tokens() for stream in streams]
    ended = [stream.name for stream in streams if stream.is_done]
    assert not ended, f"streams ended before the kill: {ended} ({[s.error for s in streams if s.is_done]})"
    return counts


def _kill_and_restart(replica: RecoveringReplica, frontend: RecoveringFrontend) -> float:
    replica.kill_scheduler()
    killed_at = time.monotonic()
    assert wait_for(lambda: frontend.health() == NOT_SERVING, timeout=10)
    assert frontend.generate_code() == grpc.StatusCode.UNAVAILABLE, "new calls are refused while it is down"
    replica.restart()
    return killed_at


def _check(streams: list[Stream], undisturbed: dict[str, dict]) -> None:
    for stream in streams:
        result = stream.result()
        expected = undisturbed[stream.name]
        assert result["tokens"] == expected["tokens"], stream.name
        assert result["finish"] == expected["finish"], stream.name
        assert result["prompt_tokens"] == expected["prompt_tokens"], stream.name


def _resumed(frontend: RecoveringFrontend) -> list[dict]:
    return [event for event in frontend.process.events() if event["event"] == "request_resuming"]


def test_scheduler_killed_mid_stream_loses_no_request(replica, frontend, undisturbed):
    assert all(len(tokens) == MAX_TOKENS for result in undisturbed.values() for tokens in result["tokens"].values())
    assert undisturbed["n2"]["tokens"][0] != undisturbed["n2"]["tokens"][1], "the samples differ"
    num_resumed_before = len(_resumed(frontend))
    streams = [Stream(frontend.stub, name) for name in REQUESTS]
    counts = _freeze_when(replica, streams, min_tokens=4)
    killed_at = _kill_and_restart(replica, frontend)
    _check(streams, undisturbed)
    recovered_s = time.monotonic() - killed_at
    print(f"tokens at the kill: {counts}; every stream complete {recovered_s:.1f}s after it")

    assert_pool_whole(replica)
    assert wait_for(lambda: frontend.health() == SERVING, timeout=10)
    assert len(_resumed(frontend)) - num_resumed_before == len(REQUESTS)
    submitted = [event for event in replica.scheduler.events() if event["event"] == "request_submitted"]
    assert len(submitted) == len(REQUESTS)
    assert all(event.get("continued_tokens") for event in submitted), "every request went on where it was"


def test_scheduler_killed_twice(replica, frontend, undisturbed):
    streams = [Stream(frontend.stub, name) for name in REQUESTS]
    first = _freeze_when(replica, streams, min_tokens=3)
    _kill_and_restart(replica, frontend)
    second = _freeze_when(replica, streams, min_tokens=max(first) + 4)
    _kill_and_restart(replica, frontend)
    _check(streams, undisturbed)
    print(f"tokens at the first kill: {first}; at the second: {second}")
    assert_pool_whole(replica)
