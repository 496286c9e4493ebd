"""What `serve` (pagedserve/launch/supervisor.py) does when a child exits on its own, with stand-in
children (small Python processes that sleep, or exit with a chosen code) and a readiness probe the
test sets, so each rule is checked in a second or two:

    exit 2 before the replica served   serve ends with 2
    any exit before it ever served     serve ends with 1
    a worker crash after it served     every rank started again after the back-off, one restart spent
    a scheduler crash                  the scheduler alone started again
    a frontend crash                   the frontend alone started again
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from pagedserve.launch.restart_policy import RestartPolicy
from pagedserve.launch.supervisor import Supervisor

CHILD = """
import sys, time
args = sys.argv[1:]
if "--exit" in args:
    time.sleep(float(args[args.index("--after") + 1]) if "--after" in args else 0)
    sys.exit(int(args[args.index("--exit") + 1]))
time.sleep(600)
"""
DELAY_S = 0.3  # the back-off the tests use instead of 1 s


@dataclass
class FakeConfig:
    worker_args: list[list[str]] = field(default_factory=lambda: [["worker", "--rank", "0"]])
    scheduler_args: list[str] = field(default_factory=lambda: ["scheduler"])
    frontend_args: list[str] = field(default_factory=lambda: ["frontend"])
    max_restarts: int = 2
    env: dict | None = None
    shutdown_timeout: float = 1.0
    scheduler_address: str = "127.0.0.1:1"
    public_address: str = "127.0.0.1:2"
    model: str = "stand-in"
    replica_args: list[list[str]] = field(default_factory=list)  # no --data-parallel-size
    has_replica_children: bool = False
    is_replica_only: bool = False

    def restart_policy(self, group: str) -> RestartPolicy:
        return RestartPolicy(max_restarts=self.max_restarts, initial_delay_s=DELAY_S, max_delay_s=DELAY_S)


class FakeProbe:
    def __init__(self) -> None:
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready

    def close(self) -> None:
        pass


class Running:
    """A Supervisor watching its stand-in children on a thread; `code` once watch() returned."""

    def __init__(self, config: FakeConfig, ready: bool = False) -> None:
        self.probe = FakeProbe()
        self.probe.ready = ready
        self.supervisor = Supervisor(config, probe=self.probe)
        self.supervisor.command = [sys.executable, "-c", CHILD]
        self.code: int | None = None
        self.supervisor.start()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        self.code = self.supervisor.watch()

    def pid(self, name: str) -> int:
        return self.supervisor.children[name].pid

    def wait_code(self, timeout: float = 20.0) -> int | None:
        self._thread.join(timeout)
        return self.code

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> int | None:
        self.supervisor.stop()
        return self.wait_code()


def _wait_served(running: Running) -> None:
    assert running.wait_for(lambda: running.supervisor._has_served), "the probe was not polled"
    assert running.wait_for(lambda: all(running.supervisor._seen_ready.values()))


def test_a_configuration_error_at_start_ends_serve_with_2():
    running = Running(FakeConfig(worker_args=[["worker", "--exit", "2"]]))
    started = time.monotonic()
    assert running.wait_code() == 2
    assert time.monotonic() - started < 5
    assert all(child.poll() is not None for child in running.supervisor.children.values())


def test_a_configuration_error_explains_the_other_ranks_exits():
    # rank 0 fails first, as a rank does when its peer's configuration error breaks their rendezvous
    running = Running(FakeConfig(worker_args=[["worker", "--rank", "0", "--exit", "1", "--after", "0.3"],
                                              ["worker", "--rank", "1", "--exit", "2", "--after", "1.0"]]))
    assert running.wait_code() == 2


def test_a_crash_before_the_replica_ever_served_ends_serve_with_1():
    running = Running(FakeConfig(worker_args=[["worker", "--exit", "1", "--after", "0.3"]]))
    assert running.wait_code() == 1
    assert len([name for name in running.supervisor.children if name.startswith("worker")]) == 1


def test_a_worker_crash_after_serving_costs_one_restart_and_serve_ends_0():
    running = Running(FakeConfig(worker_args=[["worker", "--rank", "0"], ["worker", "--rank", "1"]]),
                      ready=True)
    try:
        _wait_served(running)
        scheduler, rank0, rank1 = running.pid("scheduler"), running.pid("worker-0"), running.pid("worker-1")
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        assert running.wait_for(lambda: running.pid("worker-1") != rank1 and running.pid("worker-0") != rank0)
        assert time.monotonic() - killed_at >= DELAY_S  # the back-off
        assert running.pid("scheduler") == scheduler
        assert running.supervisor._budgets["workers"].num_used == 1
        assert running.supervisor._budgets["scheduler"].num_used == 0
    finally:
        code = running.stop()
    assert code == 0  # the crash was recovered


def test_a_scheduler_crash_restarts_the_scheduler_alone():
    running = Running(FakeConfig(), ready=True)
    try:
        _wait_served(running)
        scheduler, worker, frontend = (running.pid(name) for name in ("scheduler", "worker-0", "frontend"))
        os.kill(scheduler, signal.SIGKILL)
        assert running.wait_for(lambda: running.pid("scheduler") != scheduler)
        assert (running.pid("worker-0"), running.pid("frontend")) == (worker, frontend)
        assert running.supervisor._budgets["scheduler"].num_used == 1
    finally:
        assert running.stop() == 0


def test_with_no_scheduler_restart_left_serve_ends_with_1():
    running = Running(FakeConfig(max_restarts=0), ready=True)
    _wait_served(running)
    os.kill(running.pid("scheduler"), signal.SIGKILL)
    assert running.wait_code() == 1


def test_with_no_worker_restart_left_the_replica_stays_down_and_serve_ends_1():
    running = Running(FakeConfig(max_restarts=1), ready=True)
    try:
        _wait_served(running)
        first = running.pid("worker-0")
        os.kill(first, signal.SIGKILL)
        assert running.wait_for(lambda: running.pid("worker-0") != first)
        second = running.pid("worker-0")
        os.kill(second, signal.SIGKILL)
        time.sleep(DELAY_S * 3)
        assert running.pid("worker-0") == second  # not started again
        assert running.code is None  # frontend and scheduler keep answering
    finally:
        assert running.stop() == 1


def test_a_frontend_crash_restarts_the_frontend_alone_after_the_back_off():
    running = Running(FakeConfig(), ready=True)
    try:
        _wait_served(running)
        scheduler, worker, frontend = (running.pid(name) for name in ("scheduler", "worker-0", "frontend"))
        killed_at = time.monotonic()
        os.kill(frontend, signal.SIGKILL)
        assert running.wait_for(lambda: running.pid("frontend") != frontend)
        assert time.monotonic() - killed_at >= DELAY_S  # the back-off
        assert (running.pid("scheduler"), running.pid("worker-0")) == (scheduler, worker)
        assert running.supervisor._budgets["frontend"].num_used == 1
        assert running.supervisor._budgets["scheduler"].num_used == 0
        assert running.code is None
    finally:
        assert running.stop() == 0  # the crash was recovered


def test_with_no_frontend_restart_left_serve_ends_with_1():
    running = Running(FakeConfig(max_restarts=1), ready=True)
    _wait_served(running)
    first = running.pid("frontend")
    os.kill(first, signal.SIGKILL)
    assert running.wait_for(lambda: running.pid("frontend") != first)
    _wait_served(running)
    os.kill(running.pid("frontend"), signal.SIGKILL)
    assert running.wait_code() == 1


def test_a_frontend_exit_before_the_replica_served_ends_serve():
    running = Running(FakeConfig(frontend_args=["frontend", "--exit", "3", "--after", "0.5"]))
    assert running.wait_code() == 1


class CountingProbe(FakeProbe):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def is_ready(self) -> bool:
        self.calls += 1
        return self.ready


def test_the_scheduler_is_asked_often_until_the_replica_first_serves():
    """A frontend polling the scheduler may see it ready first: serve asks every
    STARTUP_POLL_SECONDS until then (so that a rank dying soon after counts as a crash of a
    serving replica), then every PROBE_SECONDS."""
    from pagedserve.launch import supervisor

    running = Running(FakeConfig())
    probe = running.probe = running.supervisor._probe = CountingProbe()
    try:
        time.sleep(1.0)
        starting = probe.calls
        assert starting >= 0.5 / supervisor.STARTUP_POLL_SECONDS
        probe.ready = True
        _wait_served(running)
        before = probe.calls
        time.sleep(1.0)
        assert probe.calls - before <= 1.0 / supervisor.PROBE_SECONDS + 1
    finally:
        assert running.stop() == 0
