"""When `serve` starts a child again after it exited on its own: back-off and a budget that refills.

    crash ──▶ restart left? ──no──▶ give up (workers: replica unready; scheduler: serve exits 1)
                  │ yes
                  ▼
            wait 1 s, 2 s, 4 s, 8 s … (at most 30 s), then start it again

A crash costs one restart. The budget (max_restarts) and the back-off both start over once the
replica has been ready for reset_after_s without a crash (10 minutes by default), so a server
that loses a worker once a day keeps serving, while one that crashes in a loop stops retrying
after max_restarts. This is what systemd does with StartLimitBurst= within StartLimitIntervalSec=
(5 starts by default) and the kubelet with its CrashLoopBackOff (doubling, reset after 10 minutes
of running).

Times are passed in (`now`, seconds on a monotonic clock), so the policy is tested without
waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESET_AFTER_S = 600.0
INITIAL_DELAY_S = 1.0
MAX_DELAY_S = 30.0


class RestartPolicyError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS
    reset_after_s: float = DEFAULT_RESET_AFTER_S
    initial_delay_s: float = INITIAL_DELAY_S
    max_delay_s: float = MAX_DELAY_S

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise RestartPolicyError(f"max_restarts must be an int >= 0, not {self.max_restarts!r}")
        for name in ("reset_after_s", "initial_delay_s", "max_delay_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise RestartPolicyError(f"{name} must be a finite number >= 0, not {value!r}")
        if self.max_delay_s < self.initial_delay_s:
            raise RestartPolicyError("max_delay_s must be >= initial_delay_s")

    def delay(self, num_restarts_before: int) -> float:
        """Seconds to wait before the restart that follows num_restarts_before others in a row."""
        return min(self.initial_delay_s * 2 ** min(num_restarts_before, 62), self.max_delay_s)


class RestartBudget:
    """The restarts one supervised part (the workers, the scheduler) has left, and its back-off.

        budget.note_ready(now)      the replica is ready (polled); starts or continues a healthy period
        budget.note_not_ready()     ends it
        budget.take(now)            at a crash: seconds to wait before restarting, or None (none left)
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_used = 0  # restarts since the budget last refilled
        self._ready_since: float | None = None

    def note_ready(self, now: float) -> None:
        if self._ready_since is None:
            self._ready_since = now

    def note_not_ready(self) -> None:
        self._ready_since = None

    def _refill(self, now: float) -> None:
        if self._ready_since is not None and now - self._ready_since >= self.policy.reset_after_s:
            self.num_used = 0

    def num_left(self, now: float) -> int:
        self._refill(now)
        return self.policy.max_restarts - self.num_used

    def take(self, now: float) -> float | None:
        """Spends one restart: the back-off delay before it, or None when the budget is spent."""
        self._refill(now)
        self._ready_since = None  # the crash ends the healthy period
        if self.num_used >= self.policy.max_restarts:
            return None
        delay = self.policy.delay(self.num_used)
        self.num_used += 1
        return delay
