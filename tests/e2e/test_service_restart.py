"""Processes started one by one (`pagedserve scheduler`, `worker`, `frontend`): a scheduler that
drains and restarts leaves the frontend reporting UNAVAILABLE until it is back, and a frontend's
shutdown timeout cuts what is still running (UNAVAILABLE, aborted in the scheduler)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2_grpc
from pagedserve.security.zmq_curve import curve_env_for, new_curve_env
from tests.e2e.harness import PAUSE_ARGS, ServeProcess, assert_pool_whole, parse_log_events, token_request, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FRONTEND_SHUTDOWN_TIMEOUT_S = 1.0


class Process:
    """One `python -m pagedserve.cli ARGS…` process, its output in log_dir/name.log."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def events(self) -> list[dict]:
        return parse_log_events(self.log_path.read_text(errors="replace"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Replica:
    """A scheduler and its worker, restartable on the same scheduler port (fresh ZeroMQ ports)."""

    def __init__(self, checkpoint: Path, log_dir: Path) -> None:
        self.checkpoint = checkpoint
        self.log_dir = log_dir
        self.port = free_port()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.scheduler: Process | None = None
        self.worker: Process | None = None
        self.num_starts = 0
        self.curve_env = {**os.environ, **new_curve_env()}  # the CURVE keys of the tcp:// ZeroMQ link

    def start(self) -> None:
        self.num_starts += 1
        plan, result, dist = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
        self.scheduler = Process(f"scheduler-{self.num_starts}", [
            "scheduler", "--model", str(self.checkpoint), "--port", str(self.port), "--plan-address", plan,
            "--result-address", result, "--num-kv-blocks", "128", "--shutdown-timeout", "60", *PAUSE_ARGS],
            self.log_dir, curve_env_for("scheduler", self.curve_env))
        self.worker = Process(f"worker-{self.num_starts}", [
            "worker", "--model", str(self.checkpoint), "--plan-address", plan, "--result-address", result,
            "--dist-init-address", dist, "--device", "cpu", "--dtype", "float32", "--swap-space", "0.25"],
            self.log_dir, curve_env_for("worker", self.curve_env))

    @property
    def is_running(self) -> bool:
        return self.scheduler is not None and self.scheduler.proc.poll() is None

    def stats(self, max_recent_steps: int = 0) -> scheduler_pb2.SchedulerStats:
        return self.stub.GetStats(scheduler_pb2.GetStatsRequest(max_recent_steps=max_recent_steps), timeout=10)

    wait_idle = ServeProcess.wait_idle

    def stop(self) -> None:
        for process in (self.scheduler, self.worker):
            if process is not None:
                process.stop()
        self.channel.close()


class Frontend:
    def __init__(self, checkpoint: Path, scheduler_port: int, log_dir: Path) -> None:
        self.port = free_port()
        self.process = Process("frontend", [
            "frontend", "--model", str(checkpoint), "--port", str(self.port), "--http-port", "0",
            "--scheduler-address", f"127.0.0.1:{scheduler_port}",
            "--shutdown-timeout", str(FRONTEND_SHUTDOWN_TIMEOUT_S)], log_dir)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def health(self) -> int | None:
        try:
            return self._health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"),
                                      timeout=2).status
        except grpc.RpcError:
            return None

    def generate_code(self) -> grpc.StatusCode:
        try:
            self.stub.Generate(token_request([1, 2, 3], max_tokens=2), timeout=30)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


@pytest.fixture(scope="module")
def replica(llama_checkpoint, tmp_path_factory):
    replica = Replica(llama_checkpoint, tmp_path_factory.mktemp("standalone"))
    replica.start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def frontend(replica, llama_checkpoint):
    frontend = Frontend(llama_checkpoint, replica.port, replica.log_dir)
    yield frontend
    frontend.channel.close()
    frontend.process.stop()


def _long_stream(frontend: Frontend, max_tokens: int):
    """A running stream and the number of tokens of its first message."""
    call = frontend.stub.GenerateStream(token_request([70, 71, 72, 73], max_tokens=max_tokens, ignore_eos=True),
                                        timeout=300)
    num_first_tokens = len(next(call).completions[0].token_ids)
    assert num_first_tokens
    return call, num_first_tokens


def test_scheduler_drains_and_frontend_is_unavailable_until_it_is_back(replica, frontend):
    assert wait_for(lambda: frontend.health() == SERVING, timeout=240, interval=0.25)
    running, num_tokens = _long_stream(frontend, 1000)
    first_scheduler = replica.scheduler
    first_scheduler.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: frontend.health() == NOT_SERVING, timeout=10)
    assert frontend.generate_code() == grpc.StatusCode.UNAVAILABLE

    messages = list(running)  # the drain lets the running request finish whole
    assert num_tokens + sum(len(m.completions[0].token_ids) for m in messages) == 1000
    assert messages[-1].completions[0].finish_reason == 1  # FINISH_REASON_LENGTH
    assert first_scheduler.proc.wait(60) == 0
    assert replica.worker.proc.wait(60) == 0, "the worker was not told to shut down"
    events = {event["event"]: event for event in first_scheduler.events()}
    assert events["scheduler_draining"]["num_open_streams"] == 1
    assert events["scheduler_stopping"]["num_streams_cut"] == 0

    assert frontend.health() == NOT_SERVING and frontend.generate_code() == grpc.StatusCode.UNAVAILABLE
    assert frontend.process.proc.poll() is None, "the frontend must outlive its scheduler"
    replica.start()
    assert wait_for(lambda: frontend.health() == SERVING, timeout=240, interval=0.25)
    assert frontend.generate_code() == grpc.StatusCode.OK


def test_frontend_shutdown_timeout_cuts_running_requests(replica, frontend):
    if not replica.is_running:
        replica.start()
    assert wait_for(lambda: frontend.health() == SERVING, timeout=240, interval=0.25)
    calls = [_long_stream(frontend, 1000)[0] for _ in range(2)]
    os.kill(replica.worker.proc.pid, signal.SIGSTOP)  # the requests are certainly running at the timeout
    try:
        frontend.process.proc.send_signal(signal.SIGTERM)
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "retry" in info.value.details()
    finally:
        os.kill(replica.worker.proc.pid, signal.SIGCONT)
    assert frontend.process.proc.wait(FRONTEND_SHUTDOWN_TIMEOUT_S + 30) == 0
    assert_pool_whole(replica)
    stopped = [event for event in frontend.process.events() if event["event"] == "frontend_stopped"]
    assert stopped[-1]["num_requests_cut"] == 2
