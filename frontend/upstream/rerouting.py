"""Which replica one request runs on, when a frontend has several, and when it moves to another.

```
 start ──► place(): a ready replica (router.py's choice) ── none: UNAVAILABLE
             │
 refused before its first output (UNAVAILABLE,     ──► move(): another ready replica, not tried
   RESOURCE_EXHAUSTED), or lost mid-stream                by this request yet (a continuation when
   (SchedulerLost; resuming streamed tokens needs          tokens were streamed) ── none left: the
   --scheduler-recovery-timeout)                           single-scheduler handling applies
 end ──► release()
```

A refusal that comes after output is not moved: the client has seen the request running there.
The replica counts the request in flight (its load, for routing) from place() to release().
"""

from __future__ import annotations

from pagedserve.frontend.upstream.replica_set import Replica, ReplicaSet
from pagedserve.frontend.upstream.scheduler_client import SchedulerError, SchedulerLost, SchedulerUnavailable


class Rerouting:
    """The replica of one request: `place()` once, `move()` on a refusal or loss, `release()` at the end."""

    def __init__(self, replicas: ReplicaSet, prompt_token_ids: list[int]) -> None:
        self._replicas = replicas
        self._prompt_token_ids = prompt_token_ids
        self.replica: Replica | None = None
        self._tried: set[int] = set()  # refused or lost this request

    def place(self) -> Replica:
        """A ready replica for the request; raises SchedulerUnavailable when none is."""
        replica = self._replicas.place(self._prompt_token_ids)
        if replica is None:
            raise SchedulerUnavailable(f"no scheduler replica is ready ({self._replicas.address})")
        self.replica = replica
        return replica

    def move(self, error: SchedulerError, *, has_output_since_submit: bool, is_accepted: bool,
             can_resume: bool) -> Replica | None:
        """Another ready replica for a request refused before its first output since its last
        submission, or whose replica was lost (one that had been accepted only when it can resume);
        None when the rule does not apply or no untried replica is ready."""
        if self.replica is None:
            return None
        is_lost = isinstance(error, SchedulerLost)
        if not is_lost and has_output_since_submit:
            return None
        if is_lost and is_accepted and not can_resume:
            return None  # resuming tokens already streamed is recovery, which is off
        self._tried.add(self.replica.index)
        replica = self._replicas.place(self._prompt_token_ids, frozenset(self._tried))
        if replica is None:
            return None
        self._replicas.release(self.replica)
        self.replica = replica
        return replica

    def release(self) -> None:
        if self.replica is not None:
            self._replicas.release(self.replica)
            self.replica = None
