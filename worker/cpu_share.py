"""The worker's OpenMP threads on a CPU it shares: every core it was given, with threads that spin
briefly between parallel regions, while the other processes of the host leave those cores free;
one thread while they do not.

An OpenMP thread that finishes its share of a parallel region (a matmul, an SDPA call) waits for
the others, then for the next region. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes every
region pay a wake-up; a decode step of SmolLM2 runs hundreds of regions. Spinning makes a thread
whose sibling was descheduled burn the core that sibling needs. Measured through `serve`
(docs/scaling.md, "On one host", with bench/cpu_waits.py), spinning is the fastest on a quiet
machine and by far the slowest beside another CPU-bound process, where passive waits hold up.

So the worker spins (GOMP_SPINCOUNT=SPIN_COUNT) and watches the host: about once a second, at a
step boundary, it measures how many cores the *other* processes used (busy time in /proc/stat
minus this process's own CPU time). Above OTHERS_LIMIT cores it drops to one thread (a single
thread has no siblings to wait for, so it never spins); after CALM_CHECKS checks in a row below
half that, it goes back to all its threads. It loads its model on one thread (the load overlaps the
start of the frontend and the scheduler, whose cores spinning threads would take) and takes all its
threads the moment it is ready (`ready()`), so the first request after a start decodes at the full
thread count; only a check that sees real contention lowers it. The frontend and the scheduler of
the same `serve` use a few percent of a core, well below the limit.

None of this applies when the operator set OMP_WAIT_POLICY or GOMP_SPINCOUNT (not empty): their choice stands
and the thread count stays fixed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SPIN_COUNT = "30000"  # libgomp's unit: about 100,000 spins per millisecond
OTHERS_LIMIT = 0.5  # cores the other processes may use before the worker drops to one thread
CALM_CHECKS = 3
CHECK_SECONDS = 1.0
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def choose_openmp_waits() -> bool:
    """Sets GOMP_SPINCOUNT unless the operator chose how OpenMP threads wait; True when it did
    (the worker then adapts its thread count). An empty variable counts as unset. Must run before
    torch is imported."""
    if any(os.environ.get(name) for name in WAIT_ENV):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def host_busy_seconds() -> float | None:
    """CPU seconds all processes of the host spent busy since boot (/proc/stat), None when unknown."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    steal = ticks[7] if len(ticks) > 7 else 0
    return (sum(ticks) - idle - steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class CpuShare:
    """Decides the thread count at step boundaries (see the module docstring).

    `after_step()` returns the thread count to switch to, or None to keep the current one. The
    readers are injectable so the policy can be checked without a loaded host. A worker may start
    at one thread (`initial_threads`) while it loads; `ready()` then gives it every thread.
    """

    def __init__(self, max_threads: int, *, initial_threads: int | None = None, host_busy: Callable[[], float | None] = host_busy_seconds,
                 own_cpu: Callable[[], float] = own_cpu_seconds, clock: Callable[[], float] = time.monotonic,
                 check_seconds: float = CHECK_SECONDS) -> None:
        self.max_threads = max_threads
        self.threads = max_threads if initial_threads is None else initial_threads
        self._host_busy, self._own_cpu, self._clock = host_busy, own_cpu, clock
        self.check_seconds = check_seconds
        self._calm = 0
        self.is_ready = False
        self.other_cores = 0.0
        self._baseline = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._host_busy(), self._own_cpu()

    def ready(self) -> int | None:
        """The worker is ready to serve: every thread from now on (the count to switch to, None when
        it has them already). The next check measures from here, so the load's own busy time and
        the start of the other processes count for nothing. Only the first call counts: a worker
        that re-registers with a restarted scheduler keeps what its checks chose."""
        if self.is_ready:
            return None
        self.is_ready = True
        self._baseline = self._sample()
        self._calm = 0
        if self.threads == self.max_threads:
            return None
        self.threads = self.max_threads
        return self.max_threads

    def after_step(self) -> int | None:
        now = self._clock()
        started, busy_before, own_before = self._baseline
        elapsed = now - started
        if elapsed < self.check_seconds:
            return None
        self._baseline = sample = self._sample()
        if elapsed > 3 * self.check_seconds or busy_before is None or sample[1] is None:
            return None  # the worker idled (other processes' use then says nothing), or no /proc/stat
        self.other_cores = max(0.0, (sample[1] - busy_before) - (sample[2] - own_before)) / elapsed
        if self.threads > 1 and self.other_cores > OTHERS_LIMIT:
            self.threads, self._calm = 1, 0
            return 1
        if self.threads == 1 and self.max_threads > 1:
            self._calm = self._calm + 1 if self.other_cores < OTHERS_LIMIT / 2 else 0
            if self._calm >= CALM_CHECKS:
                self.threads = self.max_threads
                return self.max_threads
        return None
