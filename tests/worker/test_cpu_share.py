"""The worker's thread count on a shared CPU (worker/cpu_share.py): one thread while other
processes use more than OTHERS_LIMIT cores, all of them again after CALM_CHECKS calm checks; the
spin-wait default set only where the operator chose nothing."""

from __future__ import annotations

import subprocess
import sys
import time

from pagedserve.worker.cpu_share import CALM_CHECKS, OTHERS_LIMIT, CpuShare, host_busy_seconds, own_cpu_seconds


class Host:
    """A host whose other processes use `other_cores` cores while this one uses `own_cores`."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.other_cores, self.own_cores = 0.0, 1.8
        self.has_stat = True

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.own += self.own_cores * seconds
        self.busy += (self.own_cores + self.other_cores) * seconds

    def share(self, max_threads: int = 2) -> CpuShare:
        return CpuShare(max_threads, host_busy=lambda: self.busy if self.has_stat else None,
                        own_cpu=lambda: self.own, clock=lambda: self.now)


def _steps(host: Host, share: CpuShare, seconds: float, step: float = 0.05) -> list[int]:
    changes = []
    for _ in range(round(seconds / step)):
        host.advance(step)
        if (threads := share.after_step()) is not None:
            changes.append(threads)
    return changes


def test_a_quiet_host_keeps_every_thread() -> None:
    host = Host()
    share = host.share()
    host.other_cores = 0.2  # the frontend, the scheduler and a client
    assert _steps(host, share, 10.0) == []
    assert abs(share.other_cores - 0.2) < 1e-9 and share.threads == 2


def test_a_busy_host_gets_one_thread_until_it_calms_down() -> None:
    host = Host()
    share = host.share()
    host.other_cores = OTHERS_LIMIT + 0.3
    assert _steps(host, share, 1.5) == [1]
    assert _steps(host, share, 5.0) == []  # still busy: stays at one thread
    host.other_cores = OTHERS_LIMIT * 0.75  # calmer, but not below half the limit
    assert _steps(host, share, 5.0) == []
    host.other_cores = 0.1
    changes = _steps(host, share, CALM_CHECKS + 0.5)
    assert changes == [2] and share.threads == 2


def test_an_idle_gap_or_no_proc_stat_decides_nothing() -> None:
    host = Host()
    share = host.share()
    host.other_cores = 2.0
    host.advance(30.0)  # the worker waited for work; the host's load then says nothing about its steps
    assert share.after_step() is None
    host.has_stat = False
    assert _steps(host, share, 5.0) == []
    assert share.threads == 2


def test_one_thread_workers_never_change() -> None:
    host = Host()
    share = host.share(max_threads=1)
    host.other_cores = 2.0
    assert _steps(host, share, 5.0) == []


def test_another_process_spinning_shows_up_as_other_cores() -> None:
    share = CpuShare(2, check_seconds=1.0)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.5)
        share._baseline = (time.monotonic(), host_busy_seconds(), own_cpu_seconds())
        time.sleep(1.0)
        share.after_step()
    finally:
        spinner.wait()
    assert share.other_cores > OTHERS_LIMIT, share.other_cores


def _waits(env: dict[str, str]) -> list[str]:
    code = ("import os, sys; from pagedserve.worker.cpu_share import choose_openmp_waits; "
            "adapts = choose_openmp_waits(); "
            "print(adapts, os.environ.get('GOMP_SPINCOUNT', '-') or '-', 'torch' in sys.modules)")
    clean = {key: value for key, value in __import__("os").environ.items()
             if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**clean, **env}).stdout.split()


def test_the_worker_spins_briefly_unless_the_operator_chose() -> None:
    assert _waits({}) == ["True", "30000", "False"]
    assert _waits({"GOMP_SPINCOUNT": ""}) == ["True", "30000", "False"]  # empty counts as unset
    assert _waits({"OMP_WAIT_POLICY": "PASSIVE"}) == ["False", "-", "False"]
    assert _waits({"GOMP_SPINCOUNT": "0"}) == ["False", "0", "False"]


def test_a_worker_loading_on_one_thread_takes_all_when_ready_and_only_contention_lowers_it() -> None:
    host = Host()
    share = CpuShare(2, initial_threads=1, host_busy=lambda: host.busy, own_cpu=lambda: host.own,
                     clock=lambda: host.now)
    host.other_cores = OTHERS_LIMIT + 0.5  # the frontend and the scheduler starting beside the load
    host.advance(5.0)
    assert share.ready() == 2 and share.threads == 2  # ready: the first request gets every thread
    host.other_cores = 0.1
    assert _steps(host, share, 5.0) == []  # the busy start before ready counts for nothing
    host.other_cores = OTHERS_LIMIT + 0.3
    assert _steps(host, share, 1.2) == [1]  # real contention lowers it
    assert share.ready() is None and share.threads == 1  # a second ready (a scheduler restart) keeps it
    host.other_cores = 0.1
    assert _steps(host, share, CALM_CHECKS + 0.5) == [2]


def test_ready_changes_nothing_for_a_worker_that_has_every_thread() -> None:
    host = Host()
    share = host.share()
    assert share.ready() is None and share.threads == 2
