"""`pagedserve serve` as a child process tree on free local ports, for tests, benchmarks and
programs that embed a server.

    with ServeProcess("demo", Path("serve.log"), ["--dtype", "bfloat16"]) as server:
        server.stub.Generate(...)           # pagedserve.v1.Generation, synchronous
        server.stats()                      # the scheduler's internal GetStats

    with ServeProcess("demo", Path("serve.log"), http_port=True) as server:
        OpenAI(base_url=server.http_url + "/v1", api_key="-")   # the OpenAI-compatible HTTP API

The constructor starts the tree; `wait_ready` (called by `with`) waits for readiness; `stop`
(called at the end of `with`) sends SIGTERM and returns serve's exit code, killing the whole
process group when it does not exit in time. A tree started on the main thread also stops when this
process exits without stopping it (pagedserve.launch.parent_death).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.security.bearer_auth import with_bearer
from pagedserve.security.internal_token import INTERNAL_TOKEN_ENV
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.launch.parent_death import child_env
from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2_grpc

READY_SERVICE = "pagedserve.v1.Generation"
# gRPC's default reconnect backoff (1 s, growing by 1.6x) would leave a channel made before the
# tree listens failing for seconds after it does: wait_ready, and the calls after a restart, retry
# every few hundred milliseconds instead.
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500))


class ServeProcess:
    """One `pagedserve serve` tree, its output in log_path.

    `credentials` (TLS to the public port) are used for `channel`; `metrics=True` also serves both
    processes' Prometheus metrics on free ports (`metrics_port`, `scheduler_metrics_port`);
    `num_threads` sets OMP_NUM_THREADS for the tree (the workers' torch thread count);
    `api_key` (the server's --api-key) is sent with every call of `channel`;
    `http_port=True` serves the OpenAI-compatible HTTP API on a free port (`http_port`, `http_url`),
    an int on that port; by default the tree has no HTTP port (serve's own default, 8000, would
    collide between trees).
    """

    def __init__(self, model: str | Path, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, metrics: bool = False,
                 num_threads: int | None = None, device: str = "cpu",
                 ready_timeout: float = 300.0, http_port: bool | int = False, api_key: str | None = None) -> None:
        self.port = free_port()
        if http_port is True:
            http_port = free_port()
        self.http_port: int | None = int(http_port) or None
        self.scheduler_port = free_port()
        self.log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.metrics_port = free_port() if metrics else None
        self.scheduler_metrics_port = free_port() if metrics else None
        metrics_args = (["--metrics-port", str(self.metrics_port),
                         "--scheduler-metrics-port", str(self.scheduler_metrics_port)] if metrics else [])
        self.command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model),
                        "--port", str(self.port), "--scheduler-port", str(self.scheduler_port),
                        "--device", device, "--http-port", str(self.http_port or 0), *metrics_args,
                        *(extra_args or [])]
        full_env = dict(os.environ)
        full_env.update(env or {})
        # the tree's internal token, known here so that stats() may call the scheduler
        self.internal_token = full_env.setdefault(INTERNAL_TOKEN_ENV, secrets.token_urlsafe(32))
        if num_threads is not None:
            full_env["OMP_NUM_THREADS"] = str(num_threads)
        if threading.current_thread() is threading.main_thread():
            # the tree stops when this process exits, even by SIGKILL (serve asks the kernel for
            # SIGTERM then, as serve's own children do); the signal follows the starting thread,
            # so a tree started on another thread, which may end first, is left to stop()
            full_env = child_env(full_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=full_env)
        if credentials is None:
            self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        if api_key is not None:
            self.channel = with_bearer(self.channel, api_key)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.scheduler_channel = with_bearer(
            grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}", options=CHANNEL_OPTIONS), self.internal_token)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.scheduler_channel)

    def __enter__(self) -> "ServeProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """http://127.0.0.1:PORT of the OpenAI-compatible API (ServeProcess(http_port=True))."""
        if self.http_port is None:
            raise RuntimeError("this serve has no HTTP port: start it with http_port=True")
        return f"http://127.0.0.1:{self.http_port}"

    def aio_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """pid of each child process by role: scheduler, worker-0 …, frontend."""
        roles = {}
        for pid in _children(self.proc.pid):
            role = _role(pid)
            if role is not None:
                roles[role] = pid
        return roles

    def metrics(self, process: str = "frontend", token: str | None = None) -> str:
        """The Prometheus text exposition of the frontend or the scheduler (token: the scrape
        token, PAGEDSERVE_METRICS_TOKEN, when the tree has one)."""
        port = self.metrics_port if process == "frontend" else self.scheduler_metrics_port
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()

    def health(self, service: str = READY_SERVICE) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def wait_ready(self, timeout: float | None = None) -> None:
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   f"{self.logs()[-4000:]}")
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"serve was not ready after {timeout}s; log {self.log_path}:\n{self.logs()[-4000:]}")

    def stats(self, max_recent_steps: int = 0) -> scheduler_pb2.SchedulerStats:
        return self.scheduler.GetStats(
            scheduler_pb2.GetStatsRequest(max_recent_steps=max_recent_steps), timeout=30)

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

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM to serve (it drains and stops its children); SIGKILL to the whole process
        group when it has not exited after timeout. Returns serve's exit code."""
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


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _role(pid: int) -> str | None:
    """scheduler, frontend or worker-RANK, from a `python -m pagedserve.cli ROLE …` command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "pagedserve.cli" not in argv:
        return None
    role = argv[argv.index("pagedserve.cli") + 1]
    if role == "worker":
        role = f"worker-{argv[argv.index('--rank') + 1]}"
    return role
