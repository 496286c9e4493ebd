"""Starts `pagedserve serve` as a user would (a real process tree) and talks to it over gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.supervisor import free_port
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

READY_SERVICE = "pagedserve.v1.Generation"


class ServeProcess:
    """One `pagedserve serve` process tree on free local ports, logs in log_path."""

    def __init__(self, model: str | Path, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.scheduler_port = free_port()
        self.log_path = log_path
        command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model),
                   "--port", str(self.port), "--scheduler-port", str(self.scheduler_port),
                   "--device", "cpu", "--swap-space", "0.25", *(extra_args or [])]
        self._log_file = open(log_path, "wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=full_env)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.scheduler_channel = grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}")
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.scheduler_channel)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

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
