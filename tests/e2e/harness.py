"""Starts `pagedserve serve` as a user would (a real process tree) and talks to it over gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.serve_config import free_port
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

READY_SERVICE = "pagedserve.v1.Generation"


class ServeProcess:
    """One `pagedserve serve` process tree on free local ports, logs in log_path.

    `credentials` (TLS to the public port) are used for `channel`; `metrics=True` also serves
    both processes' Prometheus metrics on free ports (`metrics_port`, `scheduler_metrics_port`).
    """

    def __init__(self, model: str | Path, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, metrics: bool = False) -> None:
        self.port = free_port()
        self.scheduler_port = free_port()
        self.log_path = log_path
        self.metrics_port = free_port() if metrics else None
        self.scheduler_metrics_port = free_port() if metrics else None
        metrics_args = (["--metrics-port", str(self.metrics_port),
                         "--scheduler-metrics-port", str(self.scheduler_metrics_port)] if metrics else [])
        command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model),
                   "--port", str(self.port), "--scheduler-port", str(self.scheduler_port),
                   "--device", "cpu", "--swap-space", "0.25", *metrics_args, *(extra_args or [])]
        self._log_file = open(log_path, "wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=full_env)
        if credentials is None:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        else:
            self.channel = grpc.secure_channel(f"127.0.0.1:{self.port}", credentials)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.scheduler_channel = grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}")
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.scheduler_channel)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        """The JSON log events of every process of the tree, parsed."""
        return parse_log_events(self.logs())

    def child_pids(self) -> dict[str, int]:
        """pid of each child process by role: scheduler, worker-0 …, frontend."""
        return {_role(pid): pid for pid in _children(self.proc.pid)}

    def metrics(self, process: str = "frontend") -> str:
        """The Prometheus text exposition of the frontend or the scheduler."""
        port = self.metrics_port if process == "frontend" else self.scheduler_metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()

    def health(self, service: str = READY_SERVICE) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"serve was not ready after {timeout}s:\n{self.logs()[-4000:]}")

    def stats(self, max_recent_steps: int = 0) -> scheduler_pb2.SchedulerStats:
        return self.scheduler.GetStats(
            scheduler_pb2.GetStatsRequest(max_recent_steps=max_recent_steps), timeout=10)

    def wait_idle(self, timeout: float = 30.0) -> scheduler_pb2.SchedulerStats:
        """Waits until no request is running, waiting or swapped; returns the stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.num_running == stats.num_waiting == stats.num_swapped == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"scheduler still busy: {stats}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        self.channel.close()
        self.scheduler_channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def token_request(prompt_token_ids: list[int], **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.PromptTokenIds(ids=prompt_token_ids),
        params=generation_pb2.SamplingParams(**params))


def text_request(prompt: str, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt,
                                          params=generation_pb2.SamplingParams(**params))


def parse_log_events(text: str) -> list[dict]:
    """JSON objects of a log several processes wrote to: one per line, except where a process
    left its line unterminated (it exited mid-line) and another's follows on the same line."""
    decoder = json.JSONDecoder()
    events = []
    for line in text.splitlines():
        position = line.find("{")
        while position != -1:
            try:
                event, end = decoder.raw_decode(line, position)
            except json.JSONDecodeError:
                end = position + 1
            else:
                if isinstance(event, dict) and "event" in event:
                    events.append(event)
            position = line.find("{", end)
    return events


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _role(pid: int) -> str:
    """scheduler, frontend or worker-RANK, from a `python -m pagedserve.cli ROLE …` command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    role = argv[argv.index("pagedserve.cli") + 1] if "pagedserve.cli" in argv else str(pid)
    if role == "worker":
        role = f"worker-{argv[argv.index('--rank') + 1]}"
    return role


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Polls predicate until it is true (True) or timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_pool_whole(server: ServeProcess, timeout: float = 30.0) -> scheduler_pb2.SchedulerStats:
    """Waits until the scheduler is idle, then requires every block back: none used on GPU or
    CPU, free + cached = total, and consistent reference counts."""
    stats = server.wait_idle(timeout)
    assert stats.is_pool_consistent, stats
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0, stats
    assert stats.num_gpu_blocks_free + stats.num_gpu_blocks_cached == stats.num_gpu_blocks_total, stats
    return stats
