"""`pagedserve serve` as a user starts it (a real process tree on free local ports), for benchmarks.

    with ServeProcess(model, ["--dtype", "bfloat16"], num_threads=1, log_path=path) as server:
        stub = server.stub                       # pagedserve.v1.Generation, synchronous
        aio_channel = server.aio_channel()       # for asyncio clients

num_threads sets OMP_NUM_THREADS for the tree, which is how the worker's torch picks its
intra-op thread count. StepRecorder collects the scheduler's per-step records (tokens, step and
forward seconds) while a run goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.serve_config import free_port
from pagedserve.v1 import generation_pb2_grpc

READY_SERVICE = "pagedserve.v1.Generation"


class ServeProcess:
    def __init__(self, model: str | Path, extra_args: list[str], *, log_path: Path,
                 num_threads: int | None = None, ready_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.scheduler_port = free_port()
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model),
                        "--port", str(self.port), "--scheduler-port", str(self.scheduler_port),
                        "--device", "cpu", *extra_args]
        self.env = dict(os.environ)
        if num_threads is not None:
            self.env["OMP_NUM_THREADS"] = str(num_threads)
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "ServeProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def aio_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address)

    def child_pids(self) -> dict[str, int]:
        """pid of each child by role (scheduler, worker-RANK, frontend), from /proc."""
        roles = {}
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in map(int, children):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if "pagedserve.cli" in argv:
                role = argv[argv.index("pagedserve.cli") + 1]
                if role == "worker":
                    role = f"worker-{argv[argv.index('--rank') + 1]}"
                roles[role] = pid
        return roles

    def _wait_ready(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=READY_SERVICE), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"serve was not ready after {self.ready_timeout}s; log: {self.log_path}")

    def __exit__(self, *exc_info) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()


class StepRecorder:
    """Polls the scheduler's recent step records (the last 256 steps) while the block runs;
    `records` holds every step seen, by step id."""

    def __init__(self, server: ServeProcess, interval: float = 0.5) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{server.scheduler_port}")
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="step-recorder", daemon=True)
        self.records: dict[int, scheduler_pb2.StepSummary] = {}

    def _collect(self) -> None:
        request = scheduler_pb2.GetStatsRequest(max_recent_steps=256)
        for record in self._stub.GetStats(request, timeout=10).recent_steps:
            self.records[record.step_id] = record

    def _poll(self) -> None:
        while not self._done.wait(self._interval):
            self._collect()

    def __enter__(self) -> "StepRecorder":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        self._collect()
        self._channel.close()
