"""`pagedserve serve`: starts scheduler, workers and frontend as child processes and stops them all.

    serve ─┬─ scheduler            (internal gRPC + ZeroMQ PUB/PULL on free local ports)
           ├─ worker rank 0 … TP-1 (each subscribes to the plans)
           └─ frontend             (public gRPC on --host:--port)

SIGINT/SIGTERM stops the frontend first (no new requests), then the scheduler (which tells the
workers to exit), then whatever worker is left. A frontend or scheduler that exits on its own is
reported and takes the others down with it (exit 1). A worker rank that exits on its own does not.
The other ranks of the replica are stopped (their process group is broken) and, while
--max-worker-restarts allows (default 3), every rank is started again: the scheduler holds the
requests in flight (health NOT_SERVING meanwhile), resets its block pool when the new ranks
register, and computes each request again from the tokens it already holds, so streams continue
where they were. With no restart left the scheduler fails the in-flight requests with UNAVAILABLE
and reports not ready, and frontend and scheduler keep answering until `serve` is stopped, which
then exits 1. Children also
get SIGTERM from the kernel if `serve` itself dies (PR_SET_PDEATHSIG), so nothing is orphaned.

Which children start with which flags is decided by serve_config.py.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time

from pagedserve.log import configure_logging
from pagedserve.serve_config import ServeConfig

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_SECONDS = 10.0  # frontend and scheduler get their drain plus this; workers this alone


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Supervisor:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}
        self._stopping = False
        self._exited: set[str] = set()
        self._is_replica_lost = False
        self._restarts_left = config.max_worker_restarts
        self._drain_timeout = config.shutdown_timeout + STOP_TIMEOUT_SECONDS
        self._log = configure_logging("serve")

    def _spawn(self, name: str, args: list[str]) -> None:
        command = [sys.executable, "-m", "pagedserve.cli", *args]
        self.children[name] = subprocess.Popen(command, preexec_fn=_die_with_parent,
                                               env=self.config.env)
        self._log.info("child_started", child=name, pid=self.children[name].pid)

    def start(self) -> None:
        self._spawn("scheduler", self.config.scheduler_args)
        for rank, args in enumerate(self.config.worker_args):
            self._spawn(f"worker-{rank}", args)
        self._spawn("frontend", self.config.frontend_args)
        self._log.info("serving", address=self.config.public_address, model=self.config.model)

    def stop(self) -> None:
        self._stopping = True
        order = ["frontend", "scheduler"] + self._worker_names()
        for name in order:
            child = self.children.get(name)
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGTERM)
                if name in ("frontend", "scheduler"):
                    self._wait(child, name)
        for name in order:
            child = self.children.get(name)
            if child is not None:
                self._wait(child, name)

    def _worker_names(self) -> list[str]:
        return [name for name in self.children if name.startswith("worker")]

    def _stop_workers(self) -> None:
        """SIGTERM to every live rank, SIGKILL to any still there after STOP_TIMEOUT_SECONDS."""
        live = [(name, self.children[name]) for name in self._worker_names()
                if self.children[name].poll() is None]
        for name, child in live:
            self._log.info("worker_stopping", child=name, pid=child.pid,
                           reason="another rank of the replica exited")
            child.send_signal(signal.SIGTERM)
        for name, child in live:
            self._wait(child, name)

    def _restart_workers(self) -> None:
        """Stops what is left of the replica (its process group is broken), then starts every
        rank again; the scheduler resumes the held requests once they register."""
        self._stop_workers()
        if self._stopping:
            return
        for rank, args in enumerate(self.config.worker_args):
            name = f"worker-{rank}"
            self._spawn(name, args)
            self._exited.discard(name)
        self._is_replica_lost = False

    def _wait(self, child: subprocess.Popen, name: str) -> None:
        try:
            child.wait(self._drain_timeout if name in ("frontend", "scheduler") else STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self._log.warning("child_killed", child=name, pid=child.pid)
            child.kill()
            child.wait()

    def watch(self) -> int:
        """Blocks until a signal stops serving; exit 0, or 1 when a child had exited on its own.

        The frontend or scheduler exiting stops everything at once; a worker exiting stops the
        other ranks of its replica and leaves the replica unready (see the module docstring).
        """
        while not self._stopping:
            for name, child in list(self.children.items()):
                code = child.poll()
                if code is None or self._stopping or name in self._exited:
                    continue
                self._exited.add(name)
                if not name.startswith("worker"):
                    self._log.error("child_exited", child=name, pid=child.pid, exit_code=code)
                    self.stop()
                    return 1
                if self._is_replica_lost:  # a rank stopped because another one exited
                    self._log.info("child_exited", child=name, pid=child.pid, exit_code=code)
                    continue
                self._is_replica_lost = True
                if self._restarts_left > 0:
                    self._restarts_left -= 1
                    self._log.error("child_exited", child=name, pid=child.pid, exit_code=code,
                                    consequence="restarting the workers",
                                    restarts_left=self._restarts_left)
                    self._restart_workers()  # on this thread: PR_SET_PDEATHSIG follows the spawner
                    continue
                self._log.error("child_exited", child=name, pid=child.pid, exit_code=code,
                                consequence="replica not ready until its ranks are restarted")
                threading.Thread(target=self._stop_workers, name="stop-workers",
                                 daemon=True).start()
            time.sleep(0.2)
        return 1 if self._exited else 0


def run_serve(config: ServeConfig) -> int:
    supervisor = Supervisor(config)

    def on_signal(signum, frame) -> None:
        supervisor._log.info("stopping", signal=signal.Signals(signum).name)
        supervisor.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    supervisor.start()
    return supervisor.watch()
