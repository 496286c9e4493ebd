"""`pagedserve serve`: starts scheduler, workers and frontend as child processes and stops them all.

    serve ─┬─ scheduler            (internal gRPC + ZeroMQ PUB/PULL on free local ports)
           ├─ worker rank 0 … TP-1 (each subscribes to the plans)
           └─ frontend             (public gRPC on --host:--port)

    serve --data-parallel-size N ─┬─ replica-0 … N-1  (each `serve --replica-index i`: a scheduler
                                  │                    and its ranks, restarted as below)
                                  └─ frontend         (--scheduler-address of every replica)

Before starting anything, serve checks the model against the flags and the host
(pagedserve.launch.serve_preflight): a model that cannot run so is a message and exit code 2.

SIGINT/SIGTERM stops the frontend first (no new requests), then the scheduler (which tells the
workers to exit), then whatever worker is left.

A child that exits on its own (serve polls the scheduler's readiness to tell what was serving):

    exit code 2 before the replica served    a configuration error: serve stops, exit 2
    anything before the replica first served serve stops, exit 1 (restarting would not help)
    the frontend                             started again on the same ports; the streams it was
                                             serving ended with UNAVAILABLE (their connections
                                             closed) and the scheduler aborted their requests
    a worker rank                            the other ranks are stopped (their process group is
                                             broken) and every rank is started again
    the scheduler                            started again on the same ports; the workers outlive
                                             it and register with the new one

Restarts follow pagedserve.launch.restart_policy: back-off 1 s, 2 s, 4 s … up to 30 s, at most
--max-worker-restarts (workers), --max-scheduler-restarts or --max-frontend-restarts in a row,
each refilled once the replica has been ready for --restart-reset-after seconds. While the workers restart the scheduler
holds the requests in flight (health NOT_SERVING meanwhile), resets its block pool when the new
ranks register, and computes each request again from the tokens it already holds, so streams
continue where they were; an idle replica's crash costs one restart like a busy one's. With no
worker restart left the scheduler fails the in-flight requests with UNAVAILABLE and reports not
ready, and frontend and scheduler keep answering until `serve` is stopped, which then exits 1; with
no scheduler or frontend restart left serve stops (exit 1). Children also get SIGTERM from the kernel if
`serve` itself dies (pagedserve.launch.parent_death), so nothing is orphaned.

Which children start with which flags is decided by serve_config.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from pagedserve.log import configure_logging
from pagedserve.checkpoints.model_config import load_model_info
from pagedserve.security.internal_token import INTERNAL_TOKEN_ENV, ensure_internal_token
from pagedserve.launch.parent_death import child_env
from pagedserve.security.zmq_curve import CURVE_ENVS, curve_env_for, ensure_curve_keys
from pagedserve.launch.replica_probe import ReplicaProbe
from pagedserve.launch.restart_policy import RestartBudget
from pagedserve.launch.serve_config import ServeConfig
from pagedserve.launch.serve_preflight import check_deployment

STOP_TIMEOUT_SECONDS = 10.0  # frontend and scheduler get their drain plus this; workers this alone
CONFIG_ERROR_EXIT = 2  # what `pagedserve` exits with on a usage or configuration error
CONFIG_ERROR_GRACE_S = 2.0  # how long an early crash waits for another child's configuration error
POLL_SECONDS = 0.2
PROBE_SECONDS = 0.5
# Until the replica first serves, the scheduler is asked every STARTUP_POLL_SECONDS: a frontend
# polling it too may turn SERVING first, and a rank that dies after that must count as a crash of a
# serving replica (restarted), not as a replica that never became ready (serve stops).
STARTUP_POLL_SECONDS = 0.05
RESTART_GROUPS = ("workers", "scheduler", "frontend")  # each with its own RestartBudget


class Supervisor:
    def __init__(self, config: ServeConfig, probe: ReplicaProbe | None = None) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}
        self._stopping = False
        self._handled: set[str] = set()  # children whose exit was dealt with
        self._failed: set[str] = set()  # children that exited on their own and were not started again
        self._is_replica_lost = False  # a rank exited: the others are being stopped
        self._has_served = False  # the replica was ready at least once
        self._seen_ready: dict[str, bool] = {}  # per child: the replica was ready since it started
        self._budgets = {group: RestartBudget(config.restart_policy(group)) for group in RESTART_GROUPS}
        self._due: dict[str, float] = {}  # a group of RESTART_GROUPS -> when to start it again
        self._probe = probe or ReplicaProbe(config.scheduler_address)
        self._next_probe = 0.0
        self._drain_timeout = config.shutdown_timeout + STOP_TIMEOUT_SECONDS
        self._log = configure_logging("serve")
        self.command = [sys.executable, "-m", "pagedserve.cli"]  # + a child's args

    def _spawn(self, name: str, args: list[str]) -> None:
        command = [*self.command, *args]
        role = name.split("-")[0]  # scheduler, worker-R, frontend, replica-I (a serve: every key)
        env = curve_env_for(role, child_env(self.config.env))  # only the CURVE keys of its role
        self.children[name] = subprocess.Popen(command, env=env)
        self._handled.discard(name)
        self._seen_ready[name] = False
        self._log.info("child_started", child=name, pid=self.children[name].pid)

    def _spawn_workers(self) -> None:
        for rank, args in enumerate(self.config.worker_args):
            self._spawn(f"worker-{rank}", args)
        self._is_replica_lost = False

    def start(self) -> None:
        if self.config.has_replica_children:  # --data-parallel-size N: each replica supervises itself
            for index, args in enumerate(self.config.replica_args):
                self._spawn(f"replica-{index}", args)
        else:
            self._spawn("scheduler", self.config.scheduler_args)
            self._spawn_workers()
        if not self.config.is_replica_only:
            self._spawn("frontend", self.config.frontend_args)
        self._log.info("serving", address=self.config.public_address, model=self.config.model)

    def stop(self) -> None:
        self._stopping = True
        self._due.clear()
        order = ["frontend", "scheduler", *self._replica_names()] + self._worker_names()
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

    def _replica_names(self) -> list[str]:
        return [name for name in self.children if name.startswith("replica-")]

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

    def _wait(self, child: subprocess.Popen, name: str) -> None:
        try:
            if name.startswith("replica-"):  # its scheduler drains, then its workers stop
                timeout = self._drain_timeout + STOP_TIMEOUT_SECONDS
            else:
                timeout = self._drain_timeout if name in ("frontend", "scheduler") else STOP_TIMEOUT_SECONDS
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            self._log.warning("child_killed", child=name, pid=child.pid)
            child.kill()
            child.wait()

    # ---- watching -----------------------------------------------------------------------------

    def watch(self) -> int:
        """Blocks until a signal stops serving, or serving cannot go on; returns serve's exit code:
        0, 1 when a child exited on its own and was not started again, 2 on a configuration error.
        """
        code = None
        while not self._stopping and code is None:
            now = time.monotonic()
            self._observe_readiness(now)
            exits = [(name, child, child.poll()) for name, child in list(self.children.items())
                     if name not in self._handled and child.poll() is not None]
            # a configuration error explains the other children's exits: it is handled first
            exits.sort(key=lambda item: item[2] != CONFIG_ERROR_EXIT)
            for name, child, exit_code in exits:
                if self._stopping:
                    break
                self._handled.add(name)
                code = self._on_exit(name, child, exit_code)
                if code is not None:
                    break
            if code is None:
                self._start_due(time.monotonic())
                time.sleep(POLL_SECONDS if self._has_served else STARTUP_POLL_SECONDS)
        self.stop()  # also stops a child started while a signal was being handled
        self._probe.close()
        if code is not None:
            return code
        return 1 if self._failed else 0

    def _observe_readiness(self, now: float) -> None:
        if now < self._next_probe:
            return
        self._next_probe = now + (PROBE_SECONDS if self._has_served else STARTUP_POLL_SECONDS)
        if not self._probe.is_ready():
            for budget in self._budgets.values():
                budget.note_not_ready()
            return
        if not self._has_served:
            self._log.info("replica_ready")
        self._has_served = True
        for name, child in self.children.items():
            if child.poll() is None:
                self._seen_ready[name] = True
        for budget in self._budgets.values():
            budget.note_ready(now)

    def _config_error_follows(self, name: str) -> tuple[str, subprocess.Popen, int] | None:
        """The child that exits with a configuration error within CONFIG_ERROR_GRACE_S of `name`'s
        exit, if any: ranks failing together on one bad setting do not exit at the same instant."""
        deadline = time.monotonic() + CONFIG_ERROR_GRACE_S
        while True:
            for other, child in list(self.children.items()):
                if other != name and other not in self._handled and child.poll() == CONFIG_ERROR_EXIT:
                    return other, child, CONFIG_ERROR_EXIT
            if time.monotonic() >= deadline or self._stopping:
                return None
            time.sleep(POLL_SECONDS)

    def _on_exit(self, name: str, child: subprocess.Popen, code: int) -> int | None:
        """Deals with one child's exit; returns serve's exit code when serving cannot go on."""
        is_worker = name.startswith("worker")
        event = {"child": name, "pid": child.pid, "exit_code": code}
        if is_worker and self._is_replica_lost:  # a rank stopped because another one exited
            self._log.info("child_exited", **event)
            return None
        self._failed.add(name)
        if code == CONFIG_ERROR_EXIT and not self._seen_ready.get(name, False):
            self._log.error("child_exited", **event,
                            consequence="a configuration error (its message is above): serve stops")
            return CONFIG_ERROR_EXIT
        if name.startswith("replica-"):  # a replica restarts its own children
            self._log.error("child_exited", **event, consequence="serve stops")
            return 1
        if not self._has_served:
            explaining = self._config_error_follows(name)
            if explaining is not None:  # handled in its place: its message explains this exit
                self._log.info("child_exited", **event, consequence="another child reports a configuration error")
                self._handled.add(explaining[0])
                return self._on_exit(*explaining)
            self._log.error("child_exited", **event,
                            consequence="serve stops: the replica never became ready, restarts are "
                                        "for a replica that was serving")
            return 1
        group = "workers" if is_worker else name  # or "scheduler", "frontend"
        budget = self._budgets[group]
        delay = budget.take(time.monotonic())
        if is_worker:
            self._is_replica_lost = True
        if delay is None:
            if not is_worker:
                self._log.error("child_exited", **event, consequence=f"no {group} restart left: serve stops")
                return 1
            self._log.error("child_exited", **event,
                            consequence="no worker restart left: the replica is not ready until serve "
                                        "is restarted")
            threading.Thread(target=self._stop_workers, name="stop-workers", daemon=True).start()
            return None
        self._failed.discard(name)
        self._log.error("child_exited", **event, consequence=f"restarting the {group}",
                        delay_seconds=delay, restarts_left=budget.num_left(time.monotonic()))
        if is_worker:
            self._stop_workers()  # on this thread, which starts them again: see parent_death
        self._due[group] = time.monotonic() + delay
        return None

    def _start_due(self, now: float) -> None:
        for group, due in list(self._due.items()):
            if now < due or self._stopping:
                continue
            del self._due[group]
            if group == "workers":
                self._spawn_workers()
            elif group == "frontend":
                self._spawn("frontend", self.config.frontend_args)
            else:
                self._spawn("scheduler", self.config.scheduler_args)


def run_serve(config: ServeConfig) -> int:
    """Checks the deployment (a PreflightError is a ValueError: `pagedserve` prints it and exits
    2), then serves until a signal."""
    check_deployment(load_model_info(config.model), config.deployment())
    token = ensure_internal_token()  # the children's internal gRPC token (pagedserve.security.internal_token)
    ensure_curve_keys()  # and their ZeroMQ CURVE keys (pagedserve.security.zmq_curve)
    if config.env is not None:
        config.env.setdefault(INTERNAL_TOKEN_ENV, token)
        for name in CURVE_ENVS:
            config.env.setdefault(name, os.environ[name])
    supervisor = Supervisor(config)

    def on_signal(signum, frame) -> None:
        supervisor._log.info("stopping", signal=signal.Signals(signum).name)
        supervisor.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    supervisor.start()
    return supervisor.watch()
